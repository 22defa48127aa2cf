"""`zppc.clip_grad_norm_`: torch's gradient clipping, with every rank clipping
alike while OSP defers reductions.

Without OSP it is `torch.nn.utils.clip_grad_norm_` (the DTensor gradients
already give the global norm). With OSP, a stage-2 gradient holds this rank's
own values until its reduction lands:

- sharded (zero1/2/3): each shard is its owner's slice, and the DTensor norm
  adds the owners' slices over the world, as torch's clip does;
- replicated (ddp, 0-dim parameters): each rank holds a different whole
  gradient, so its norm counts as the mean over ranks of the local norms'
  squares (p-th powers; the maximum for the inf-norm): one scalar all-reduce.

Every rank then scales by the same coefficient, and the stage-2 reductions
in flight remember it: LGP's redo (and the stale step) applies it to the
global mean, so after `zppc.synchronize` the replicas are bit-identical and
each parameter moved as if clipped by that coefficient.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from zppc.distribute import DistributedState, live_states
from zppc.runtime.collectives import eager_collective
from zppc.runtime.osp import InFlight

_GROUP_FROM_NAME = dist.distributed_c10d._resolve_process_group


def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Clip the gradients of `parameters` to a total norm of `max_norm`, as
    `torch.nn.utils.clip_grad_norm_` (same arguments and result: the total
    norm, a plain tensor, the same on every rank). Call it on every rank with
    the same parameters."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    with_grad = [p for p in params if p.grad is not None]
    in_flight = _stage2_in_flight(with_grad)
    replicated = {id(s.param): s for s in in_flight if s.replicated}
    shared = [p.grad for p in with_grad if id(p) not in replicated]
    norm_type = float(norm_type)
    total = _plain(torch.nn.utils.get_total_norm(shared, norm_type, error_if_nonfinite, foreach))
    by_model: dict[int, list[_Stage2]] = {}
    for s in replicated.values():
        by_model.setdefault(id(s.state), []).append(s)
    for model in by_model.values():
        grads = [_plain(s.param.grad) for s in model]
        own = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        total = _combine(total, _over_ranks(own, norm_type, model[0].state), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it "
            "cannot be clipped; set error_if_nonfinite=False to clip anyway"
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # One operation for a gradient and its local copy in flight, so the two
    # stay equal to the bit (the optimizer hook checks replicated ones).
    with torch.no_grad(), implicit_replication():
        for p in with_grad:
            p.grad.mul_(coefficient.to(p.grad.device))
    for s in in_flight:
        for part in s.parts:
            part.rescale(coefficient.to(part.local.device))
    return total


@dataclass(frozen=True)
class _Stage2:
    """A parameter whose gradient is still this rank's own (OSP's stage 2)."""

    param: Tensor
    parts: list[InFlight]
    state: DistributedState
    replicated: bool
    """Every rank holds a whole, different gradient (ddp, 0-dim parameters)."""


def _stage2_in_flight(params: list[Tensor]) -> list[_Stage2]:
    ids = {id(p) for p in params}
    found = []
    for state in live_states():
        if state.osp is None:
            continue
        for fqn, parts in sorted(state.osp.in_flight.items()):
            param = state.parameter(fqn)
            if id(param) in ids and parts:
                found.append(_Stage2(param, parts, state, state.specs[fqn].mode == "ddp"))
    return found


def _over_ranks(own: Tensor, norm_type: float, state: DistributedState) -> Tensor:
    """The norm of rank-local gradients over the model's world: the mean of
    the ranks' p-th powers, or their maximum for the inf-norm."""
    group_name = state.groups.world
    group = _GROUP_FROM_NAME(group_name)
    value = own.float().clone() if norm_type == float("inf") else own.float() ** norm_type
    op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
    with eager_collective("zppc.clip_grad_norm_'s all-reduce", group_name):
        dist.all_reduce(value, op=op, group=group)
    if norm_type == float("inf"):
        return value
    return (value / group.size()) ** (1.0 / norm_type)


def _combine(a: Tensor, b: Tensor, norm_type: float) -> Tensor:
    if norm_type == float("inf"):
        return torch.maximum(a.float(), b.to(a.device).float())
    return (a.float() ** norm_type + b.to(a.device).float() ** norm_type) ** (1.0 / norm_type)


def _plain(t: Tensor) -> Tensor:
    """A norm (a DTensor of sharded gradients: summed over the world) or a
    replicated gradient (its local values, no collective) as a plain tensor."""
    if not isinstance(t, DTensor):
        return t
    return t.to_local() if all(p.is_replicate() for p in t.placements) else t.full_tensor()
