"""Which ranks share a node, and the process groups that follow from it.

Nodes are blocks of `node_size` consecutive global ranks (torchrun's layout).
The intra-node group of a rank holds its node; the cross-node group holds the
ranks with the same local rank on every node. Every rank creates every group in
the same order (torch.distributed requires it), and keeps its own two.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Topology:
    """Static layout of the job: pure data, usable without a process group."""

    world_size: int
    node_size: int

    def __post_init__(self) -> None:
        if self.world_size <= 0 or self.node_size <= 0:
            raise ValueError(
                f"world_size and node_size must be positive, got {self.world_size}, {self.node_size}"
            )

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.node_size)

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def intra_node_groups(self) -> list[list[int]]:
        """Ranks of each node, node by node."""
        return [
            list(range(n * self.node_size, min((n + 1) * self.node_size, self.world_size)))
            for n in range(self.num_nodes)
        ]

    def cross_node_groups(self) -> list[list[int]]:
        """For each local rank, the ranks holding it on every node."""
        return [
            [
                n * self.node_size + local
                for n in range(self.num_nodes)
                if n * self.node_size + local < self.world_size
            ]
            for local in range(self.node_size)
        ]


def default_node_size(world_size: int) -> int:
    """LOCAL_WORLD_SIZE as torchrun sets it, else one node for the whole world."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else world_size


@dataclass(frozen=True)
class Groups:
    """The process groups one rank uses, by name (what functional collectives take)."""

    world: str
    intra_node: str
    cross_node: str
    mesh: DeviceMesh | None = field(default=None, compare=False)
    """The 2-D (node, local) mesh the intra- and cross-node groups come from:
    the user's, or one built from `node_size`; None when nodes are uneven
    (`world_size % node_size != 0`), where the groups are enumerated instead."""


# Keyed by the default process group too: tests (and the CLI) create and destroy
# several worlds in one process. The value keeps the groups alive so their
# names stay unique while cached.
_GROUPS: dict[tuple, tuple[list[dist.ProcessGroup], Groups]] = {}
# (world epoch, group name) -> ranks per node of the topology that group serves.
# A group serves one topology only, so the ledger and the schedule split a
# collective's bytes by its own model's nodes, even with two models in a process.
_NODE_SIZE: dict[tuple[int, str], int] = {}


_SEEN_WORLDS: dict[int, dist.ProcessGroup] = {}


def world_epoch() -> int:
    """Identifies the current default process group (changes when it is
    re-created). The groups seen are kept referenced, so that a destroyed
    group's id is never reused by a new one (caches keyed by it would return
    the dead group's subgroups)."""
    world = dist.distributed_c10d._get_default_group()
    _SEEN_WORLDS.setdefault(id(world), world)
    return id(world)


def node_size_of(group_name: str) -> int | None:
    """Ranks per node of the topology whose group this is (None: not zppc's)."""
    return _NODE_SIZE.get((world_epoch(), group_name))


def setup_groups(
    topology: Topology, mesh: DeviceMesh | None = None, timeout_s: float | None = None
) -> Groups:
    """The world, intra-node and cross-node groups of one topology: those of a
    2-D `mesh` (nodes x ranks per node), the user's or else one built here;
    collective (every rank calls it in the same order). The world group is
    zppc's own (not WORLD), so each group belongs to one topology and carries
    zppc's timeout: every operation on these groups fails after `timeout_s`
    seconds instead of the backend's default (30 minutes for gloo)."""
    key = (world_epoch(), topology.world_size, topology.node_size, timeout_s, id(mesh))
    if key in _GROUPS:
        return _GROUPS[key][1]
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    world = dist.new_group(list(range(topology.world_size)), timeout=timeout)
    if mesh is None or mesh.ndim != 2:
        mesh = _node_mesh(topology) if topology.world_size % topology.node_size == 0 else None
    if mesh is not None:
        intra, cross = mesh.get_group(1), mesh.get_group(0)
    else:
        # Uneven nodes: no mesh has this shape.
        intra, _ = dist.new_subgroups_by_enumeration(topology.intra_node_groups())
        cross, _ = dist.new_subgroups_by_enumeration(topology.cross_node_groups())
    if timeout is not None:
        for group in (intra, cross):
            _set_timeout(group, timeout)
    groups = Groups(
        world=world.group_name, intra_node=intra.group_name, cross_node=cross.group_name, mesh=mesh
    )
    alive = [world, intra, cross]
    for name in (groups.world, groups.intra_node, groups.cross_node):
        _NODE_SIZE.setdefault((world_epoch(), name), topology.node_size)
    if dist.get_backend() in TWINNED_BACKENDS:
        alive += _create_twins(topology, (world, intra, cross), timeout)
    if has_hop_groups(topology, dist.get_backend()):
        alive += _create_hops(topology, world, timeout)
    _GROUPS[key] = (alive, groups)
    return groups


