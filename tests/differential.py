"""The differential harness: one training run, four ways, compared.

`train_four_ways` trains the same model from the same seed on the same data

- "reference": one process, no zppc, on the whole batch;
- "zppc": `zppc.distribute` without `torch.compile` (the eager IR ops really
  communicate: the oracle every compiled graph must equal);
- "eager": compiled with `backend="zppc"`, `lowering="eager"`;
- "inductor": compiled with `backend="zppc"`, the default Inductor lowering;

and returns, per way, the loss of every step, the full gradients of the last
step (before the optimizer consumed them), the full parameters at the end and
every buffer. `compare` checks one way against another.

Gradient accumulation: each step runs `micro_steps` forward/backward passes on
consecutive chunks of every rank's slice, each loss divided by `micro_steps`;
the reference runs the same global micro-batches, so the two are equal in real
arithmetic.

Tolerances: numerics-preserving configurations differ from the reference only
by summation order (mean over ranks of per-rank means against one mean):
~1e-7 relative per step in float32, below 5e-5 after five steps even where
BatchNorm and Adam amplify it. A real bug (padding read as data, a lost update,
a wrong divisor) is 1e-2 or more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from models import MODELS

import zppc
from zppc.distribute import gather_full

WAYS = ("reference", "zppc", "eager", "inductor")
STEPS = 5


def make_optimizer(name: str, params):
    params = [p for p in params if p.requires_grad]
    if name == "sgd":
        # Momentum, Nesterov and weight decay: every padded element that is not
        # zero shows up in the next step (Adam's normalization would hide scale).
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    # eps 1e-5, not 1e-8: a gradient that is zero in exact arithmetic (the
    # attention key bias: softmax ignores it) is rounding noise of ~1e-9 on both
    # sides, which Adam would otherwise turn into a full lr-sized step of
    # arbitrary sign; at eps 1e-6 that noise still moved such weights by
    # lr x 1e-9 / eps = 1e-5 a step, 5e-5 in five steps, the whole float-noise
    # tolerance (ddp GPT under Inductor ended 6.07e-5 from uncompiled zppc on
    # this machine). Real gradients here are 1e-3 or more, where eps is noise.
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-5)


def _rank_micro_batches(x, rank, world, micro_steps):
    return x.chunk(world)[rank].chunk(micro_steps)


def _global_micro_batch(x, world, micro_steps, a):
    """What all ranks' a-th micro-batches make together (the reference's batch)."""
    return torch.cat([x.chunk(world)[r].chunk(micro_steps)[a] for r in range(world)])


def full_gradients(model) -> dict[str, torch.Tensor]:
    """Every logical parameter's gradient as a full tensor (collective)."""
    state = model._zppc_state
    grads = {}
    for fqn in state.specs:
        grad = state.shard(fqn).grad
        if grad is not None:
            grads[fqn] = gather_full(state.specs[fqn], grad)
    return grads


def nonzero_padding(model) -> list[str]:
    """Shards and shard gradients whose padded tail is not exactly zero on this
    rank (zero by construction: nothing may write it, nothing may read it)."""
    state = model._zppc_state
    rank = dist.get_rank()
    bad = []
    for fqn, spec in state.specs.items():
        shard = state.shard(fqn)
        valid = spec.valid_numel(rank)
        for what, t in (("shard", shard), ("grad", shard.grad)):
            if t is not None and spec.mode != "ddp" and t.detach()[valid:].count_nonzero():
                bad.append(f"{fqn} {what}")
    return bad


def buffers(model) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _train_reference(model, model_cls, optimizer, steps, world, micro_steps):
    opt = make_optimizer(optimizer, model.parameters())
    local = getattr(model_cls, "local_statistics", False)
    losses, grads, first_grads = [], {}, {}
    for i in range(steps):
        x, y = model_cls.batch(i)
        total = 0.0
        for a in range(micro_steps):
            if local:  # batch statistics per rank: run each rank's micro-batch alone
                parts = [
                    (xr[a], yr[a])
                    for xr, yr in (
                        (
                            _rank_micro_batches(x, r, world, micro_steps),
                            _rank_micro_batches(y, r, world, micro_steps),
                        )
                        for r in range(world)
                    )
                ]
            else:
                parts = [
                    (
                        _global_micro_batch(x, world, micro_steps, a),
                        _global_micro_batch(y, world, micro_steps, a),
                    )
                ]
            for xs, ys in parts:
                loss = model(xs, ys) / (micro_steps * len(parts))
                loss.backward()
                total += loss.item()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        first_grads = first_grads or grads
        opt.step()
        opt.zero_grad()
        losses.append(total)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "grads": grads,
        "first_grads": first_grads,
        "params": params,
        "buffers": buffers(model),
        "nonzero_padding": [],
    }


