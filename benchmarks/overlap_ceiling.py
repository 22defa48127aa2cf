"""How much of a bare gloo collective can hide behind compute on this machine:
the ceiling any schedule (zppc's, FSDP2's, DeepSpeed's) meets on the emulated
cluster, measured without a model.

    sudo python benchmarks/overlap_ceiling.py --inter-bw 300mbit --ranks-per-node 1,2

For each link speed and ranks per node it builds the cluster
(benchmarks/cluster.py) and runs this file as every rank's script. Each rank
times, between barriers and `--reps` times round-robin: one collective alone
(an all-gather of `--shard-mb` MB per rank: zero3's forward; an all-reduce of
the gathered size: ddp's backward), a piece of work alone, and the collective
issued asynchronously with the work run before its wait. Two kinds of work of
the same length as the collective: one-thread matrix products (compute: the
CPU the rank also needs for gloo's thread and the kernel's TCP) and a sleep
(no CPU: what the link alone allows). hidden = (work + collective - both) /
min(work, collective), the issue's measure; medians of rank 0's timings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cluster import (  # noqa: E402
    RESULT_PREFIX,
    EmulatedCluster,
    require_privileges,
    result_lines,
)

KINDS = ("all_gather", "all_reduce")


def rank_main(shard_bytes: int, reps: int) -> None:
    """One rank of the measurement (run under torchrun inside a node)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # as benchmarks/worker.py runs each rank
    world, n = dist.get_world_size(), shard_bytes // 4
    shard, gathered = torch.ones(n), torch.empty(world * n)
    summed = torch.ones(world * n)
    issue = {
        "all_gather": lambda: dist.all_gather_into_tensor(gathered, shard, async_op=True),
        "all_reduce": lambda: dist.all_reduce(summed, async_op=True),
    }
    square = torch.randn(512, 512)

    def timed(fn) -> float:
        dist.barrier()
        time.sleep(0.1)  # the barrier's packets gone, the link idle
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def products(count: int) -> None:
        x = square
        for _ in range(count):
            x = x @ x.T / 512

    def collective(kind: str) -> None:
        issue[kind]().wait()

    def overlapped(kind: str, work) -> None:
        handle = issue[kind]()
        work()
        handle.wait()

    one_product = min(timed(partial(products, 10)) for _ in range(3)) / 10
    rows = []
    for kind in KINDS:
        alone = sorted(timed(partial(collective, kind)) for _ in range(3))[1]
        works = {
            "matmul": partial(products, max(1, round(alone / one_product))),
            "sleep": partial(time.sleep, alone),
        }
        for name, work in works.items():
            samples = {"collective_s": [], "work_s": [], "both_s": []}
            for _ in range(reps):
                samples["collective_s"].append(timed(partial(collective, kind)))
                samples["work_s"].append(timed(work))
                samples["both_s"].append(timed(partial(overlapped, kind, work)))
            median = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
            rows.append({"collective": kind, "work": name, **median})
    if dist.get_rank() == 0:
        print(RESULT_PREFIX + json.dumps({"world": world, "rows": rows}))
    dist.destroy_process_group()


def measure(args) -> list[dict]:
    require_privileges()
    results = []
    for rate in args.inter_bw.split(","):
        for ranks_per_node in (int(r) for r in args.ranks_per_node.split(",")):
            with EmulatedCluster(nodes=args.nodes, rate=rate) as cluster:
                measured = cluster.measure_link()
                script = [__file__, "--rank-main", f"--shard-bytes={int(args.shard_mb * 1e6)}"]
                script.append(f"--reps={args.reps}")
                outputs = cluster.launch(
                    ranks_per_node, script, env={"PYTHONUNBUFFERED": "1"}, timeout=900
                )
            (result,) = result_lines(outputs)
            for row in result["rows"]:
                results.append(
                    {
                        "link": rate,
                        "measured_mbit": measured / 1e6,
                        "layout": f"{args.nodes} x {ranks_per_node}",
                        **row,
                    }
                )
    return results


def print_table(rows: list[dict]) -> None:
    print(
        "| link | nodes x ranks | collective | work | collective alone (ms) | work alone (ms) |"
        " both (ms) | hidden |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        comm, work, both = r["collective_s"], r["work_s"], r["both_s"]
        hidden = (comm + work - both) / min(comm, work)
        print(
            f"| {r['link']} ({r['measured_mbit']:.0f} Mbit/s) | {r['layout']} | {r['collective']} "
            f"| {r['work']} | {1e3 * comm:.1f} | {1e3 * work:.1f} | {1e3 * both:.1f} | {hidden:.0%} |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", default="1,2", help="comma-separated layouts")
    p.add_argument("--inter-bw", default="300mbit")
    p.add_argument("--shard-mb", type=float, default=2.0, help="each rank's all-gather input, MB")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("-o", "--output", type=Path, default=None, help="the rows as JSON")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shard-bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_main:
        rank_main(args.shard_bytes, args.reps)
        return 0
    rows = measure(args)
    print_table(rows)
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
