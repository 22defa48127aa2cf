"""The communication ledger: bytes this rank received, by collective kind and link.

Every collective zppc runs, eager or inside a compiled graph, reports here as it
executes (never from a plan), so the ledger shows what really ran. For each
collective we count the logical bytes this rank receives from each other rank:

- all-gather: each peer's shard;
- reduce-scatter: each peer's contribution to my shard;
- all-to-all: each peer's chunk;
- all-reduce: a reduce-scatter plus an all-gather (2 chunks of size/world per peer);
- send/recv: the tensor;
- broadcast: the tensor, from the group's first rank (which receives nothing).

A peer on my node adds to `intra_node_bytes`, any other to `inter_node_bytes`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import cache

from zppc.runtime.topology import (
    group_ranks,
    node_size_of,
    two_hop_gather_over,
    two_hop_reduce_over,
    world_epoch,
)


@dataclass
class CommStats:
    """Bytes received by this rank since the last reset."""

    intra_node_bytes: int = 0
    inter_node_bytes: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return self.intra_node_bytes + self.inter_node_bytes

    def as_dict(self) -> dict:
        return {
            "intra_node_bytes": self.intra_node_bytes,
            "inter_node_bytes": self.inter_node_bytes,
            "total_bytes": self.total_bytes,
            "by_kind": dict(self.by_kind),
            "calls": dict(self.calls),
        }

    def copy(self) -> CommStats:
        return CommStats(
            self.intra_node_bytes, self.inter_node_bytes, dict(self.by_kind), dict(self.calls)
        )


_LOCK = threading.Lock()
_STATS = CommStats()


def comm_stats() -> CommStats:
    """A snapshot of the bytes this rank received since the last reset."""
    with _LOCK:
        return _STATS.copy()


def reset_comm_stats() -> None:
    global _STATS
    with _LOCK:
        _STATS = CommStats()


def peer_split(group_name: str, my_rank: int, node_size: int) -> tuple[int, int]:
    """(peers on my node, peers on other nodes) in a group."""
    return _peer_split(world_epoch(), group_name, my_rank, node_size)


@cache
def _peer_split(epoch: int, group_name: str, my_rank: int, node_size: int) -> tuple[int, int]:
    ranks = group_ranks(group_name)
    peers = [r for r in ranks if r != my_rank]
    intra = sum(1 for r in peers if r // node_size == my_rank // node_size)
    return intra, len(peers) - intra


def received(kind: str, group_name: str, rank: int, bytes_per_peer: int) -> tuple[int, int]:
    """(intra-node, inter-node) bytes `rank` receives in one collective of `kind`
    in which each sending peer sends `bytes_per_peer`."""
    import torch.distributed as dist

    node_size = node_size_of(group_name) or dist.get_world_size()
    if kind == "broadcast":
        root = group_ranks(group_name)[0]
        if rank == root:
            return 0, 0
        same_node = root // node_size == rank // node_size
        return (bytes_per_peer, 0) if same_node else (0, bytes_per_peer)
    intra_peers, inter_peers = peer_split(group_name, rank, node_size)
    return intra_peers * bytes_per_peer, inter_peers * bytes_per_peer


def node_link_bytes(kind: str, group_name: str, rank: int, bytes_per_peer: int) -> int:
    """Bytes entering `rank`'s node over its inter-node link in one collective,
    with every rank of the node running its copy (the ranks of a node run the
    same collective, on this group or on congruent ones), under the algorithms
    gloo and NCCL run: a ring over the group's ranks in order for all-gather,
    reduce-scatter, all-reduce and broadcast (from the first rank), a direct
    exchange for all-to-all; an all-gather or reduce-scatter over a hop world
    (gloo, several nodes of several ranks) runs in two hops, inside and across
    the nodes: each rank of the node brings in the N - 1 shards (or node sums)
    of its local index.
    This is the per-node accounting of the ZeRO++ paper's 3M -> 0.75M; the
    ledger's bytes are logical, per rank."""
    import torch.distributed as dist

    node_size = node_size_of(group_name) or dist.get_world_size()
    ranks = group_ranks(group_name)
    here = [r for r in ranks if r // node_size == rank // node_size]
    if len(here) == len(ranks):
        return 0
    if in_two_hops(kind, group_name):
        return len(here) * (len(ranks) // node_size - 1) * bytes_per_peer

    def inbound(member: int) -> int:
        if kind == "all_to_all":
            return received(kind, group_name, member, bytes_per_peer)[1]
        previous = ranks[ranks.index(member) - 1]
        if previous // node_size == member // node_size or (
            kind == "broadcast" and member == ranks[0]
        ):
            return 0
        return bytes_per_peer if kind == "broadcast" else (len(ranks) - 1) * bytes_per_peer

    # node_size / len(here) congruent copies of this group meet on the node.
    return sum(map(inbound, here)) * node_size // len(here)


def in_two_hops(kind: str, group_name: str) -> bool:
    """Whether a collective of `kind` over this group runs in two hops."""
    if kind == "all_gather":
        return two_hop_gather_over(group_name) is not None
    return kind == "reduce_scatter" and two_hop_reduce_over(group_name) is not None


def record(kind: str, group_name: str, bytes_per_peer: int) -> None:
    """Count a collective in which each sending peer of the group sent me
    `bytes_per_peer` (every other rank; for a broadcast, its root)."""
    import torch.distributed as dist

    _count(kind, *received(kind, group_name, dist.get_rank(), bytes_per_peer))


def ring_received(group_name: str, rank: int, nbytes: int) -> tuple[int, int, int]:
    """(intra-node, inter-node, node-link) bytes of an RTP ring step in which
    every rank of the group receives `nbytes` from the next one: what crosses
    a node boundary enters the node over its link (with ranks numbered by
    node, once per node: its last rank receives from the next node's first)."""
    crosses, entering = _ring_split(world_epoch(), group_name, rank)
    link = entering * nbytes
    return (0, nbytes, link) if crosses else (nbytes, 0, link)


@cache
def _ring_split(epoch: int, group_name: str, rank: int) -> tuple[bool, int]:
    """(whether `rank` receives across a node boundary, how many ranks of its
    node do)."""
    import torch.distributed as dist

    ranks = group_ranks(group_name)
    node_size = node_size_of(group_name) or dist.get_world_size()

    def crosses(r: int) -> bool:
        return ranks[(ranks.index(r) + 1) % len(ranks)] // node_size != r // node_size

    entering = sum(crosses(r) for r in ranks if r // node_size == rank // node_size)
    return crosses(rank), entering


def record_ring(kind: str, group_name: str, nbytes: int) -> None:
    """Count `nbytes` this rank receives from the next rank of the group's ring."""
    import torch.distributed as dist

    intra, inter, _ = ring_received(group_name, dist.get_rank(), nbytes)
    _count(kind, intra, inter)


def _count(kind: str, intra: int, inter: int) -> None:
    with _LOCK:
        _STATS.intra_node_bytes += intra
        _STATS.inter_node_bytes += inter
        _STATS.by_kind[kind] = _STATS.by_kind.get(kind, 0) + intra + inter
        _STATS.calls[kind] = _STATS.calls.get(kind, 0) + 1
