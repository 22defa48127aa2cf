"""Gradient accumulation without communication (DDP's `no_sync`, FSDP2's
`set_requires_gradient_sync(False)`).

While a model's gradient sync is off, each parameter's full local gradient is
added to a per-rank buffer instead of being reduced: the backward issues no
collective at all. The next backward with sync on adds those buffers to its own
gradients before the one reduction, so the result equals one large batch. The
cost is one full-size gradient per parameter on every rank while gradients are
deferred (what DDP holds anyway; ZeRO-2/3 normally hold 1/world of it).

Which of the three backwards a forward builds ("sync", "defer", "flush") is a
plain attribute read when the parameter is used, so dynamo guards on it and
compiles each variant once; every rank holds the same flags, hence the same
graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class GradSync:
    """One distributed model's gradient-sync switch and its deferred gradients."""

    index: int
    """Order of the model among `distribute` calls (the same on every rank)."""
    enabled: bool = True
    deferred: dict[str, Tensor] = field(default_factory=dict)
    """Full local gradients summed over the backwards run with sync off, by parameter."""

    def mode(self) -> str:
        if not self.enabled:
            return "defer"
        return "flush" if len(self.deferred) else "sync"


_REGISTRY: dict[int, GradSync] = {}


def new_grad_sync() -> GradSync:
    sync = GradSync(index=len(_REGISTRY))
    _REGISTRY[sync.index] = sync
    return sync


@torch.library.custom_op("zppc::defer_grad", mutates_args=())
def defer_grad(grad: Tensor, model: int, fqn: str) -> None:
    """Add `grad` to the deferred gradient of parameter `fqn` of model `model`."""
    deferred = _REGISTRY[model].deferred
    if fqn in deferred:
        deferred[fqn].add_(grad)
    else:
        deferred[fqn] = grad.detach().clone()


@defer_grad.register_fake
def _(grad: Tensor, model: int, fqn: str) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.zppc.defer_grad.default)


@torch.library.custom_op("zppc::add_deferred", mutates_args=())
def add_deferred(grad: Tensor, model: int, fqn: str) -> Tensor:
    """`grad` plus the deferred gradient of `fqn`, which is consumed."""
    pending = _REGISTRY[model].deferred.pop(fqn, None)
    return grad.clone() if pending is None else grad + pending.to(grad.dtype)


@add_deferred.register_fake
def _(grad: Tensor, model: int, fqn: str) -> Tensor:
    return torch.empty_like(grad)


class _Defer(torch.autograd.Function):
    """Identity on the parameter gathered from a detached shard, tied to the
    shard so that autograd reaches it: its backward keeps the gradient on this
    rank, and the shard's own gradient is nothing (no reduction runs)."""

    @staticmethod
    def forward(ctx, full: Tensor, shard: Tensor, model: int, fqn: str) -> Tensor:
        ctx.where = (model, fqn)
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad: Tensor):
        torch.ops.zppc.defer_grad(grad, *ctx.where)
        return None, None, None, None


class _Flush(torch.autograd.Function):
    """Identity whose backward adds the deferred gradient before the reduction."""

    @staticmethod
    def forward(ctx, full: Tensor, model: int, fqn: str) -> Tensor:
        ctx.where = (model, fqn)
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return torch.ops.zppc.add_deferred(grad, *ctx.where), None, None


def gathered(shard: Tensor, unshard, sync: GradSync, fqn: str) -> Tensor:
    """`unshard(shard)`, the full parameter, with a backward as `sync` says:
    reduce ("sync"), keep the gradient here ("defer": the gather reads a
    detached shard, so autograd never reaches the reduction), or add the kept
    gradients and reduce ("flush")."""
    mode = sync.mode() if shard.requires_grad else "sync"
    if mode == "defer":
        return _Defer.apply(unshard(shard.detach()), shard, sync.index, fqn)
    if mode == "flush":
        return _Flush.apply(unshard(shard), sync.index, fqn)
    return unshard(shard)
