"""`zppc.save` / `zppc.load`: sharded checkpoints through torch.distributed.checkpoint.

Each rank writes only its shards. A parameter's shard is presented to DCP as
its piece of a DTensor whose logical shape is the *unpadded* flat parameter,
split like `torch.chunk` (zppc's shards hold exactly those pieces, plus
padding). The checkpoint therefore does not depend on the world size: one
saved on 4 ranks loads on 2 or 8. Optimizer state that has the shard's shape
(Adam's moments) is stored the same way; scalars and hyperparameters are
stored once, replicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from zppc.distribute import DistributedState, ShardSpec, state_of


def _state(model: nn.Module) -> DistributedState:
    state = state_of(model)
    if state is None:
        raise ValueError("zppc.save/load need a model passed to zppc.distribute")
    return state


def _as_dtensor(spec: ShardSpec, local: Tensor, mesh) -> Tensor:
    """This rank's shard-shaped tensor as a piece of the flat logical parameter."""
    if spec.mode == "ddp":
        return local  # replicated: every rank holds the same full tensor
    piece = local.view(-1)[: spec.valid_numel(dist.get_rank())]
    return DTensor.from_local(
        piece, mesh, [Shard(0)], run_check=False, shape=(spec.numel,), stride=(1,)
    )


def _state_dict(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict:
    state = _state(model)
    mesh = init_device_mesh(_mesh_device(), (state.topology.world_size,))
    sd: dict[str, object] = {}
    for fqn, spec in state.specs.items():
        sd[f"model.{fqn}"] = _as_dtensor(spec, state.shard(fqn).data, mesh)
    for name, buf in model.named_buffers():
        sd[f"buffer.{name}"] = buf
    if opt is not None:
        by_param = {id(state.shard(fqn)): fqn for fqn in state.specs}
        for p, values in opt.state.items():
            fqn = by_param.get(id(p))
            if fqn is None:
                raise ValueError(
                    "the optimizer holds a parameter that is not one of the model's shards"
                )
            for key, value in values.items():
                if torch.is_tensor(value) and value.shape == p.shape and value.dim() > 0:
                    value = _as_dtensor(state.specs[fqn], value, mesh)
                sd[f"optim.{fqn}.{key}"] = value
        sd["optim.param_groups"] = [
            {k: v for k, v in group.items() if k != "params"}
            for group in opt.state_dict()["param_groups"]
        ]
    return sd


def _mesh_device() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def save(model: nn.Module, opt: torch.optim.Optimizer | None, path: str) -> None:
    """Write this rank's shards (and optimizer state) to the checkpoint at `path`."""
    dcp.save(_state_dict(model, opt), checkpoint_id=path)


@torch.no_grad()
def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors (loaded over right after) by one
    step with zero gradients and zero learning rate: parameters do not move."""
    if all(p in opt.state for group in opt.param_groups for p in group["params"]):
        return
    saved_lr = [group["lr"] for group in opt.param_groups]
    grads = {}
    for group in opt.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            grads[p] = p.grad
            p.grad = torch.zeros_like(p)
    opt.step()
    for group, lr in zip(opt.param_groups, saved_lr, strict=True):
        group["lr"] = lr
    for p, g in grads.items():
        p.grad = g


def load(model: nn.Module, opt: torch.optim.Optimizer | None, path: str) -> None:
    """Read the checkpoint at `path` into the model's shards (and the optimizer),
    whatever the world size it was saved with."""
    if opt is not None:
        _init_optimizer_state(opt)
    sd = _state_dict(model, opt)
    # Tensors (shard pieces, replicated tensors, optimizer moments and steps)
    # are loaded in place; only plain Python values come back as new objects.
    dcp.load(sd, checkpoint_id=path)
    if opt is not None:
        state = _state(model)
        for fqn in state.specs:
            values = opt.state.get(state.shard(fqn), {})
            for key, value in values.items():
                if not torch.is_tensor(value):
                    values[key] = sd[f"optim.{fqn}.{key}"]
        for group, saved in zip(opt.param_groups, sd["optim.param_groups"], strict=True):
            group.update(saved)
