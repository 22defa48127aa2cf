"""Rank functions of the reliability tests: buffers, timeouts, dead peers,
non-finite gradients, accumulation without communication."""

from __future__ import annotations

import os
import signal
import time
import warnings

import torch
import torch.distributed as dist
from models import MODELS
from workers import local_slice, make_optimizer

import zppc


def _run(model, way: str):
    return model if way == "uncompiled" else torch.compile(model, backend="zppc")


def _lowering(way: str) -> str:
    return "eager" if way == "uncompiled" else way


def batchnorm_buffers(rank, world, way, policies=("broadcast", None)):
    """`_batchnorm_run` for each buffer policy, in one job."""
    return {policy: _batchnorm_run(rank, world, way, policy) for policy in policies}


def _batchnorm_run(rank, world, way, buffer_sync, steps=3):
    """BatchNormNet under zero3 trained `steps` SGD steps on this rank's slice;
    returns its buffers and an eval output on the same input on every rank."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS["batchnorm"]()
    config = zppc.Config(node_size=2, lowering=_lowering(way), buffer_sync=buffer_sync)
    zppc.distribute(model, config)
    run = _run(model, way)
    opt = make_optimizer("sgd", model.parameters())
    zppc.reset_comm_stats()
    for i in range(steps):
        x, y = type(model).batch(i)
        run(local_slice(x, rank, world), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    stats = zppc.comm_stats().as_dict()
    model.eval()
    x, y = type(model).batch(99)
    with torch.no_grad():
        evaluated = run(x, y)
    return {
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "eval": evaluated,
        "broadcast_calls": stats["calls"].get("broadcast", 0),
    }


def stalled_peer(rank, world, way, timeout_s):
    """Rank 1 stops calling collectives (sleeps past the timeout) after one
    step; rank 0 must fail within the timeout with an error naming the
    operation. Returns rank 0's error and how long it took."""
    torch._dynamo.reset()
    model = MODELS["padded"]()
    zppc.distribute(model, zppc.Config(lowering=_lowering(way), timeout_s=timeout_s))
    run = _run(model, way)
    x, y = type(model).batch(0)
    x, y = local_slice(x, rank, world), local_slice(y, rank, world)
    run(x, y).backward()
    if rank == 1:
        time.sleep(3 * timeout_s)
        return None
    start = time.monotonic()
    try:
        run(x, y).backward()
    except zppc.CollectiveError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def killed_peer(rank, world, timeout_s):
    """Rank 1 is killed (SIGKILL) between two compiled steps; the others must
    raise a CollectiveError, well within the timeout."""
    torch._dynamo.reset()
    model = MODELS["padded"]()
    zppc.distribute(model, zppc.Config(lowering="eager", timeout_s=timeout_s))
    step = torch.compile(model, backend="zppc")
    x, y = type(model).batch(0)
    x, y = local_slice(x, rank, world), local_slice(y, rank, world)
    step(x, y).backward()
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)  # the peer is gone before the next collective
    start = time.monotonic()
    try:
        step(x, y).backward()
        step(x, y).backward()
    except zppc.CollectiveError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def nonfinite_gradients(rank, world, variants):
    """`_nonfinite_run` for each (strategy, policy), in one job."""
    return {variant: _nonfinite_run(rank, world, *variant) for variant in variants}


