"""Collectives as zppc runs them: eager helpers and the in-graph ledger hook.

The eager helpers back the eager implementation of the IR ops (`zppc::unshard`,
`zppc::reduce_grad`), which is the reference every compiled graph is compared
against. Compiled graphs use functional collectives instead and call
`zppc::record_comm` on each collective's input as it is issued, so the ledger
counts what really ran without ever touching a result (a hook on the result
would keep gathered weights alive and pin the scheduler).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from zppc.runtime.ledger import record
from zppc.runtime.topology import group_size

_GROUP_FROM_NAME = dist.distributed_c10d._resolve_process_group


def bytes_per_peer(kind: str, inp: Tensor, world: int) -> int:
    """Bytes each peer sends me, given the collective's input on this rank."""
    nbytes = inp.numel() * inp.element_size()
    if kind == "all_gather":
        return nbytes
    if kind in ("reduce_scatter", "all_to_all"):
        return nbytes // world
    if kind == "all_reduce":
        return 2 * nbytes // world
    raise ValueError(f"unknown collective kind {kind!r}")


@torch.library.custom_op("zppc::record_comm", mutates_args=())
def record_comm(inp: Tensor, kind: str, group_name: str) -> None:
    """Ledger hook placed where each collective is issued in compiled graphs; it
    reads only the size of the collective's input."""
    record(kind, group_name, bytes_per_peer(kind, inp, group_size(group_name)))


@record_comm.register_fake
def _(inp: Tensor, kind: str, group_name: str) -> None:
    return None


# The hook returns nothing; without this mark dead-code elimination (FX and
# Inductor alike) would drop it.
torch.fx.node.has_side_effect(torch.ops.zppc.record_comm.default)


@torch.library.custom_op("zppc::take_shard", mutates_args=())
def take_shard(flat: Tensor, group_name: str) -> Tensor:
    """This rank's 1/world slice of a flat tensor, chosen at run time so that
    every rank's graph is the same."""
    group = _GROUP_FROM_NAME(group_name)
    return flat.view(group.size(), -1)[dist.get_rank(group)].clone()


@take_shard.register_fake
def _(flat: Tensor, group_name: str) -> Tensor:
    world = group_size(group_name)
    return flat.new_empty(flat.numel() // world)


def all_gather_flat(shard: Tensor, group_name: str) -> Tensor:
    """Concatenation of every rank's 1-D shard, in group-rank order."""
    group = _GROUP_FROM_NAME(group_name)
    out = shard.new_empty(shard.numel() * group.size())
    dist.all_gather_single(out, shard.contiguous(), group=group)
    record("all_gather", group_name, bytes_per_peer("all_gather", shard, group.size()))
    return out


def reduce_scatter_flat(flat: Tensor, group_name: str) -> Tensor:
    """Sum over ranks of `flat`, scattered: this rank gets its 1/world slice."""
    group = _GROUP_FROM_NAME(group_name)
    out = flat.new_empty(flat.numel() // group.size())
    dist.reduce_scatter_single(out, flat.contiguous(), op=dist.ReduceOp.SUM, group=group)
    record("reduce_scatter", group_name, bytes_per_peer("reduce_scatter", flat, group.size()))
    return out


def all_reduce_sum(t: Tensor, group_name: str) -> Tensor:
    group = _GROUP_FROM_NAME(group_name)
    out = t.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    record("all_reduce", group_name, bytes_per_peer("all_reduce", t, group.size()))
    return out
