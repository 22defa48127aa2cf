"""Peak memory of one training step per rank, zppc zero3 beside FSDP2, at
several world sizes, on the fake process group (one process per row, no
sockets: the collectives allocate their outputs, move nothing).

    python benchmarks/memory.py                              # gpt-medium, worlds 2 and 4
    python benchmarks/memory.py --worlds 2,4,8 --bucket-mb auto,25,4

Each row runs in a fresh process: two warm-up steps (the compile), then two
measured steps. Three figures per row, from /proc/self/status:

- held: the resident set before the measured steps: the shards, gradients
  and optimizer state, and what the process carries whatever the step does
  (for a compiled model, dynamo's and Inductor's modules and graphs);
- peak: the resident peak during the measured steps (VmHWM, reset first);
- step: peak - held, what the steps add above that (an upper bound on what
  one step's activations, gathered weights and gradients in flight need:
  the allocator may keep what an earlier step freed, so held includes some).
- trimmed: the resident set after the measured steps once glibc has handed
  its free pages back (`malloc_trim(0)`): what the process holds between
  steps, without what the allocator keeps of freed blocks. Where two rows'
  trimmed figures agree and their peaks do not, the difference is the
  allocator's, not the program's (None off glibc).

A fourth figure comes from a second process per row, under the profiler:
"live tensors, peak", the most bytes of tensors alive at once during a
step, counting every tensor the row allocated from building the model on.
It leaves out what the allocator keeps and the compile stack, so it compares
what the two programs hold, exactly and run to run.

`torch-fsdp2-compile-stack` is FSDP2 in a process that also compiled a
one-op function (dynamo, AOTAutograd and what they import): the part of a
compiled model's footprint that no pass can change.

MiB = 2^20 bytes. Ratios are to FSDP2 at the same world size, in this run.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = ("torch-fsdp2", "torch-fsdp2-compile-stack", "zppc-zero3")


def build_step(
    kind: str,
    world: int,
    bucket_mb: float | None,
    preset: str,
    batch: int,
    lowering: str = "eager",
    accumulate: int = 1,
):
    """The model of one row, distributed, and a function running one training
    step of it (`accumulate` forwards and backwards, AdamW, zero_grad), on the
    process group already set up."""
    import torch

    import zppc
    from zppc.models import GPT, PRESETS

    torch.manual_seed(0)
    cfg = PRESETS[preset]
    model = GPT(cfg)
    if kind == "torch-fsdp2-compile-stack":
        # What any compiled model carries, the step aside: dynamo, AOTAutograd
        # and the modules they load, brought in by a one-op compile.
        warm = torch.compile(lambda x: (x * 2).sum(), backend="aot_eager")
        warm(torch.ones(2, requires_grad=True)).backward()
    if kind.startswith("torch-fsdp2"):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        step = model
    else:
        config = zppc.Config(
            strategy="zero3",
            lowering=lowering,
            node_size=world,
            bucket_bytes=None if bucket_mb is None else int(bucket_mb * 2**20),
        )
        zppc.distribute(model, config)
        step = torch.compile(model, backend="zppc")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1))

    def one_step():
        for _ in range(accumulate):
            step(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    return one_step


def measure(
    kind: str,
    world: int,
    bucket_mb: float | None,
    preset: str,
    batch: int,
    live: bool,
    lowering: str,
    accumulate: int = 1,
) -> dict:
    """One row, in this process: rank 0 of `world` on the fake process group.
    The resident-set figures, or with `live` the peak of live tensor bytes
    (`peak_live_tensor_bytes`; the profiler it needs would distort the
    resident set, so it runs in a process of its own)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    row = {"config": kind, "world": world, "bucket_mb": None, "accumulate": accumulate}
    if kind == "zppc-zero3":
        from zppc.config import block_bucket_bytes
        from zppc.models import GPT, PRESETS

        with torch.device("meta"):
            cap = (
                bucket_mb * 2**20
                if bucket_mb is not None
                else block_bucket_bytes(GPT(PRESETS[preset]))
            )
        row.update(bucket_mb=cap / 2**20, bucket="auto" if bucket_mb is None else "fixed")
    if live:
        peak = peak_live_tensor_bytes(
            lambda: build_step(kind, world, bucket_mb, preset, batch, lowering, accumulate)
        )
        dist.destroy_process_group()
        return {**row, "live_peak_bytes": peak}
    one_step = build_step(kind, world, bucket_mb, preset, batch, lowering, accumulate)
    one_step()
    one_step()
    gc.collect()
    held = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    one_step()
    one_step()
    peak = _status_bytes("VmHWM")
    trimmed = _trimmed_resident_bytes()
    dist.destroy_process_group()
    return {
        **row,
        "held_bytes": held,
        "peak_bytes": peak,
        "step_bytes": peak - held,
        "trimmed_bytes": trimmed,
    }