def _nonfinite_run(rank, world, strategy, policy):
    """AdamW, 3 steps; at the second, a NaN appears in rank 2's gradient shard
    only (after the reduction, so no other rank sees it). Returns the
    parameters and optimizer step counts before and after that step, the
    warnings and the error."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS["padded"]()
    zppc.distribute(model, zppc.Config(strategy=strategy, lowering="eager", nonfinite_grads=policy))
    step = torch.compile(model, backend="zppc")
    opt = make_optimizer("adamw", model.parameters())
    out = {"error": None, "warnings": []}
    for i in range(3):
        x, y = type(model).batch(i)
        step(local_slice(x, rank, world), local_slice(y, rank, world)).backward()
        if i == 1:
            if rank == 2:
                model._zppc_state.flat_shards["l1.weight"].grad[0] = float("nan")
            out["before"] = zppc.full_parameters(model)
            out["steps_before"] = [float(s["step"]) for s in opt.state.values()]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    opt.step()
                except FloatingPointError as exc:
                    out["error"] = str(exc)
                    return out
            out["warnings"] = [str(w.message) for w in caught if "zppc" in str(w.message)]
            out["after"] = zppc.full_parameters(model)
            out["steps_after"] = [float(s["step"]) for s in opt.state.values()]
            out["grads_kept"] = all(p.grad is not None for p in model.parameters())
        else:
            opt.step()
        opt.zero_grad()
    out["final"] = zppc.full_parameters(model)
    out["skipped"] = model._zppc_state.skipped_steps
    return out


def accumulations_without_sync(rank, world, variants):
    """`_accumulation_run` for each (strategy, way), in one job."""
    return {variant: _accumulation_run(rank, world, *variant) for variant in variants}


def _accumulation_run(rank, world, strategy, way, micro_steps=3, steps=2):
    """`micro_steps` micro-batches per step, all but the last under
    `zppc.no_sync`, against the same model accumulating with a reduction every
    micro-step (itself checked against one process elsewhere). Returns both
    models' parameters and the bytes each deferred backward moved, by kind."""
    out = {}
    for variant in ("no_sync", "sync_every_micro_step"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MODELS["padded"]()
        config = zppc.Config(strategy=strategy, node_size=2, lowering=_lowering(way))
        zppc.distribute(model, config)
        run = _run(model, way)
        opt = make_optimizer("sgd", model.parameters())
        deferred_bytes = []
        for i in range(steps):
            x, y = type(model).batch(i, n=8 * world)
            xs, ys = (
                local_slice(x, rank, world).chunk(micro_steps),
                local_slice(y, rank, world).chunk(micro_steps),
            )
            for a in range(micro_steps):
                last = a == micro_steps - 1
                if variant == "no_sync" and not last:
                    with zppc.no_sync(model):
                        loss = run(xs[a], ys[a]) / micro_steps
                        zppc.reset_comm_stats()
                        loss.backward()
                        deferred_bytes.append(zppc.comm_stats().by_kind)
                else:
                    (run(xs[a], ys[a]) / micro_steps).backward()
            opt.step()
            opt.zero_grad()
        out[variant] = {"params": zppc.full_parameters(model), "deferred_bytes": deferred_bytes}
        if variant == "no_sync":
            with zppc.no_sync(model):
                run(xs[0], ys[0]).backward()
            try:
                opt.step()
                out["early_step_error"] = None
            except ValueError as exc:
                out["early_step_error"] = str(exc)
            (run(xs[0], ys[0]) * 0).backward()  # flush, so nothing is left pending
    return out


def interrupted_save(rank, world, path, phase):
    """phase "first": train 2 steps, save, train a step, save again while rank 1
    is killed inside DCP's file writing; rank 0 returns the parameters of the
    first save and the error the second raised. phase "load": a fresh job
    loads `path`."""
    torch._dynamo.reset()
    torch.manual_seed(0 if phase == "first" else 1)
    model = MODELS["padded"]()
    zppc.distribute(model, zppc.Config(lowering="eager", timeout_s=60))
    opt = make_optimizer("adamw", model.parameters())
    if phase == "load":
        zppc.load(model, opt, path)
        return {"params": zppc.full_parameters(model), "steps": _adam_steps(opt)}
    for i in range(3):
        x, y = MODELS["padded"].batch(i)
        model(local_slice(x, rank, world), local_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        if i == 1:
            zppc.save(model, opt, path)
            saved = {"params": zppc.full_parameters(model), "steps": _adam_steps(opt)}
    if rank == 1:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = die
    try:
        zppc.save(model, opt, path)
        error = None
    except Exception as exc:  # noqa: BLE001 (DCP wraps the failure in its own type)
        error = f"{type(exc).__name__}: {exc}"
    return {**saved, "error": error}


def _adam_steps(opt) -> list[float]:
    return [float(s["step"]) for s in opt.state.values()]
