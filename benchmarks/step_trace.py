"""A profiler trace of training steps, and how much of the communication in it
ran while the main thread computed: evidence, not an assumption, that
asynchronous collectives overlap compute (gloo on CPU, NCCL on GPU).

    torchrun --nproc-per-node 4 benchmarks/step_trace.py --config zppc-zero3 --node-size 2
    torchrun --nproc-per-node 4 benchmarks/step_trace.py --config zppc-osp --node-size 2
    python benchmarks/step_trace.py --config zppc-osp --inter-bw 100mbit    # 2 nodes x 2, root
    torchrun --nproc-per-node 1 benchmarks/step_trace.py --backend nccl --preset gpt-medium

With `--inter-bw` the script runs itself on the emulated cluster of
benchmarks/cluster.py (`--nodes` x `--ranks-per-node`, the nodes joined by a
link shaped to that rate), so communication takes the time a slow network
gives it.

Rank 0 profiles two steps after the warm-up (torch.profiler, CPU activities,
every thread: gloo runs each collective on a worker thread of its own,
recorded as `gloo:<kind>`, and the second hop of a two-hop collective is
issued from a worker's completion callback, which a profiler of the calling
thread alone does not see), writes the Chrome trace (Perfetto opens the .json.gz) and
prints, per step phase, the collectives' busy time and the part of it during
which the main thread computed (was in no wait), plus each collective
still in flight when the backward that issued it ended (OSP's stage 2): how
much of it ran under the next step's optimizer and forward, and the longest
stretches in which no collective ran (the link idle: on a step the link
bounds, each is step time until the schedule moves a collective into it).

With `--every-rank` every rank writes its trace (`_rank<r>` added to the
name) and the summary adds each step phase's start and end on every rank,
read on the traces' common clock: with four ranks sharing two cores they
drift apart, and a wait on one rank then holds its peers' lateness. It also
adds, per step, how long 0, 1, ... ranks were waiting at once and the
core-seconds that left idle (`idle_cores`): on the emulated cluster, where
every rank shares the host's cores, what the step lost to waiting, split
into every rank waiting (a transfer nothing hides) and some waiting while
others compute (drift).

With `--backend nccl` (one GPU per rank) it also records the GPU: NCCL runs
each collective on a stream of its own, so the evidence is on the device's
timeline. The compute stream is the one that ran the most kernel time; every
kernel or copy on another stream is communication (a world of one rank makes
NCCL's collectives device copies on its stream, not kernels named `nccl`),
and hidden is the part of it during which a compute kernel ran.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from cluster import cpu_per_rank_arg, cpu_share, join_cpu_share, resolve_cpu_per_rank
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile, record_function
from worker import build, config_name


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def overlap(xs, ys) -> float:
    """Total length of the intersection of two unions of intervals."""
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += max(0.0, min(b, ys[k][1]) - max(a, ys[k][0]))
            k += 1
    return total


def clip(intervals, lo: float, hi: float):
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def clip_all(intervals, windows):
    return union([piece for lo, hi in windows for piece in clip(intervals, lo, hi)])


def gaps(intervals, lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of [lo, hi] that a sorted union of intervals leaves uncovered."""
    found, at = [], lo
    for a, b in clip(intervals, lo, hi):
        if a > at:
            found.append((at, a))
        at = max(at, b)
    if at < hi:
        found.append((at, hi))
    return found


def analyse(events: list[dict]) -> dict:
    """Step phases, waits and collectives (microseconds) read off a Chrome trace."""
    spans = [e for e in events if e.get("ph") == "X"]
    marks, waits = _marks_and_waits(spans)
    comms = [
        (e["ts"], e["ts"] + e["dur"], e["name"]) for e in spans if e["name"].startswith("gloo:")
    ]
    busy = union([(a, b) for a, b, _ in comms])

    def hidden(intervals) -> float:
        return length(intervals) - overlap(intervals, waits)

    phases, idle = {}, []
    for name, (lo, hi) in sorted(marks.items(), key=lambda kv: kv[1]):
        in_phase = clip(busy, lo, hi)
        phases[name] = {
            "seconds": (hi - lo) / 1e6,
            "waiting_seconds": length(clip(waits, lo, hi)) / 1e6,
            "communication_seconds": length(in_phase) / 1e6,
            "hidden_seconds": hidden(in_phase) / 1e6,
        }
        idle += [
            {"phase": name, "after_start_seconds": (a - lo) / 1e6, "seconds": (b - a) / 1e6}
            for a, b in gaps(busy, lo, hi)
        ]
    # Issued by the first step's backward and still in flight when it ended.
    lo, hi = marks["step 1 backward"]
    carried = [(a, b, name) for a, b, name in comms if lo <= a < hi < b]
    later = {p: marks[f"step 2 {p}"] for p in ("forward", "backward")}
    later["optimizer"] = marks["step 1 optimizer"]
    within = clip_all(busy, list(marks.values()))
    return {
        "phases": phases,
        "communication_seconds": length(within) / 1e6,
        "hidden_seconds": hidden(within) / 1e6,
        # Where no collective ran, longest first: on a step the link bounds,
        # each of these is step time that no schedule of the same collectives
        # can take back without moving one into it.
        "link_idle": sorted(idle, key=lambda gap: -gap["seconds"])[:IDLE_GAPS_SHOWN],
        "carried_past_backward": [
            {
                "collective": name,
                "seconds": (b - a) / 1e6,
                "after_backward_seconds": (b - hi) / 1e6,
                "under": {p: overlap([(a, b)], [span]) / 1e6 for p, span in later.items()},
            }
            for a, b, name in carried
        ],
    }