def _trimmed_resident_bytes() -> int | None:
    """The resident set once glibc's malloc has returned every free page it
    can (None where the C library is not glibc)."""
    import ctypes

    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    gc.collect()
    trim(0)
    return _status_bytes("VmRSS")


MEASURED = "zppc-memory: measured step"


def peak_live_tensor_bytes(build: Callable[[], Callable[[], None]], warmup: int = 2) -> int:
    """The most bytes of CPU tensors alive at once during one training step:
    `build()` makes the model (inside the measurement, so every tensor it holds
    is counted) and returns a step function, which runs `warmup` times and then
    once measured. Counted from the profiler's allocation events, so what the
    allocator keeps after a free, and Python's and the compiler's own objects,
    are left out: the figure depends on the program alone."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = build()
        for _ in range(warmup):
            step()
        with record_function(MEASURED):
            step()
    allocations, measured_from = [], None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.name == MEASURED:
            measured_from = event.start_time_ns
        if event.typed[0] == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.typed[1].alloc_size))
        stack.extend(event.children)
    live = peak = 0
    for time_ns, size in sorted(allocations):
        live += size
        if time_ns >= measured_from:
            peak = max(peak, live)
    return peak


def run_row(
    kind: str,
    world: int,
    bucket: str,
    what: str,
    preset: str = "gpt-medium",
    lowering: str = "eager",
    batch: int = 4,
    accumulate: int = 1,
) -> dict:
    """One row's figures (`what`: "rss" or "live"), measured in a fresh process
    so that nothing an earlier row left behind can shift them. `bucket`: MiB,
    or "auto" for Config's default."""
    child = [sys.executable, __file__, "--preset", preset, "--lowering", lowering]
    child += ["--batch-size", str(batch), "--accumulate", str(accumulate)]
    child += ["--row", f"{kind}:{world}:{bucket}:{what}"]
    done = subprocess.run(child, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} at world {world} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise KeyError(key)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt-medium")
    p.add_argument("--lowering", choices=("eager", "inductor"), default="eager", help="zppc's")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="micro-batches per optimizer step: with 2 or more the gradient shards of "
        "the earlier ones are alive through the last one's forward and backward",
    )
    p.add_argument("--worlds", default="2,4")
    p.add_argument(
        "--bucket-mb",
        default="auto,25",
        help="zppc zero3's bucket caps, MiB; auto: Config's default (the repeated block)",
    )
    p.add_argument(
        "--configs",
        default=",".join(ROWS),
        help="rows to measure (torch-fsdp2 is needed: the ratios are to it)",
    )
    p.add_argument("-o", "--output", type=Path, default=None, help="the rows as JSON")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # one row, in a child
    args = p.parse_args(argv)
    configs = args.configs.split(",")
    if "torch-fsdp2" not in configs or not set(configs) <= set(ROWS):
        p.error(f"--configs: torch-fsdp2 and any of {list(ROWS)}, got {args.configs!r}")
    if args.accumulate < 1:
        p.error(f"--accumulate must be at least 1, got {args.accumulate}")
    if args.row:
        kind, world, bucket, what = args.row.split(":")
        live = what == "live"
        cap = None if bucket == "auto" else float(bucket)
        row = measure(
            kind,
            int(world),
            cap,
            args.preset,
            args.batch_size,
            live,
            args.lowering,
            args.accumulate,
        )
        print(json.dumps(row))
        return 0
    worlds = [int(w) for w in args.worlds.split(",")]
    buckets = args.bucket_mb.split(",")
    rows = []
    for world in worlds:
        rows_here = [(kind, "0") for kind in configs if kind != "zppc-zero3"]
        if "zppc-zero3" in configs:
            rows_here += [("zppc-zero3", b) for b in buckets]
        for kind, bucket in rows_here:
            row = {}
            for what in ("rss", "live"):
                row.update(
                    run_row(
                        kind,
                        world,
                        bucket,
                        what,
                        args.preset,
                        args.lowering,
                        args.batch_size,
                        args.accumulate,
                    )
                )
            rows.append(row)
            print(f"  {kind} world {world} bucket {bucket} MiB: done", file=sys.stderr)
    print(
        f"{args.preset}, batch {args.batch_size} x {args.accumulate} micro-batches, AdamW, "
        f"zppc lowering {args.lowering}, "
        "fake process group; MiB = 2^20 bytes\n"
    )
    print(
        "| world | configuration | held (MiB) | peak (MiB) | vs FSDP2 | step (MiB) | vs FSDP2 "
        "| trimmed (MiB) | live tensors, peak (MiB) | vs FSDP2 |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world in worlds:
        same = [r for r in rows if r["world"] == world]
        fsdp2 = next(r for r in same if r["config"] == "torch-fsdp2")
        for r in same:
            name = r["config"]
            if r["bucket_mb"]:
                name += f", {r['bucket_mb']:.3g} MiB buckets" + (
                    " (auto)" if r["bucket"] == "auto" else ""
                )
            print(
                f"| {world} | {name} | {r['held_bytes'] / 2**20:,.0f} | "
                f"{r['peak_bytes'] / 2**20:,.0f} | {r['peak_bytes'] / fsdp2['peak_bytes']:.2f}x | "
                f"{r['step_bytes'] / 2**20:,.0f} | {r['step_bytes'] / fsdp2['step_bytes']:.2f}x | "
                f"{_mib(r.get('trimmed_bytes'))} | {r['live_peak_bytes'] / 2**20:,.1f} | "
                f"{r['live_peak_bytes'] / fsdp2['live_peak_bytes']:.3f}x |"
            )
    print_fall(rows, worlds, model_state_bytes(args.preset))
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1))
    return 0


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:,.0f}"


