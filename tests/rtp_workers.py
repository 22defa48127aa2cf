"""Rank functions for tests/test_rtp.py."""

from __future__ import annotations

import copy

import torch
from models import MODELS
from workers import local_slice

import zppc
from zppc.distribute import state_of


def _ops(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def rtp_step(rank, world, model_name="chain", lowering="eager", extra=None):
    """One compiled RTP step after a warm-up: the ledger, which parameters are
    rotated, the final graphs' ops, and the shapes saved for backward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS[model_name]()
    zppc.distribute(
        model, zppc.Config(strategy="rtp", node_size=2, lowering=lowering, **(extra or {}))
    )
    step = torch.compile(model, backend="zppc")
    x, y = model.batch(0)
    x, y = local_slice(x, rank, world), local_slice(y, rank, world)
    step(x, y).backward()
    zppc.reset_comm_stats()
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step(x, y)
    loss.backward()
    inspection = zppc.inspect(step)
    records = inspection.compiles
    return {
        "planned": sum(c.bytes_per_peer for c in inspection.schedule if c.ring),
        "planned_unquantized": sum(
            c.unquantized_bytes_per_peer for c in inspection.schedule if c.ring
        ),
        "stats": zppc.comm_stats().as_dict(),
        "modes": {fqn: spec.mode for fqn, spec in state_of(model).specs.items()},
        "forward": [op for r in records for op in _ops(r.final["forward"])],
        "backward": [op for r in records for op in _ops(r.final["backward"])],
        "saved": saved,
        "rotated": inspection.rotated,
    }


def step_memory(rank, world, strategy, width=2048, layers=4):
    """Peak resident bytes one compiled training step adds on this rank, above
    what it held before (the OS's high-water mark, reset before the step), for
    `layers` bias-free square linears of `width`. glibc is told to map every
    block of 64 KiB or more on its own, so freed buffers leave the resident
    set at once and the mark follows the live tensors."""
    import ctypes

    from torch import nn

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith(field))
        return int(line.split()[1]) * 1024

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

        def forward(self, x, y):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return torch.nn.functional.mse_loss(x, y)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Wide()
    zppc.distribute(model, zppc.Config(strategy=strategy, node_size=2, lowering="eager"))
    step = torch.compile(model, backend="zppc")
    x, y = torch.randn(2, width), torch.randn(2, width)
    step(x, y).backward()  # compile
    for p in model.parameters():
        p.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set (VmHWM)
    before = status("VmRSS:")
    step(x, y).backward()
    return {"added": status("VmHWM:") - before, "layer": width * width * 4}


def uneven_batches(rank, world):
    """Each rank trains on a micro-batch of its own size (1 + 2 * rank rows):
    the weight gradients are the mean over ranks of each rank's gradient,
    compared with one process computing the same mean."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS["chain"]()
    reference = copy.deepcopy(model)
    zppc.distribute(model, zppc.Config(strategy="rtp", node_size=2, lowering="eager"))
    step = torch.compile(model, backend="zppc")
    sizes = [1 + 2 * r for r in range(world)]
    x, y = model.batch(0, n=sum(sizes))
    xs, ys = x.split(sizes), y.split(sizes)
    step(xs[rank], ys[rank]).backward()
    total = sum(reference(a, b) for a, b in zip(xs, ys, strict=True)) / world
    total.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {n: (grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters()}