# Backends whose groups get a reduction twin: gloo runs one collective in
# flight per group here (`zppc.passes.overlap.one_in_flight_on_gloo`), and the
# fake process group plans for gloo as well as NCCL.
TWINNED_BACKENDS = ("gloo", "fake")
# (world epoch, group name) -> its twin's name.
_TWINS: dict[tuple[int, str], str] = {}


def _create_twins(
    topology: Topology, originals: tuple[dist.ProcessGroup, ...], timeout: timedelta | None
) -> list[dist.ProcessGroup]:
    """A second group over the same ranks for each of the world, intra-node
    and cross-node groups (collective, in that order on every rank): the
    gradient reductions run on it, so that on gloo a parameter gather is never
    issued behind a reduction still in flight (`zppc.passes.reduction_groups`)."""
    twins = _new_world_intra_cross(topology, timeout)
    for original, twin in zip(originals, twins, strict=True):
        _TWINS[(world_epoch(), original.group_name)] = twin.group_name
    return twins


def _new_world_intra_cross(
    topology: Topology, timeout: timedelta | None
) -> list[dist.ProcessGroup]:
    """New groups over the world, this rank's node and this rank's local index
    across the nodes (collective, in that order on every rank), each known to
    carry the topology's node size."""
    groups = [
        dist.new_group(list(range(topology.world_size)), timeout=timeout),
        dist.new_subgroups_by_enumeration(topology.intra_node_groups(), timeout=timeout)[0],
        dist.new_subgroups_by_enumeration(topology.cross_node_groups(), timeout=timeout)[0],
    ]
    for group in groups:
        _NODE_SIZE[(world_epoch(), group.group_name)] = topology.node_size
    return groups


def has_hop_groups(topology: Topology, backend: str) -> bool:
    """Whether zppc creates two-hop groups (`HopGroups`) for this layout and
    backend: on gloo (and the fake process group that plans for it) with
    several nodes of several ranks, laid out evenly. There an all-gather over
    the world brings fewer bytes into each node as two hops, across the nodes
    and then inside each, than as gloo's ring: D (N - 1) chunks against
    N D - 1 for N nodes of D ranks (2 x 2: 2 against 3; 2 x 8: 8 against
    15); a reduce-scatter in two hops (inside each node, then across) brings
    D (N - 1) as well, against D (W - D) for a direct exchange. NCCL's own
    rings are kept. `distribute` checks `reduce_scatter="two_hop"` with this,
    before any group exists."""
    nodes, per_node = topology.num_nodes, topology.node_size
    return (
        backend in TWINNED_BACKENDS
        and nodes > 1
        and per_node > 1
        and topology.world_size == nodes * per_node
    )


# `Config.reduce_scatter="two_hop"` where `has_hop_groups` is false.
TWO_HOPS_NEED = "reduce_scatter='two_hop' needs gloo and several nodes of several ranks"


