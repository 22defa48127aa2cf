"""zppc and its peers side by side on an emulated multi-node cluster.

    sudo python benchmarks/run.py --nodes 2 --ranks-per-node 2 --inter-bw 1gbit,100mbit --steps 20
    sudo python benchmarks/run.py --quick          # a couple of minutes: checks the harness

For each link speed, builds the cluster (benchmarks/cluster.py), measures the
shaped link, then runs every configuration (benchmarks/worker.py) with the same
model, data, seed and steps. With --repeats N it does all of that N times
over, interleaved, and each row reports its median run with every run's step
beside it: on a shared machine one slow minute then moves one run, not a row.
Configurations that cannot run here are listed with the reason, never skipped
silently; a row whose run fails before any rank finished its first step (gloo
aborts at start-up now and then on a busy machine) is run once more, the first
failure kept in the row as `retried_after`; a failure after that is the row's
result. Prints a markdown table and writes bench.json and bench.png into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cluster import (  # noqa: E402
    ClusterError,
    EmulatedCluster,
    cpu_per_rank_arg,
    require_privileges,
    resolve_cpu_per_rank,
)
from machine import measure_rates  # noqa: E402
from worker import (  # noqa: E402
    CONFIGS,
    FIRST_STEP_DONE,
    LOWERINGS,
    config_entry,
    why_not_runnable,
)

QUICK_CONFIGS = ["torch-fsdp2", "zppc-zero3", "zppc-zero3-qwz-int8", "zppc-zero3-qgz"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument(
        "--inter-bw", default="1gbit,100mbit", help="comma-separated tc rates, e.g. 1gbit,100mbit"
    )
    p.add_argument("--latency", default=None, help="added one-way latency, e.g. 1ms")
    p.add_argument(
        "--cpu-per-rank",
        type=cpu_per_rank_arg,
        default=None,
        help="hold each rank to this share of a core (a cgroup's CFS quota; 'auto': the "
        "host's cores over the world size), as each rank of a real cluster has its own "
        "device; default: ranks share the cores freely",
    )
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--lowering", default="eager", choices=LOWERINGS)
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="zppc's bucket cap in MiB (default: Config's, the model's repeated block); overlap needs several buckets per graph",
    )
    p.add_argument(
        "--reduce-scatter",
        default="auto",
        choices=["auto", "native", "all_to_all", "two_hop"],
        help="zppc's Config.reduce_scatter for the rows that do not set their own",
    )
    p.add_argument(
        "--configs",
        default=None,
        help="comma-separated subset of (default: all): "
        + ", ".join(CONFIGS)
        + "; a zppc row followed by @eager or @inductor runs with that lowering, by"
        " :<MiB>mib (e.g. zppc-zero3@inductor:2mib) with that bucket cap",
    )
    p.add_argument(
        "--compute-slowdown",
        type=float,
        default=3.54,
        help="one thread's measured rates over a rank's here (ranks share the cores), for the "
        "rows that plan with a cost model; default: benchmarks/predict.py's calibration on "
        "the twelfth run",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every row on every link, interleaved (every row and link once, then again); "
        "a row reports its median run by step time",
    )
    p.add_argument(
        "--comm-batch-size",
        type=int,
        default=None,
        help="also run every row at this batch per rank (1: next to no compute; the same "
        "parameters, so the same collectives and bytes): its step on a slow link less its step "
        "on the fastest is the row's communication-only time, measured, which the overlap table "
        "then uses beside the link time",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument(
        "--quick", action="store_true", help="tiny model, 3 steps, 4 configurations, 100mbit"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.warmup, args.block = "gpt-tiny", 3, 1, 32
        args.inter_bw = "100mbit"
        args.configs = args.configs or ",".join(QUICK_CONFIGS)
    args.configs = args.configs or ",".join(CONFIGS)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.comm_batch_size is not None and not 1 <= args.comm_batch_size < args.batch_size:
        p.error(
            f"--comm-batch-size must be at least 1 and below --batch-size {args.batch_size}, "
            f"got {args.comm_batch_size}"
        )
    for name in args.configs.split(","):
        try:
            config_entry(name)
        except KeyError as exc:
            p.error(f"unknown configuration {exc}")
    return args


def rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate must end in kbit, mbit or gbit, got {rate!r}")


def run_row(cluster: EmulatedCluster, name: str, args) -> dict:
    """One configuration's row: its results, or why it failed."""
    try:
        return {**run_config(cluster, name, args), "status": "ok"}
    except ClusterError as exc:
        return {
            "config": name,
            "status": f"failed: {str(exc).splitlines()[0]}",
            "log": str(exc)[-2000:],
        }


