"""Rank functions for tests/test_rtp.py."""

from __future__ import annotations

import torch
from models import MODELS
from workers import local_slice

import zppc
from zppc.distribute import state_of


def _ops(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def rtp_step(rank, world, model_name="chain", lowering="eager"):
    """One compiled RTP step after a warm-up: the ledger, which parameters are
    rotated, the final graphs' ops, and the shapes saved for backward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS[model_name]()
    zppc.distribute(model, zppc.Config(strategy="rtp", node_size=2, lowering=lowering))
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
        "stats": zppc.comm_stats().as_dict(),
        "modes": {fqn: spec.mode for fqn, spec in state_of(model).specs.items()},
        "forward": [op for r in records for op in _ops(r.final["forward"])],
        "backward": [op for r in records for op in _ops(r.final["backward"])],
        "saved": saved,
        "rotated": inspection.rotated,
    }