@dataclass(frozen=True)
class HopGroups:
    """The groups of a two-hop collective over the world: `world` names it in
    graphs (`zppc.passes.gather_hops` moves gathers there, the
    `reduce_scatter` pass reductions), and on `cross_node` and `intra_node` it
    runs (`zppc.runtime.collectives.all_gather_in_place`, across then inside
    the nodes; `reduce_scatter_in_two_hops`, inside then across). Gathers and
    reductions have hop groups of their own."""

    world: str
    cross_node: dist.ProcessGroup
    intra_node: dist.ProcessGroup


# (world epoch, world group name, "gather" | "reduce") -> its two-hop groups;
# also keyed by the hop world's own name, which the runtime and the ledger
# look up.
_HOPS: dict[tuple[int, str, str], HopGroups] = {}


def _create_hops(
    topology: Topology, world: dist.ProcessGroup, timeout: timedelta | None
) -> list[dist.ProcessGroup]:
    """The groups two-hop collectives over the world run on (collective, in
    this order on every rank): for gathers, then for reductions, a world group
    that names them and its own intra- and cross-node groups, on which nothing
    else runs, because each hop is issued once the previous collective's same
    hop is done, from a completion callback where it is not yet, in the order
    the collectives were issued (`zppc.runtime.collectives._chain_hops`)."""
    created = []
    for purpose in ("gather", "reduce"):
        hop_world, intra, cross = groups = _new_world_intra_cross(topology, timeout)
        hops = HopGroups(hop_world.group_name, cross, intra)
        _HOPS[(world_epoch(), world.group_name, purpose)] = hops
        _HOPS[(world_epoch(), hop_world.group_name, purpose)] = hops
        created += groups
    return created


def gather_hops(group_name: str) -> HopGroups | None:
    """The two-hop gather groups of a world group, or of their hop world; None
    where a group has none (NCCL, one node, one rank per node)."""
    return _HOPS.get((world_epoch(), group_name, "gather"))


def gathers_in_issue_order(group_name: str, backend: str) -> bool:
    """Whether zppc's all-gathers over this group (of `backend`) cross one at
    a time in the order they were issued, the runtime issuing each once the
    previous one is done (`zppc.runtime.collectives._chain_hops`): on gloo,
    where one group carries one collective at a time, unless the group is a
    gather hop world (whose hops are chained the same way). The graph still
    issues them `Config.prefetch` ahead; the link then serves the one needed
    first, where gathers on separate groups shared it and all finished late."""
    return backend == "gloo" and two_hop_gather_over(group_name) is None


def reduction_hops(group_name: str) -> HopGroups | None:
    """The two-hop reduce-scatter groups of a world group, or of their hop
    world; None where a group has none (as `gather_hops`)."""
    return _HOPS.get((world_epoch(), group_name, "reduce"))


def two_hop_gather_over(group_name: str) -> HopGroups | None:
    """The groups an all-gather over this group runs on in two hops, where it
    is a gather hop world; None where it gathers in one collective."""
    hops = gather_hops(group_name)
    return hops if hops is not None and hops.world == group_name else None


def two_hop_reduce_over(group_name: str) -> HopGroups | None:
    """The groups a reduce-scatter over this group runs on in two hops, where
    it is a reduction hop world; None elsewhere."""
    hops = reduction_hops(group_name)
    return hops if hops is not None and hops.world == group_name else None


# (world epoch, group name) -> the groups over the same ranks that are its
# lanes after itself (see `ensure_lanes`).
_LANES: dict[tuple[int, str], list[str]] = {}


def ensure_lanes(
    topology: Topology, groups: Groups, count: int, timeout_s: float | None = None
) -> None:
    """At least `count` lanes for the reduction twins of the world, intra- and
    cross-node groups, on gloo (and the fake process group, which plans for
    it): the twin itself and `count - 1` more groups over the same ranks
    (collective: every rank calls it with the same count). A gloo group
    carries one collective at a time (`zppc.passes.overlap.one_in_flight_on_gloo`);
    the `lanes` pass spreads a twin's collectives over its lanes in turn, so
    `Config.prefetch + 1` reductions are in flight at once, each lane still
    carrying one. The original groups get none: they carry only parameter
    gathers, which the runtime chains in issue order on their own group
    (`zppc.passes.reduction_groups` moves everything else to the twin)."""
    if dist.get_backend() not in TWINNED_BACKENDS or topology.world_size == 1:
        return
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    twins = tuple(
        reduction_twin(name) for name in (groups.world, groups.intra_node, groups.cross_node)
    )
    while len(group_lanes(twins[0])) < count:
        added = _new_world_intra_cross(topology, timeout)
        _SIDE_GROUPS.extend(added)
        for name, lane in zip(twins, added, strict=True):
            _LANES.setdefault((world_epoch(), name), []).append(lane.group_name)