IDLE_GAPS_SHOWN = 8

GPU_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")


def analyse_gpu(events: list[dict]) -> dict:
    """Streams, communication and its overlap with compute kernels
    (microseconds) read off the GPU side of a Chrome trace."""
    activity = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_ACTIVITY]
    if not activity:
        raise ValueError("the trace holds no GPU activity (was CUDA profiled?)")
    by_stream: dict[int, list[dict]] = {}
    for e in activity:
        by_stream.setdefault(e.get("args", {}).get("stream", e["tid"]), []).append(e)

    def kernel_time(stream: int) -> float:
        return sum(e["dur"] for e in by_stream[stream] if e["cat"] == "kernel")

    compute = max(by_stream, key=kernel_time)
    spans = {s: union([(e["ts"], e["ts"] + e["dur"]) for e in es]) for s, es in by_stream.items()}
    kernels = union(
        [(e["ts"], e["ts"] + e["dur"]) for e in by_stream[compute] if e["cat"] == "kernel"]
    )
    comm = union([piece for s in by_stream if s != compute for piece in spans[s]])
    streams = []
    for s, es in sorted(by_stream.items()):
        names: dict[str, float] = {}
        for e in es:
            names[e["name"]] = names.get(e["name"], 0.0) + e["dur"]
        top = sorted(names.items(), key=lambda kv: -kv[1])[:3]
        streams.append(
            {
                "stream": s,
                "role": "compute" if s == compute else "communication",
                "events": len(es),
                "busy_seconds": length(spans[s]) / 1e6,
                "top": [{"name": n[:80], "seconds": t / 1e6} for n, t in top],
            }
        )
    nccl_calls = [e for e in events if e.get("ph") == "X" and e["name"].startswith("nccl:")]
    lo = min(e["ts"] for e in activity)
    hi = max(e["ts"] + e["dur"] for e in activity)
    return {
        "gpu_seconds": (hi - lo) / 1e6,
        "compute_kernel_seconds": length(kernels) / 1e6,
        "communication_seconds": length(comm) / 1e6,
        "hidden_seconds": overlap(comm, kernels) / 1e6,
        "collectives_issued": len(nccl_calls),
        "streams": streams,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default="zppc-zero3", type=config_name)
    p.add_argument("--preset", default="gpt-small")
    p.add_argument("--node-size", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lowering", default="eager", choices=["eager", "inductor"])
    p.add_argument("--bucket-mb", type=float, default=None)
    p.add_argument(
        "--reduce-scatter", default="auto", choices=["auto", "native", "all_to_all", "two_hop"]
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--inter-bw", default=None, help="run on the emulated cluster at this rate")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--tag", default="", help="added to the output file names")
    p.add_argument(
        "--every-rank",
        action="store_true",
        help="every rank writes its trace; the summary adds each phase's start and end per rank",
    )
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument(
        "--cpu-per-rank",
        type=cpu_per_rank_arg,
        default=None,
        help="with --inter-bw: hold each rank to this share of a core ('auto': the host's "
        "cores over the world size; benchmarks/cluster.py)",
    )
    args = p.parse_args()
    if args.cpu_per_rank is not None and args.inter_bw is None:
        p.error(
            "--cpu-per-rank holds the emulated cluster's ranks to a share of a core: give --inter-bw too"
        )
    if args.inter_bw is not None:
        sys.exit(on_emulated_cluster(args))
    join_cpu_share()
    torch.set_num_threads(1)
    on_gpu = args.backend == "nccl"
    device = torch.device("cpu")
    if on_gpu:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()

    from zppc.data import random_windows, stdlib_corpus
    from zppc.models import GPT, PRESETS

    torch.manual_seed(0)
    model = GPT(PRESETS[args.preset])
    model.to(device)
    step, opt = build(args.config, model, args)
    batches = random_windows(stdlib_corpus(4 << 20), args.batch_size, args.block, seed=1000 + rank)

    def train(i: int) -> None:
        x, y = (t.to(device) for t in next(batches))
        with record_function(f"step {i} forward"):
            loss = step(x, y)
        with record_function(f"step {i} backward"):
            loss.backward()
        with record_function(f"step {i} optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    for i in range(args.warmup):
        train(-i)
    dist.barrier()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    # Every thread: a two-hop collective's second hop is issued from a gloo
    # worker's completion callback, and a thread-local profiler misses it.
    every_thread = _ExperimentalConfig(profile_all_threads=True)
    with profile(
        activities=activities, record_shapes=False, experimental_config=every_thread
    ) as prof:
        for i in (1, 2):
            train(i)
        if on_gpu:
            torch.cuda.synchronize()
    dist.barrier()
    args.out.mkdir(parents=True, exist_ok=True)
    if rank == 0 or args.every_rank:
        suffix = f"_rank{rank}" if rank else ""
        raw = args.out / f"trace_{args.config}{args.tag}{suffix}.json"
        prof.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
        with gzip.open(f"{raw}.gz", "wt") as f:
            json.dump(trace, f)
        raw.unlink()
    dist.barrier()
    if rank == 0:
        events = trace["traceEvents"]
        result = {"gpu": analyse_gpu(events)} if on_gpu else analyse(events)
        if args.every_rank:
            traces = [trace] + [
                json.load(gzip.open(args.out / f"trace_{args.config}{args.tag}_rank{r}.json.gz"))
                for r in range(1, dist.get_world_size())
            ]
            result["ranks"] = phase_spread(traces)
            if not on_gpu:
                result["idle_cores"] = idle_cores(
                    traces, len(os.sched_getaffinity(0)), core_per_rank=cpu_share() or 1.0
                )
        report(args, result, f"{raw}.gz")
    dist.destroy_process_group()


def _marks_and_waits(spans: list[dict], base: float = 0.0) -> tuple[dict, list]:
    """A trace's step phases (name -> (start, end)) and its main thread's waits
    (a union of intervals), in microseconds, `base` added. The main thread
    (the one that marked the steps) computes, operators and Python, whenever
    it is not waiting for a collective: in a functional collective's
    wait_tensor or in zppc's own eager waits (`zppc::wait`)."""
    main = next(e["tid"] for e in spans if e["name"].startswith("step "))
    marks = {
        e["name"]: (base + e["ts"], base + e["ts"] + e["dur"])
        for e in spans
        if e["name"].startswith("step ")
    }
    waits = [
        (base + e["ts"], base + e["ts"] + e["dur"])
        for e in spans
        if e["tid"] == main and "wait" in e["name"]
    ]
    return marks, union(waits)


def _on_common_clock(trace: dict) -> tuple[dict, list]:
    """`_marks_and_waits` of one rank's trace on the clock every rank's trace
    shares (each trace's timestamps count from its own base)."""
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    return _marks_and_waits(spans, trace.get("baseTimeNanoseconds", 0) / 1e3)


def phase_spread(traces: list[dict]) -> dict:
    """Each step phase's start and end on every rank (seconds after the
    earliest rank started step 1, on the traces' common clock), and how far
    apart the ranks ended it. Where ranks share cores, they drift apart, and
    a collective's wait on one rank holds the time its peers took to reach it."""
    marks = [_on_common_clock(trace)[0] for trace in traces]
    zero = min(m["step 1 forward"][0] for m in marks)
    phases = {}
    for name in sorted(marks[0], key=lambda n: marks[0][n][0]):
        starts = [(m[name][0] - zero) / 1e6 for m in marks]
        ends = [(m[name][1] - zero) / 1e6 for m in marks]
        phases[name] = {"starts": starts, "ends": ends, "end_spread_seconds": max(ends) - min(ends)}
    return phases


def idle_cores(
    traces: list[dict], cores: int, shown_s: float = 0.05, core_per_rank: float = 1.0
) -> dict:
    """Per step, read across every rank's trace on the common clock: how long
    0, 1, ... of the ranks were waiting at once (in a collective's wait on
    their main thread, or not yet in the step or done with it), and the
    core-seconds the host's `cores` left idle for it (each rank computes on
    one thread, held to `core_per_rank` of a core where the cluster's
    `--cpu-per-rank` set a share: with r ranks computing,
    max(0, cores - r * core_per_rank) cores idle). Where
    every rank shares one host (the emulated cluster), that is what the step
    lost to waiting: a lone rank computing while its peers wait for it (the
    ranks drifting apart) leaves a core idle, as all of them waiting for a
    transfer leaves them all. Also the stretches of at least `shown_s` in
    which every rank waited, with the phase rank 0 was in."""
    marks, waits = zip(*map(_on_common_clock, traces), strict=True)
    ranks = len(traces)
    steps = sorted({name.split()[1] for name in marks[0]}, key=int)
    result = {}
    for step in steps:
        lo = min(m[f"step {step} forward"][0] for m in marks)
        hi = max(m[f"step {step} optimizer"][1] for m in marks)
        edges = []
        for m, rank_waits in zip(marks, waits, strict=True):
            start, end = m[f"step {step} forward"][0], m[f"step {step} optimizer"][1]
            for a, b in union([*clip(rank_waits, lo, hi), (lo, start), (end, hi)]):
                if b > a:
                    edges += [(a, 1), (b, -1)]
        edges.sort()
        waiting_for = [0.0] * (ranks + 1)
        all_waiting: list[tuple[float, float]] = []
        count, at = 0, lo
        for t, step_by in edges:
            waiting_for[count] += t - at
            if count == ranks and t > at:
                all_waiting.append((at, t))
            count, at = count + step_by, t
        waiting_for[count] += hi - at
        idle = sum(
            seconds * max(0.0, cores - (ranks - waiting) * core_per_rank)
            for waiting, seconds in enumerate(waiting_for)
        )
        stretches = [
            {
                "after_start_seconds": (a - lo) / 1e6,
                "seconds": (b - a) / 1e6,
                "rank0_phase": next(
                    (name for name, (x, y) in marks[0].items() if x <= a < y), None
                ),
            }
            for a, b in union(all_waiting)
            if b - a >= shown_s * 1e6
        ]
        result[f"step {step}"] = {
            "seconds": (hi - lo) / 1e6,
            "seconds_with_ranks_waiting": [w / 1e6 for w in waiting_for],
            "idle_core_seconds": idle / 1e6,
            "all_waiting": stretches,
        }
    return {"cores": cores, "core_per_rank": core_per_rank, "steps": result}


def on_emulated_cluster(args) -> int:
    """This script on `args.nodes` namespaces joined by a link of `args.inter_bw`."""
    from cluster import EmulatedCluster, require_privileges

    require_privileges()
    script = [
        str(Path(__file__).resolve()),
        f"--config={args.config}",
        f"--preset={args.preset}",
        f"--warmup={args.warmup}",
        f"--batch-size={args.batch_size}",
        f"--block={args.block}",
        f"--lr={args.lr}",
        f"--lowering={args.lowering}",
        f"--reduce-scatter={args.reduce_scatter}",
        f"--out={args.out.resolve()}",
        f"--node-size={args.ranks_per_node}",
        # Not acted on inside (no --inter-bw there): recorded with the summary.
        f"--nodes={args.nodes}",
        f"--ranks-per-node={args.ranks_per_node}",
        f"--tag=_{args.inter_bw}{args.tag}",
        *(["--every-rank"] if args.every_rank else []),
        *([f"--bucket-mb={args.bucket_mb}"] if args.bucket_mb is not None else []),
    ]
    world = args.nodes * args.ranks_per_node
    cpu_per_rank = resolve_cpu_per_rank(args.cpu_per_rank, world)
    with EmulatedCluster(
        nodes=args.nodes, rate=args.inter_bw, cpu_per_rank=cpu_per_rank
    ) as cluster:
        measured = cluster.measure_link()
        print(f"link {args.inter_bw}: measured {measured / 1e6:,.1f} Mbit/s", flush=True)
        outputs = cluster.launch(
            args.ranks_per_node, script, env={"PYTHONUNBUFFERED": "1"}, timeout=1800
        )
    print("\n".join(line for line in outputs[0].splitlines() if not line.startswith(("W", "[W"))))
    return 0


def report(args, result: dict, path: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    if "gpu" in result:
        print(
            f"\n{args.config}, {args.preset}, batch {args.batch_size} x {args.block}, {world} "
            f"rank(s) on NCCL, {args.lowering} lowering; steps 1-2 after {args.warmup} warm-up steps"
        )
        report_gpu(result["gpu"])
    else:
        report_cpu(args, result, world)
    if "ranks" in result:
        report_spread(result["ranks"])
    if "idle_cores" in result:
        report_idle_cores(result["idle_cores"])
    print(f"\nwrote {path}")
    json_path = Path(path).with_name(f"trace_{args.config}{args.tag}_summary.json")
    json_path.write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, **result}, indent=1)
    )


