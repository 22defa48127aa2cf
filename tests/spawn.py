"""Run a function on several gloo ranks in fresh processes, with a hard timeout.

`run_ranks(fn, world_size, *args)` returns the list of per-rank return values,
re-raises the first rank's exception (with its traceback) and kills every rank
if the job outlives its timeout, so no test can hang.

Ranks fork from a forkserver that has already imported torch, dynamo, Inductor,
zppc and the test helpers: a spawned interpreter spends about 4 s of CPU on
those imports, and the suites start several hundred ranks on two cores. Each
rank still gets a fresh process (nothing a test leaves behind reaches the
next) and the environment of the test that started it. `ZPPC_TEST_START=spawn`
starts every rank as a new interpreter instead, to rule the forkserver out.
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import time
import traceback

import torch.multiprocessing as mp

# Imported once by the forkserver, before it forks any rank. A module missing
# here (transformers without the hf extra) is skipped by the forkserver.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "zppc",
    "models",
    "workers",
    "differential",
    "transformers",
]
_context = None


def _rank_context():
    global _context
    if _context is None:
        _context = mp.get_context(os.environ.get("ZPPC_TEST_START", "forkserver"))
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _child(fn, rank, world_size, init_file, results, args, env):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        value = fn(rank, world_size, *args)
        # Serialized here: tensors sent through the queue would share memory
        # with a process that is about to exit.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as exc:  # report everything, including assertion failures
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float = 240.0,
    env: dict | None = None,
    may_die: tuple[int, ...] = (),
) -> list:
    """`may_die`: ranks a test kills on purpose; their result is None."""
    ctx = _rank_context()
    # The forkserver holds the environment it started with; each rank gets the
    # environment of the test that starts it.
    env = {**os.environ, **(env or {})}
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, r, world_size, init_file, results, args, env),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        values: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        try:
            needed = set(range(world_size)) - set(may_die)
            while not needed <= values.keys() and not errors:
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    # A rank that died without reporting (killed, crashed in C++)
                    # fails the job now rather than at the deadline.
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in values and r not in may_die
                    ]
                    if dead:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise AssertionError(f"ranks died without a result: {codes}") from None
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(world_size)) - set(values))
                        raise TimeoutError(
                            f"ranks {missing} did not finish within {timeout}s"
                        ) from None
                    continue
                (values if status == "ok" else errors)[rank] = value
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
        if errors:
            rank = min(errors)
            raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
        import torch

        return [
            torch.load(io.BytesIO(values[r]), weights_only=False) if r in values else None
            for r in range(world_size)
        ]