# Lanes per group at most: one link carries them all, and every lane is a set of
# gloo connections and threads per rank.
MAX_LANES = 4


def lane_count(prefetch: int) -> int:
    """Lanes a group gets for `Config.prefetch`: one per collective the overlap
    pass keeps in flight (`prefetch + 1`), at most `MAX_LANES`."""
    return min(prefetch + 1, MAX_LANES)


def group_lanes(group_name: str) -> tuple[str, ...]:
    """The group and its lanes (`ensure_lanes`), in the order they take turns."""
    return (group_name, *_LANES.get((world_epoch(), group_name), ()))


def reduction_twin(group_name: str) -> str | None:
    """The twin of one of zppc's groups (see `_create_twins`); None if it has none."""
    return _TWINS.get((world_epoch(), group_name))


def side_world_group(topology: Topology, timeout_s: float | None = None) -> str:
    """A second group over the whole world (collective: every rank calls it in
    the same order). Collectives left in flight across steps (OSP's stage 2)
    run on it, so they never queue behind, or share a gloo connection with,
    the collectives the next forward issues."""
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    group = dist.new_group(list(range(topology.world_size)), timeout=timeout)
    return _keep_side_group(group, topology)


def side_node_groups(topology: Topology, timeout_s: float | None = None) -> tuple[str, str]:
    """A second intra-node and cross-node group of this rank (collective, like
    `side_world_group`, and for the same reason): OSP's quantized stage 2
    takes its two qgZ hops on them. Group ranks follow global ranks, as in
    the model's own groups: local rank in the node, node index across."""
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    intra, _ = dist.new_subgroups_by_enumeration(topology.intra_node_groups(), timeout=timeout)
    cross, _ = dist.new_subgroups_by_enumeration(topology.cross_node_groups(), timeout=timeout)
    return _keep_side_group(intra, topology), _keep_side_group(cross, topology)


def _keep_side_group(group: dist.ProcessGroup, topology: Topology) -> str:
    _SIDE_GROUPS.append(group)
    _NODE_SIZE[(world_epoch(), group.group_name)] = topology.node_size
    return group.group_name


# Keeps the side groups alive (and their names unique) for the process's life.
_SIDE_GROUPS: list[dist.ProcessGroup] = []


def _set_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """The timeout of every later operation on `group` (a mesh's groups are
    created before zppc can pass one)."""
    if dist.get_backend(group) in ("gloo", "nccl"):
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def world_group(groups: Groups) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(groups.world)


def device_type() -> str:
    """The device type of the default process group's tensors (meshes need it)."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _node_mesh(topology: Topology) -> DeviceMesh:
    """The (node, local) mesh of an even topology, as `init_device_mesh` would lay it out."""
    return DeviceMesh(
        device_type(),
        torch.arange(topology.world_size).view(topology.num_nodes, topology.node_size),
        mesh_dim_names=("node", "local"),
    )


def group_ranks(group_name: str) -> list[int]:
    """Global ranks of a group, in group-rank order."""
    group = dist.distributed_c10d._resolve_process_group(group_name)
    return dist.get_process_group_ranks(group)


def group_size(group_name: str) -> int:
    return dist.distributed_c10d._resolve_process_group(group_name).size()


def group_backend(group_name: str) -> str:
    """The backend of a group ("gloo", "nccl", "fake", ...): the same on every rank."""
    return dist.get_backend(dist.distributed_c10d._resolve_process_group(group_name))
