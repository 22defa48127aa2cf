"""Functions run on every spawned rank by the multi-process tests."""

from __future__ import annotations

import copy
import hashlib

import torch
import torch.distributed as dist

import zppc
from models import MODELS


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def local_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world)[rank]


def train_against_reference(rank, world, model_name, config_kwargs, optimizer, steps=10):
    """Train a distributed compiled model and a single-process reference that sees
    the whole batch; return both loss curves and the largest parameter gap."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model_cls = MODELS[model_name]
    model = model_cls()
    reference = copy.deepcopy(model)
    zppc.distribute(model, zppc.Config(**config_kwargs))
    step = torch.compile(model, backend="zppc")
    opt = make_optimizer(optimizer, model.parameters())
    ref_opt = make_optimizer(optimizer, [p for p in reference.parameters() if p.requires_grad])
    losses, ref_losses = [], []
    for i in range(steps):
        x, y = model_cls.batch(i)
        loss = step(local_slice(x, rank, world), local_slice(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)

        ref_loss = reference(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    full = zppc.full_parameters(model)
    ref_params = dict(reference.named_parameters())
    gaps = {name: (full[name] - ref_params[name].detach()).abs().max().item() for name in full}
    frozen_moved = [
        name for name, p in ref_params.items() if not p.requires_grad and not torch.equal(full[name], p.detach())
    ]
    inspection = zppc.inspect(step)
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "gaps": gaps,
        "frozen_moved": frozen_moved,
        "graphs": len(inspection.compiles),
        "comm": zppc.comm_stats().as_dict(),
    }


def graph_hashes(rank, world, model_name, config_kwargs):
    """Hash of every final graph this rank compiled."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS[model_name]()
    zppc.distribute(model, zppc.Config(**config_kwargs))
    step = torch.compile(model, backend="zppc")
    x, y = model.batch(0)
    step(local_slice(x, rank, world), local_slice(y, rank, world)).backward()
    codes = [
        record.final[kind].code for record in zppc.inspect(step).compiles for kind in ("forward", "backward")
    ]
    return hashlib.sha256("\n".join(codes).encode()).hexdigest()