def model_state_bytes(preset: str) -> int:
    """What AdamW training keeps of the whole model: parameters, gradients and
    two moments, four copies of the parameters' bytes. Sharding divides it by
    the world size."""
    import torch

    from zppc.models import GPT, PRESETS

    with torch.device("meta"):
        model = GPT(PRESETS[preset])
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def print_fall(rows: list[dict], worlds: list[int], state_bytes: int) -> None:
    """How much each configuration's peaks fall from one world size to the next,
    against the ideal: the per-rank share of the model state that sharding
    removes, state / small - state / large."""
    print(
        "\n| configuration | worlds | ideal fall (MiB) | live peak falls (MiB) | of the ideal "
        "| resident peak falls (MiB) | of the ideal |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for small, large in itertools.pairwise(worlds):
        ideal = state_bytes / small - state_bytes / large
        for before in (r for r in rows if r["world"] == small):
            after = next(
                r
                for r in rows
                if r["world"] == large
                and (r["config"], r.get("bucket")) == (before["config"], before.get("bucket"))
            )
            live = before["live_peak_bytes"] - after["live_peak_bytes"]
            resident = before["peak_bytes"] - after["peak_bytes"]
            print(
                f"| {before['config']} {before.get('bucket') or ''} | {small} -> {large} "
                f"| {ideal / 2**20:,.1f} | {live / 2**20:,.1f} | {live / ideal:.0%} "
                f"| {resident / 2**20:,.0f} | {resident / ideal:.0%} |"
            )


if __name__ == "__main__":
    sys.exit(main())