def run_config(cluster: EmulatedCluster, name: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        script = [
            str(HERE / "worker.py"),
            f"--config={name}",
            f"--preset={args.model}",
            f"--steps={args.steps}",
            f"--warmup={args.warmup}",
            f"--batch-size={args.batch_size}",
            f"--block={args.block}",
            f"--lowering={args.lowering}",
            f"--result={result_path}",
        ]
        if args.bucket_mb is not None:
            script.append(f"--bucket-mb={args.bucket_mb}")
        script.append(f"--reduce-scatter={args.reduce_scatter}")
        # The cluster as the cost model reads it (rows with cost_model="cluster").
        script += [
            f"--link-bits-per-second={args.link_bits_per_second:.6g}",
            f"--flops-per-second={args.machine_rates['flops_per_second'] / args.compute_slowdown:.6g}",
            f"--memory-bytes-per-second={args.machine_rates['memory_bytes_per_second'] / args.compute_slowdown:.6g}",
        ]
        before = cluster.bytes_left_nodes()
        start = time.monotonic()
        cluster.launch(
            args.ranks_per_node, script, env={"PYTHONUNBUFFERED": "1"}, timeout=args.timeout
        )
        result = json.loads(result_path.read_text())
        result["wall_seconds"] = time.monotonic() - start
        result["link_bytes_whole_job"] = cluster.bytes_left_nodes() - before
        return result


def run_rows(cluster: EmulatedCluster, names: list[str], args) -> list[dict]:
    """Every configuration once on this cluster, in order; with
    --comm-batch-size each row's run at that batch follows it, kept in the row
    as `comm_only` (its status and step)."""
    rows = []
    for name in names:
        reason = why_not_runnable(name)
        if reason:
            rows.append({"config": name, "status": f"not runnable: {reason}"})
            continue
        print(f"  {name} ...", flush=True)
        row = run_row_retrying(cluster, name, args)
        if args.comm_batch_size is not None:
            print(f"  {name} at batch {args.comm_batch_size} ...", flush=True)
            alone = argparse.Namespace(**{**vars(args), "batch_size": args.comm_batch_size})
            comm = run_row_retrying(cluster, name, alone)
            row["comm_only"] = {
                "batch_size": args.comm_batch_size,
                "status": comm["status"],
                "median_step_seconds": comm.get("median_step_seconds"),
                **({"log": comm["log"]} if "log" in comm else {}),
            }
        rows.append(row)
    return rows


def run_row_retrying(cluster: EmulatedCluster, name: str, args) -> dict:
    """`run_row`, once more where the run failed before any rank finished its
    first step (gloo's start-up), the first failure kept as `retried_after`."""
    row = run_row(cluster, name, args)
    if row["status"] != "ok" and FIRST_STEP_DONE not in row["log"]:
        print(f"  {name} failed ({row['status']}); once more", flush=True)
        row = {**run_row(cluster, name, args), "retried_after": row}
    return row


def merge_runs(rate: str, runs: list[dict]) -> dict:
    """One link's entry from its runs (one per repeat, rows in the same order):
    the median of the measured rates (the one-way stream's and the
    all-gathers' the cost model prices), and for each row its median run by
    median step time (the lower middle one of an even count; failed runs do
    not count). With more than one run each row keeps `runs`, every run's
    status, step, link rate, whether it was retried and a failed run's log,
    in the order they ran. A row run with --comm-batch-size also gets
    `comm_only_step_seconds`, the median of its runs at that batch, chosen
    apart from the main runs' median, and each run its own."""
    measured = [run["measured_bits_per_second"] for run in runs]
    link = {
        "rate": rate,
        "set_bits_per_second": rate_bits(rate),
        "measured_bits_per_second": statistics.median(measured),
        "rows": [],
    }
    if len(runs) > 1:
        link["measured_bits_per_second_runs"] = measured
    collective = [
        run["collective_bits_per_second"] for run in runs if "collective_bits_per_second" in run
    ]
    if collective:
        link["collective_bits_per_second"] = statistics.median(collective)
        if len(runs) > 1:
            link["collective_bits_per_second_runs"] = collective
    for rows in zip(*(run["rows"] for run in runs), strict=True):
        ran_alone = any("comm_only" in r for r in rows)
        done = sorted(
            (r for r in rows if r["status"] == "ok"), key=lambda r: r["median_step_seconds"]
        )
        row = dict(lower_middle(done) if done else rows[0])
        alone = sorted(step for step in map(comm_only_step, rows) if step is not None)
        if alone:
            row["comm_only_step_seconds"] = lower_middle(alone)
        if len(runs) > 1:
            row["runs"] = [
                {
                    "status": r["status"],
                    "median_step_seconds": r.get("median_step_seconds"),
                    "measured_bits_per_second": bits,
                    "retried": "retried_after" in r,
                    **({"log": r["log"]} if "log" in r else {}),
                    **({"comm_only_step_seconds": comm_only_step(r)} if ran_alone else {}),
                }
                for r, bits in zip(rows, measured, strict=True)
            ]
        link["rows"].append(row)
    return link


def lower_middle(ordered: list):
    """The median of a sorted list, the lower middle one of an even count: a
    run that happened, not an average of two."""
    return ordered[(len(ordered) - 1) // 2]


def comm_only_step(row: dict) -> float | None:
    """A run's step at --comm-batch-size, where it ran and finished."""
    alone = row.get("comm_only", {})
    return alone.get("median_step_seconds") if alone.get("status") == "ok" else None


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        require_privileges()
    except ClusterError as exc:
        print(f"benchmarks/run.py: {exc}", file=sys.stderr)
        return 2
    names = args.configs.split(",")
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "links": []}
    # Runs recorded before Config.bucket_bytes=None followed the model's block ran 25 MiB.
    report["args"]["bucket_default"] = "block"
    # Runs recorded before Config.keep_last_block re-gathered every weight in backward.
    report["args"]["zero3_default_keeps"] = "last_block"
    # Runs recorded before keep_last_block's budget was prefetch + 1 buckets kept one at most.
    report["args"]["zero3_keep_budget"] = "prefetch_buckets"
    # Runs recorded before Config.edge_buckets bucketed a graph's edges like the rest.
    report["args"]["edge_buckets"] = "on"
    # Runs recorded before it reduced in two hops on gloo under "auto" exchanged directly.
    report["args"]["reduce_scatter_auto"] = "two_hop"
    # One thread's compute rates, for benchmarks/predict.py's cost model.
    report["machine_rates"] = args.machine_rates = measure_rates()
    rates = args.inter_bw.split(",")
    cpu_per_rank = resolve_cpu_per_rank(args.cpu_per_rank, args.nodes * args.ranks_per_node)
    report["args"]["cpu_per_rank"] = cpu_per_rank
    runs: dict[str, list[dict]] = {rate: [] for rate in rates}
    removed = True
    for repeat in range(args.repeats):
        for rate in rates:
            with EmulatedCluster(
                nodes=args.nodes, rate=rate, latency=args.latency, cpu_per_rank=cpu_per_rank
            ) as cluster:
                measured = cluster.measure_link()
                # The cost model's rows price the rate collectives get (zppc links).
                links = cluster.measure_collectives(args.ranks_per_node)
                collective = args.link_bits_per_second = 8 * links["inter_bytes_per_second"]
                which = f" (run {repeat + 1} of {args.repeats})" if args.repeats > 1 else ""
                print(
                    f"link {rate}{which}: measured {measured / 1e6:,.1f} Mbit/s one way, "
                    f"{collective / 1e6:,.1f} Mbit/s into a node by all-gathers",
                    flush=True,
                )
                runs[rate].append(
                    {
                        "measured_bits_per_second": measured,
                        "collective_bits_per_second": collective,
                        "rows": run_rows(cluster, names, args),
                    }
                )
            removed = removed and not cluster.exists()
    report["links"] = [merge_runs(rate, runs[rate]) for rate in rates]
    report["namespaces_removed"] = removed
    print_table(report, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "bench.png")
    print(f"\nwrote {args.out / 'bench.json'} and {args.out / 'bench.png'}")
    return 0


def print_table(report: dict, args) -> None:
    print(
        f"\n{args.model}, {args.nodes} nodes x {args.ranks_per_node} ranks, batch {args.batch_size}x{args.block} per rank, "
        f"{args.steps} timed steps after {args.warmup} warm-up, lowering={args.lowering} "
        "(a row named NAME@LOWERING runs its own)"
        + (f"; each row its median of {args.repeats} runs" if args.repeats > 1 else "")
        + "\n"
    )
    for link in report["links"]:
        rows = {r["config"]: r for r in link["rows"] if r["status"] == "ok"}
        collective = link.get("collective_bits_per_second")
        by_gathers = f"; {collective / 1e6:,.1f} by all-gathers" if collective else ""
        print(
            f"### inter-node link {link['rate']} (measured {link['measured_bits_per_second'] / 1e6:,.1f} Mbit/s"
            f"{by_gathers})\n"
        )
        print(
            "| configuration | step (s) | tokens/s | vs FSDP2 | vs zppc zero3 | wire MB/step | ledger MB/step "
            "| ledger / wire | peak RSS MiB/rank | final loss |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in link["rows"]:
            if r["status"] != "ok":
                print(f"| {r['config']} | {r['status']} |||||||||")
                continue
            steps = r["timed_steps"]

            ratios = {
                base: f"{r['tokens_per_second'] / rows[base]['tokens_per_second']:.2f}x"
                if base in rows
                else "-"
                for base in ("torch-fsdp2", "zppc-zero3")
            }
            wire = r["wire_bytes"] / steps / 1e6
            ledger = r["ledger_inter_node_bytes"]
            ledger_text = f"{ledger / steps / 1e6:,.2f}" if ledger is not None else "-"
            ledger_ratio = (
                f"{ledger / r['wire_bytes']:.2f}" if ledger is not None and r["wire_bytes"] else "-"
            )
            print(
                f"| {r['config']} | {r['median_step_seconds']:.3f} | {r['tokens_per_second']:,.0f} | {ratios['torch-fsdp2']} "
                f"| {ratios['zppc-zero3']} | {wire:,.2f} | {ledger_text} | {ledger_ratio} "
                f"| {r['peak_rss_bytes_per_rank'] / 2**20:,.0f} | {r['final_loss']:.4f} |"
            )
        print()
    print_overlap(report)


def print_overlap(report: dict) -> None:
    """How much communication each configuration hid behind compute, per link:
    (compute + communication - step) / min(compute, communication), with
    compute = the same configuration's step on the fastest link of this run
    (its communication is smallest there; an upper bound on compute-only) and
    communication = its wire bytes per node and step over the measured link
    rate (the time the link alone needs); and step / max(compute,
    communication), the bound the overlap issue states. With repeated runs
    the row's figures are medians, and each run's own hidden share and step /
    max (its step against the fastest link's step in the same run) follow.

    Where the rows also ran at --comm-batch-size, a second table takes
    communication as measured alone instead: that run's step on this link
    less its step on the fastest. The link time is what a one-way stream
    gets from the link; gloo's collectives, data both ways and each waiting
    for its peers, take longer, and that is what compute has to hide."""
    if len(report["links"]) < 2:
        return
    fastest = max(report["links"], key=lambda link: link["measured_bits_per_second"])
    nodes = int(report["args"]["nodes"])

    def link_time(row: dict, link: dict, _base: dict) -> float:
        return row["wire_bytes"] / row["timed_steps"] / nodes * 8 / link["measured_bits_per_second"]

    def measured_alone(row: dict, _link: dict, base: dict) -> float | None:
        slow, fast = row.get("comm_only_step_seconds"), base.get("comm_only_step_seconds")
        return slow - fast if slow is not None and fast is not None else None

    print(f"### communication hidden behind compute (compute: step at {fastest['rate']})\n")
    overlap_table(report, fastest, "link time (s)", link_time)
    if any("comm_only_step_seconds" in r for link in report["links"] for r in link["rows"]):
        batch = report["args"].get("comm_batch_size")
        print(
            f"### the same, communication measured alone (step at batch {batch} on the link "
            f"less at {fastest['rate']})\n"
        )
        overlap_table(report, fastest, "communication alone (s)", measured_alone)


def overlap_table(report: dict, fastest: dict, heading: str, comm_time) -> None:
    """One overlap table, `comm_time(row or run, its link, the fastest link's
    row or run)` the communication it sets against compute (None: not
    known)."""
    compute = {r["config"]: r for r in fastest["rows"] if r["status"] == "ok"}
    print(
        f"| link | configuration | step (s) | compute (s) | {heading} | step / max | hidden | each run |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for link in report["links"]:
        if link is fastest:
            continue
        for r in link["rows"]:
            base = compute.get(r["config"])
            if r["status"] != "ok" or base is None:
                continue
            step, busy = r["median_step_seconds"], base["median_step_seconds"]
            comm = comm_time(r, link, base)
            if comm is None:
                continue
            each = []
            for run, base_run in zip(r.get("runs", []), base.get("runs", []), strict=True):
                run_comm = comm_time({**r, **run}, run, base_run)
                if run["status"] == base_run["status"] == "ok" and run_comm is not None:
                    each.append(
                        run_overlap(
                            run["median_step_seconds"], base_run["median_step_seconds"], run_comm
                        )
                    )
            print(
                f"| {link['rate']} | {r['config']} | {step:.3f} | {busy:.3f} | {comm:.3f} "
                f"| {step / max(busy, comm):.2f} | {hidden_share(step, busy, comm):.0%} | {', '.join(each)} |"
            )
    print()


def run_overlap(step: float, compute: float, comm: float) -> str:
    """One run's hidden share and step / max(compute, communication)."""
    return f"{hidden_share(step, compute, comm):.0%} ({step / max(compute, comm):.2f})"


def hidden_share(step: float, compute: float, comm: float) -> float:
    """The share of the smaller of compute and communication a step hid."""
    return (compute + comm - step) / min(compute, comm) if min(compute, comm) > 0 else 0.0


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = report["links"]
    names = [r["config"] for r in links[0]["rows"] if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names)), 4))
    width = 0.8 / max(1, len(links))
    for i, link in enumerate(links):
        by_name = {r["config"]: r for r in link["rows"] if r["status"] == "ok"}
        values = [by_name[n]["tokens_per_second"] if n in by_name else 0 for n in names]
        ax.bar(
            [j + i * width for j in range(len(names))],
            values,
            width,
            label=f"inter-node {link['rate']}",
        )
    ax.set_xticks(
        [j + width * (len(links) - 1) / 2 for j in range(len(names))],
        names,
        rotation=30,
        ha="right",
    )
    ax.set_ylabel("tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