def _train_distributed(model, run, model_cls, optimizer, steps, rank, world, micro_steps):
    opt = make_optimizer(optimizer, model.parameters())
    losses, grads, first_grads, padding = [], {}, {}, set()
    for i in range(steps):
        x, y = model_cls.batch(i)
        xs = _rank_micro_batches(x, rank, world, micro_steps)
        ys = _rank_micro_batches(y, rank, world, micro_steps)
        total = torch.zeros(())
        for a in range(micro_steps):
            loss = run(xs[a], ys[a]) / micro_steps
            loss.backward()
            total += loss.detach().float()
        grads = full_gradients(model)
        first_grads = first_grads or grads
        padding.update(nonzero_padding(model))
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    padding.update(nonzero_padding(model))
    return {
        "losses": losses,
        "grads": grads,
        "first_grads": first_grads,
        "params": zppc.full_parameters(model),
        "buffers": buffers(model),
        "nonzero_padding": sorted(padding),
    }


def train_four_ways(
    rank,
    world,
    model_name,
    config_kwargs,
    optimizer,
    steps=STEPS,
    micro_steps=1,
    ways=WAYS,
):
    """Train `model_name` each of `ways`; returns {way: result}."""
    model_cls = MODELS[model_name]
    results = {}
    for way in ways:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = model_cls()
        if way == "reference":
            results[way] = _train_reference(model, model_cls, optimizer, steps, world, micro_steps)
            continue
        lowering = "eager" if way == "zppc" else way
        zppc.distribute(model, zppc.Config(**config_kwargs, lowering=lowering))
        run = model if way == "zppc" else torch.compile(model, backend="zppc")
        results[way] = _train_distributed(
            model, run, model_cls, optimizer, steps, rank, world, micro_steps
        )
        if way != "zppc":
            results[way]["graphs"] = len(zppc.inspect(run).compiles)
    return results


def run_cases(rank, world, cases):
    """Several (name, model, config, optimizer, micro_steps) cases in one job.

    Every `torch.empty` is filled with NaN (deterministic mode), so a read of
    memory nothing wrote fails every run instead of now and then."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    return {
        name: train_four_ways(rank, world, model, config, optimizer, micro_steps=micro_steps)
        for name, model, config, optimizer, micro_steps in cases
    }


@dataclass(frozen=True)
class Tolerance:
    """Largest allowed gaps, relative to max(1, magnitude); None skips a check."""

    loss: float = 5e-5
    param: float | None = 5e-5
    grad: float | None = 5e-5
    first_grad: float = 5e-5
    buffer: float = 5e-5


FLOAT_NOISE = Tolerance()


def snr_db(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Signal-to-noise of `got` against `want` over all tensors together, in dB."""
    signal = sum(w.double().square().sum().item() for w in want.values())
    noise = sum((got[n].double() - w.double()).square().sum().item() for n, w in want.items())
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the larger magnitude (at least 1)."""
    scale = max(1.0, a.abs().max().item(), b.abs().max().item()) if a.numel() else 1.0
    return (a.float() - b.float()).abs().max().item() / scale if a.numel() else 0.0


def compare(got: dict, want: dict, tol: Tolerance, what: str, buffers_too: bool = True) -> None:
    """Assert that one way's result equals another's within `tol`."""
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        assert math.isfinite(a), f"{what}: loss of step {i} is {a}"
        assert abs(a - b) <= tol.loss * max(1.0, abs(b)), (
            f"{what}: loss of step {i}: {a} vs {b}\n{got['losses']}\n{want['losses']}"
        )
    assert not got["nonzero_padding"], f"{what}: padding written: {got['nonzero_padding']}"
    for field, limit in (
        ("first_grads", tol.first_grad),
        ("grads", tol.grad),
        ("params", tol.param),
    ):
        if limit is None:
            continue
        assert got[field].keys() == want[field].keys(), (what, field, got[field].keys())
        gaps = {n: _gap(got[field][n], want[field][n]) for n in want[field]}
        worst = max(gaps, key=gaps.get)
        assert gaps[worst] <= limit, f"{what}: {field} of {worst} differ by {gaps[worst]:.3g}"
    if buffers_too:
        assert got["buffers"].keys() == want["buffers"].keys()
        for name, b in want["buffers"].items():
            assert torch.allclose(got["buffers"][name].float(), b.float(), atol=tol.buffer), (
                f"{what}: buffer {name}: {got['buffers'][name]} vs {b}"
            )
