"""The emulated cluster's inter-node link as a one-way stream sees it and as
`zppc links` (all-gathers over the job's own groups) sees it, side by side,
and the communication time the cost model predicts with each against a
run's measured communication-alone time.

    python benchmarks/links.py --nodes 2 --ranks-per-node 2 --inter-bw 50mbit \
        --bench benchmarks/results/bench_comm_alone_50mbit.json

Needs root (benchmarks/cluster.py). `--bench`: a benchmarks/run.py report with
`--comm-batch-size` rows (or one run at `--batch-size 1`) on the same cluster
shape and link; each of its zppc
rows is planned (`zppc schedule`, as benchmarks/predict.py reads the cluster)
at both rates, and its communication-only time (the small-batch step on the
link less the one on the fastest link) is the measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cluster import EmulatedCluster  # noqa: E402
from predict import RECORDED_RATES, plan, schedule_flags  # noqa: E402


def measure(args) -> dict:
    """The one-way stream's rate and `zppc links`' measurement, on one cluster."""
    with EmulatedCluster(nodes=args.nodes, rate=args.inter_bw) as cluster:
        stream = cluster.measure_link()
        links = cluster.measure_collectives(args.ranks_per_node, args.message_mb, args.repeats)
    record = {
        "inter_bw": args.inter_bw,
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "stream_bits_per_second": stream,
        "links": links,
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return record


def compare(record: dict, bench: dict) -> None:
    """Each zppc row's planned communication time at both rates against its
    measured communication-alone time."""
    run_args = bench["args"]
    links = sorted(bench["links"], key=lambda link: -link["measured_bits_per_second"])
    fastest = {row["config"]: row for row in links[0]["rows"]}
    slow = next(link for link in links if link["rate"] == record["inter_bw"])
    rates = bench.get("machine_rates") or json.loads(RECORDED_RATES.read_text())
    collective_bits = 8 * record["links"]["inter_bytes_per_second"]
    print(
        f"\ninter-node link {record['inter_bw']}: one-way stream "
        f"{record['stream_bits_per_second'] / 1e6:.1f} Mbit/s, all-gathers across the nodes "
        f"{collective_bits / 1e6:.1f} Mbit/s into each node "
        f"({collective_bits / record['stream_bits_per_second']:.0%} of the stream)\n"
    )
    print(
        "| configuration | communication alone, measured (s) | planned at the stream's rate (s) "
        "| error | planned at the all-gathers' rate (s) | error |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for row in slow["rows"]:
        slow_step = alone(row, run_args)
        if schedule_flags(row["config"]) is None or slow_step is None:
            continue
        measured = slow_step - alone(fastest.get(row["config"], {}), run_args)
        cells = []
        for bits in (record["stream_bits_per_second"], collective_bits):
            planned = plan(run_args, row["config"], bits, rates)["communication_seconds"]
            cells.append(f"{planned:.3f} | {planned / measured - 1:+.0%}")
        print(f"| {row['config']} | {measured:.3f} | {' | '.join(cells)} |")


def alone(row: dict, run_args: dict) -> float | None:
    """A row's step with next to no compute: its `--comm-batch-size` run's, or
    its own in a run made at batch 1."""
    if row.get("status") != "ok":
        return None
    if "comm_only_step_seconds" in row:
        return row["comm_only_step_seconds"]
    return row["median_step_seconds"] if run_args.get("batch_size") == "1" else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--inter-bw", default="50mbit")
    p.add_argument("--message-mb", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bench", type=Path, default=None)
    p.add_argument("--out", default=None, help="default results/links_<bw>_<N>x<D>.json")
    args = p.parse_args(argv)
    args.out = args.out or str(
        HERE / "results" / f"links_{args.inter_bw}_{args.nodes}x{args.ranks_per_node}.json"
    )
    record = measure(args)
    if args.bench:
        compare(record, json.loads(args.bench.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