def report_cpu(args, result: dict, world: int) -> None:
    print(
        f"\n{args.config}, {args.preset}, {world} ranks, node size {args.node_size}, "
        f"{args.lowering} lowering; rank 0, steps 1-2 after {args.warmup} warm-up steps; "
        "communication = time some gloo collective was running; hidden = the part of it "
        "during which the main thread computed (was in no wait)\n"
    )
    print(
        "| phase | seconds | waiting s | communication s | hidden s | hidden share | link idle s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, ph in result["phases"].items():
        comm = ph["communication_seconds"]
        share = ph["hidden_seconds"] / comm if comm else 0
        print(
            f"| {name} | {ph['seconds']:.3f} | {ph['waiting_seconds']:.3f} | {comm:.3f} "
            f"| {ph['hidden_seconds']:.3f} | {share:.0%} | {ph['seconds'] - comm:.3f} |"
        )
    total, hidden = result["communication_seconds"], result["hidden_seconds"]
    print(f"| all | | | {total:.3f} | {hidden:.3f} | {hidden / total if total else 0:.0%} | |")
    print("\nlongest stretches with no collective running (the link idle):")
    for gap in result["link_idle"]:
        print(
            f"  {gap['seconds']:.3f} s in {gap['phase']}, from {gap['after_start_seconds']:.3f} s "
            "after its start"
        )
    carried = result["carried_past_backward"]
    print(f"\ncollectives issued by step 1's backward and still running after it: {len(carried)}")
    for c in carried:
        under = ", ".join(f"{p} {s:.3f} s" for p, s in c["under"].items())
        print(
            f"  {c['collective']}: {c['seconds']:.3f} s, {c['after_backward_seconds']:.3f} s "
            f"after the backward ended; under step 1's optimizer / step 2's: {under}"
        )


def report_spread(phases: dict) -> None:
    ranks = len(next(iter(phases.values()))["ends"])
    print("\neach phase's end on every rank (s after the first rank started step 1)\n")
    print("| phase | " + " | ".join(f"rank {r}" for r in range(ranks)) + " | spread |")
    print("|---|" + "---:|" * (ranks + 1))
    for name, ph in phases.items():
        ends = " | ".join(f"{t:.3f}" for t in ph["ends"])
        print(f"| {name} | {ends} | {ph['end_spread_seconds']:.3f} |")


def report_idle_cores(idle: dict) -> None:
    steps = idle["steps"]
    ranks = len(next(iter(steps.values()))["seconds_with_ranks_waiting"]) - 1
    print(
        f"\nranks waiting at once, every rank's trace read together ({idle['cores']} cores; "
        f"a rank computes on one thread, held to {idle['core_per_rank']:g} of a core; s)\n"
    )
    print(
        "| step | seconds | "
        + " | ".join(f"{k} waiting" for k in range(ranks + 1))
        + " | idle core-seconds |"
    )
    print("|---|" + "---:|" * (ranks + 3))
    for name, st in steps.items():
        counts = " | ".join(f"{s:.3f}" for s in st["seconds_with_ranks_waiting"])
        print(f"| {name} | {st['seconds']:.3f} | {counts} | {st['idle_core_seconds']:.3f} |")
    for name, st in steps.items():
        for stretch in st["all_waiting"]:
            print(
                f"  every rank waiting {stretch['seconds']:.3f} s in {name}, from "
                f"{stretch['after_start_seconds']:.3f} s after its start "
                f"(rank 0 in {stretch['rank0_phase']})"
            )


def report_gpu(gpu: dict) -> None:
    comm = gpu["communication_seconds"]
    print(
        f"\nGPU timeline: {gpu['gpu_seconds'] * 1e3:.2f} ms, compute kernels "
        f"{gpu['compute_kernel_seconds'] * 1e3:.2f} ms, communication streams "
        f"{comm * 1e3:.3f} ms of which {gpu['hidden_seconds'] * 1e3:.3f} ms "
        f"({gpu['hidden_seconds'] / comm if comm else 0:.0%}) ran beside a compute kernel; "
        f"{gpu['collectives_issued']} NCCL collectives issued\n"
    )
    print("| stream | role | events | busy ms | most time in |")
    print("|---:|---|---:|---:|---|")
    for s in gpu["streams"]:
        top = "; ".join(f"{t['name']} {t['seconds'] * 1e3:.3f} ms" for t in s["top"])
        print(
            f"| {s['stream']} | {s['role']} | {s['events']} | {s['busy_seconds'] * 1e3:.3f} | {top} |"
        )


if __name__ == "__main__":
    main()
