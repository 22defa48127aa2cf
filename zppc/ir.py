"""zppc's distributed IR: two logical ops that say *what* moves, not *how*.

`zppc::unshard(shard)` is "the full parameter from this rank's shard" and its
autograd rule emits `zppc::reduce_grad(grad)`, "this rank's share of the averaged
gradient". The passes lower them to concrete collectives; their eager
implementations below really communicate, so an uncompiled model is the
reference every compiled graph is checked against.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from zppc.runtime import collectives
from zppc.runtime.topology import group_size

MODES = ("ddp", "zero1", "zero2", "zero3", "rtp")


@torch.library.custom_op("zppc::unshard", mutates_args=())
def unshard(
    shard: Tensor,
    shape: list[int],
    group_name: str,
    mode: str,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> Tensor:
    """The full parameter of `shape` from this rank's flat padded shard
    (for mode "ddp" the "shard" is already the full parameter)."""
    local = shard if param_dtype is None else shard.to(param_dtype)
    if mode == "ddp":
        return local.clone()
    full = collectives.all_gather_flat(local, group_name)
    return full[: math.prod(shape)].view(shape).clone()


@unshard.register_fake
def _(shard, shape, group_name, mode, param_dtype, reduce_dtype):
    return shard.new_empty(shape, dtype=param_dtype or shard.dtype)


@torch.library.custom_op("zppc::reduce_grad", mutates_args=())
def reduce_grad(
    grad: Tensor,
    shard_numel: int,
    group_name: str,
    mode: str,
    reduce_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """This rank's part of the gradient averaged over the group: the flat shard
    (zero*) or the whole gradient (ddp)."""
    world = group_size(group_name)
    g = grad if reduce_dtype is None else grad.to(reduce_dtype)
    if mode == "ddp":
        total = collectives.all_reduce_sum(g, group_name)
    else:
        flat = torch.nn.functional.pad(g.reshape(-1), (0, shard_numel * world - g.numel()))
        if mode == "zero1":
            total = collectives.take_shard(collectives.all_reduce_sum(flat, group_name), group_name)
        else:
            total = collectives.reduce_scatter_flat(flat, group_name)
    return (total / world).to(out_dtype)


@reduce_grad.register_fake
def _(grad, shard_numel, group_name, mode, reduce_dtype, out_dtype):
    if mode == "ddp":
        return grad.new_empty(grad.shape, dtype=out_dtype)
    return grad.new_empty(shard_numel, dtype=out_dtype)


def _unshard_setup(ctx, inputs, output) -> None:
    shard, _shape, group_name, mode, _param_dtype, reduce_dtype = inputs
    ctx.args = (shard.numel(), group_name, mode, reduce_dtype, shard.dtype)


def _unshard_backward(ctx, grad: Tensor):
    return torch.ops.zppc.reduce_grad(grad, *ctx.args), None, None, None, None, None


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup)


# hpZ: after the forward gather each rank keeps a *secondary* shard of the full
# weight over its node, and the backward re-gathers from the node only. Both
# ops are inserted by zppc's partition function (never by user code), so the
# secondary shard lives exactly from the forward that made it to the backward
# that consumes it: it cannot go stale.


@torch.library.custom_op("zppc::secondary_shard", mutates_args=())
def secondary_shard(full: Tensor, group_name: str) -> Tensor:
    """This rank's 1/g piece of a full parameter, g the size of `group_name`
    (the node), padded like a primary shard."""
    world = group_size(group_name)
    flat = full.reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -(-flat.numel() // world) * world - flat.numel()))
    return collectives.take_shard(padded, group_name)


@secondary_shard.register_fake
def _(full, group_name):
    return full.new_empty(-(-full.numel() // group_size(group_name)))


@torch.library.custom_op("zppc::unshard_secondary", mutates_args=())
def unshard_secondary(secondary: Tensor, shape: list[int], group_name: str) -> Tensor:
    """The full parameter from the node's secondary shards (a gather inside the node)."""
    full = collectives.all_gather_flat(secondary, group_name)
    return full[: math.prod(shape)].view(shape).clone()


@unshard_secondary.register_fake
def _(secondary, shape, group_name):
    return secondary.new_empty(shape)
