"""Which ranks share a node, and the process groups that follow from it.

Nodes are blocks of `node_size` consecutive global ranks (torchrun's layout).
The intra-node group of a rank holds its node; the cross-node group holds the
ranks with the same local rank on every node. Every rank creates every group in
the same order (torch.distributed requires it), and keeps its own two.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


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


_TOPOLOGY: Topology | None = None
# Keyed by the default process group too: tests (and the CLI) create and destroy
# several worlds in one process. The value keeps the group alive so its id stays
# unique while cached.
_GROUPS: dict[tuple[int, int, int], tuple[dist.ProcessGroup, Groups]] = {}


def world_epoch() -> int:
    """Identifies the current default process group (changes when it is re-created)."""
    return id(dist.distributed_c10d._get_default_group())


def current_topology() -> Topology | None:
    """The topology zppc was set up with in this process (None before)."""
    return _TOPOLOGY


def set_topology(topology: Topology) -> None:
    global _TOPOLOGY
    _TOPOLOGY = topology


def setup_groups(topology: Topology) -> Groups:
    """Create (once) the world, intra-node and cross-node groups; collective."""
    set_topology(topology)
    key = (world_epoch(), topology.world_size, topology.node_size)
    if key in _GROUPS:
        return _GROUPS[key][1]
    world = dist.group.WORLD
    if topology.node_size in (1, topology.world_size):
        # Degenerate layouts need no new group: one of the two is the world,
        # the other holds only this rank.
        single = _single_rank_group(topology)
        intra = world if topology.node_size == topology.world_size else single
        cross = single if topology.node_size == topology.world_size else world
    else:
        intra, _ = dist.new_subgroups_by_enumeration(topology.intra_node_groups())
        cross, _ = dist.new_subgroups_by_enumeration(topology.cross_node_groups())
    groups = Groups(
        world=world.group_name, intra_node=intra.group_name, cross_node=cross.group_name
    )
    _GROUPS[key] = (world, groups)
    return groups


def _single_rank_group(topology: Topology) -> dist.ProcessGroup:
    group, _ = dist.new_subgroups_by_enumeration([[r] for r in range(topology.world_size)])
    return group


def group_ranks(group_name: str) -> list[int]:
    """Global ranks of a group, in group-rank order."""
    group = dist.distributed_c10d._resolve_process_group(group_name)
    return dist.get_process_group_ranks(group)


def group_size(group_name: str) -> int:
    return dist.distributed_c10d._resolve_process_group(group_name).size()
