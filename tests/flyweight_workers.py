"""Rank functions for tests/test_flyweight.py."""

from __future__ import annotations

import torch
from models import MODELS
from workers import local_slice

import zppc
from zppc import flyweight


def meta_equals_one_process(rank, world, model_name, strategy, chunk):
    """Build `model_name` on meta (each rank's global generator seeded
    differently: rank 0's stream must win), distribute it, and return the full
    parameters and buffers, the reference a single process builds on CPU from
    rank 0's seed, and this rank's losses over three steps on one batch."""
    torch._dynamo.reset()
    flyweight.CHUNK = chunk
    torch.manual_seed(1234)
    reference = MODELS[model_name]()
    torch.manual_seed(1234 if rank == 0 else 99 + rank)
    with torch.device("meta"):
        model = MODELS[model_name]()
    zppc.distribute(model, zppc.Config(strategy=strategy, node_size=2, lowering="eager"))
    params = zppc.full_parameters(model)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    after_init = torch.rand(3) if rank == 0 else None
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torch.compile(model, backend="zppc")
    losses = []
    x, y = model.batch(0)
    for _ in range(3):
        loss = step(local_slice(x, rank, world), local_slice(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.manual_seed(1234)
    MODELS[model_name]()
    return {
        "params": params,
        "buffers": buffers,
        "reference": dict(reference.named_parameters()),
        "reference_buffers": dict(reference.named_buffers()),
        "rng_continues": after_init is None or torch.equal(after_init, torch.rand(3)),
        "losses": losses,
    }


def distribute_peak(rank, world, width, layers, fallback):
    """Peak resident bytes `zppc.distribute` adds on this rank for a meta
    model of `layers` square linears of `width` (glibc maps every block of 64
    KiB or more on its own, so freed buffers leave the resident set at once).
    `fallback`: the layers initialize by `trunc_normal_`, which flyweight
    cannot replay (each is materialized whole)."""
    import ctypes

    from models import TruncatedLinear
    from torch import nn

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith(field))
        return int(line.split()[1]) * 1024

    kind = TruncatedLinear if fallback else nn.Linear
    with torch.device("meta"):
        model = nn.Sequential(*(kind(width, width, bias=False) for _ in range(layers)))
    zppc.distribute(nn.Linear(2, 2), zppc.Config(lowering="eager"))  # groups, gloo buffers
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak
    before = status("VmRSS")
    zppc.distribute(model, zppc.Config(lowering="eager"))
    return {"added": status("VmHWM") - before, "layer": width * width * 4}
