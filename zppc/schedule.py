"""The communication schedule: which collectives a compiled step runs, read off
the final graphs, with the bytes each moves per rank. `zppc.inspect` shows it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from zppc.passes.zero import UNQUANTIZED_BYTES, find_collectives
from zppc.runtime.collectives import bytes_per_peer
from zppc.runtime.ledger import in_two_hops, node_link_bytes, received, ring_received
from zppc.runtime.osp import stage2_points  # also registers zppc::osp_issue
from zppc.runtime.rtp import ring_transfer
from zppc.runtime.topology import group_ranks

OSP_ISSUE = torch.ops.zppc.osp_issue.default


@dataclass(frozen=True)
class ScheduledCollective:
    """One collective in a graph, as this rank sees it."""

    graph: str
    index: int
    kind: str
    group_name: str
    group_size: int
    bytes_per_peer: int
    intra_node_bytes: int
    inter_node_bytes: int
    unquantized_bytes_per_peer: int
    """What each peer would send without quantization (= bytes_per_peer when unquantized)."""
    node_link_bytes: int = 0
    """Bytes entering this rank's node over its inter-node link, all its ranks
    counted, under the ring / direct / two-hop algorithms (`ledger.node_link_bytes`)."""
    stage: int = 1
    """2: an OSP stage-2 reduction, issued here and left in flight past the end
    of the graph (it completes while the next iteration computes)."""
    ring: bool = False
    """An RTP ring op: `bytes_per_peer` all come from the next rank of the ring."""
    two_hops: bool = False
    """Runs in two hops over a hop world (gloo, several nodes of several ranks:
    `ledger.in_two_hops`), not as the backend's own collective."""


@dataclass(frozen=True)
class SchedulePoint:
    """Where a graph issues one collective and where it waits for it (None: not
    in this graph, OSP's stage 2), with what it sends."""

    issue: fx.Node
    wait: fx.Node | None
    kind: str
    group_name: str
    sent: torch.Tensor
    """The input on this rank (its size and dtype are what count)."""
    unquantized_bytes_per_peer: int | None
    stage: int = 1
    ring_bytes: int | None = None
    """An RTP ring op (kind "send_recv", issued and completed by the op itself,
    its transfers overlapping its own compute): the bytes this rank receives
    from its ring neighbour over the whole op."""


def schedule_points(graph: fx.Graph) -> list[SchedulePoint]:
    """Every collective of a final graph, in program order of its issue."""
    points = [point_of(m) for m in find_collectives(graph)]
    for node in graph.find_nodes(op="call_function", target=OSP_ISSUE):
        points += stage2_points(node)
    for node in graph.nodes:
        ring = ring_transfer(node)
        if ring is not None and ring.received_bytes:
            points.append(
                SchedulePoint(
                    node,
                    node,
                    "send_recv",
                    ring.group_name,
                    ring.shard.meta["val"],
                    ring.unquantized_bytes,
                    ring_bytes=ring.received_bytes,
                )
            )
    order = {node: i for i, node in enumerate(graph.nodes)}
    return sorted(points, key=lambda p: order[p.issue])


@dataclass
class CompileRecord:
    """Everything zppc produced for one dynamo graph."""

    config: object
    passes: dict[str, list] = field(
        default_factory=lambda: {"dynamo": [], "forward": [], "backward": []}
    )
    final: dict[str, fx.GraphModule] = field(default_factory=dict)
    kept_gathered: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    """(shape, bytes) of each zero3 weight the forward keeps gathered for the
    backward (`Config.keep_gathered_bytes`) instead of re-gathering it."""

    def schedule(self, rank: int | None = None) -> list[ScheduledCollective]:
        import torch.distributed as dist

        rank = dist.get_rank() if rank is None else rank
        out: list[ScheduledCollective] = []
        for kind in ("forward", "backward"):
            if kind in self.final:
                out.extend(graph_schedule(self.final[kind], kind, rank))
        return out


def graph_schedule(gm: fx.GraphModule, graph: str, rank: int) -> list[ScheduledCollective]:
    """The collectives of one graph in program order of their issue."""
    return [
        scheduled_collective(point, graph, index, rank)
        for index, point in enumerate(schedule_points(gm.graph))
    ]


def point_of(match) -> SchedulePoint:
    """The schedule point of one `CollectiveMatch`."""
    return SchedulePoint(
        match.issue,
        match.wait,
        match.kind,
        match.group_name,
        match.input.meta["val"],
        match.wait.meta.get(UNQUANTIZED_BYTES),
    )


def scheduled_collective(
    point: SchedulePoint, graph: str, index: int, rank: int
) -> ScheduledCollective:
    """One collective as `rank` sees it: the bytes it receives over each link."""
    kind, group_name = point.kind, point.group_name
    ranks = group_ranks(group_name)
    if point.ring_bytes is not None:
        per_peer = point.ring_bytes
        intra, inter, link = ring_received(group_name, rank, per_peer)
    else:
        per_peer = bytes_per_peer(kind, point.sent, len(ranks))
        intra, inter = received(kind, group_name, rank, per_peer)
        link = node_link_bytes(kind, group_name, rank, per_peer)
    unquantized = point.unquantized_bytes_per_peer
    return ScheduledCollective(
        graph=graph,
        index=index,
        kind=kind,
        group_name=group_name,
        group_size=len(ranks),
        bytes_per_peer=per_peer,
        intra_node_bytes=intra,
        inter_node_bytes=inter,
        unquantized_bytes_per_peer=per_peer if unquantized is None else unquantized,
        node_link_bytes=link,
        stage=point.stage,
        ring=point.ring_bytes is not None,
        two_hops=point.ring_bytes is None and in_two_hops(kind, group_name),
    )


# Compile records of undistributed models (ddp fallback) live here; those of a
# distributed model live on its state, so `inspect(step)` finds its own.
_UNOWNED: list[CompileRecord] = []


def register_compile(record: CompileRecord, state) -> None:
    if state is None:
        _UNOWNED.append(record)
    else:
        state.compiles.append(record)


def records_for(state) -> list[CompileRecord]:
    return list(state.compiles) if state is not None else list(_UNOWNED)
