"""`zppc schedule`'s predicted step times beside an emulated-cluster run's.

    python benchmarks/predict.py benchmarks/results/bench_zeropp_deepspeed.json

For every zppc row of the run (benchmarks/run.py's bench.json) it plans the
same model, world, topology and configuration with the cost model read as
the cluster is built: the measured inter-node rate (the all-gathers' rate
`zppc links` measured, where the run recorded one: runs since the
thirty-fifth; else the one-way stream's) is the node's one link
(`--inter-link node`), gloo's algorithms (`--backend gloo`), the graph the
eager lowering runs on CPU (`--kernels torch`: quantization as the torch
reference's aten ops), and each op charged the longer of its FLOPs and its
bytes at this machine's measured one-thread rates (benchmarks/machine.py; the
run's own record, else --rates). The ranks share the cores, so both rates are
scaled by one factor, calibrated once, from one row (default: zppc-zero3 on
the fastest link): the factor at which that row's predicted step equals its
measured one (`solve_slowdown`). The other rows are predictions. Prints a
markdown table with the errors.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# Measured with benchmarks/machine.py on this kind of machine (2 cores), for
# runs recorded before bench.json carried its own.
RECORDED_RATES = HERE / "results" / "machine_rates.json"

from worker import config_entry  # noqa: E402

_RATES = ("flops_per_second", "memory_bytes_per_second")

# Config fields `zppc schedule` takes as flags.
_FLAGS = {
    "strategy": "--strategy",
    "qwz": "--qwz",
    "qgz": "--qgz",
    "osp": "--osp",
    "reduce_scatter": "--reduce-scatter",
    "prefetch": "--prefetch",
}


def schedule_flags(config: str) -> list[str] | None:
    """The `zppc schedule` flags of a benchmark configuration (None: not a
    zppc row, or one the plan cannot express)."""
    kind, fields = config_entry(config)
    if kind != "zppc":
        return None
    flags = []
    for key, value in fields.items():
        if key == "hpz":
            flags += ["--hpz"] if value else []
        elif key == "lowering":
            if value != "eager":
                return None  # Inductor fuses what the eager compute model counts op by op
        elif key == "cost_model":
            flags += ["--overlap", "cost"]
        elif key == "keep_gathered_bytes":
            flags += ["--keep-gathered-mb", str(value / 2**20)]
        elif key == "bucket_bytes":  # a row's own cap (`NAME:2mib`), after the run's
            flags += ["--bucket-mb", str(value / 2**20)]
        elif key == "keep_last_block":
            flags += [] if value else ["--no-keep-last-block"]
        elif key == "edge_buckets":
            flags += [] if value else ["--no-edge-buckets"]
        elif key in _FLAGS:
            flags += [_FLAGS[key], str(value)]
        else:
            return None
    return flags


def auto_before_two_hops(nodes: int, per_node: int) -> str:
    """What `Config.reduce_scatter="auto"` ran on gloo before reductions went
    in two hops: the direct exchange where it brought no more bytes into a
    node than gloo's all-reduce ring (D (W - D) against 2 (W - 1) chunks)."""
    world = nodes * per_node
    return "all_to_all" if per_node * (world - per_node) <= 2 * (world - 1) else "native"


def _last_value(flags: list[str], flag: str) -> str | None:
    """The value of `flag`'s last occurrence (argparse's choice), or None."""
    at = [i for i, f in enumerate(flags) if f == flag]
    return flags[at[-1] + 1] if at else None


def keep_budget_of_one_bucket(flags: list[str], model: str) -> list[str]:
    """Flags that make zero3's `Config.keep_last_block` keep what it kept
    before its budget grew to `prefetch + 1` buckets: one repeated block's
    gathered bytes, no more than one bucket. Only a cap below the block
    differs; there the old budget is given as `keep_gathered_bytes`."""
    import torch

    from zppc.config import repeated_block_bytes
    from zppc.models import GPT, PRESETS

    strategy = _last_value(flags, "--strategy") or "zero3"
    bucket_mb = _last_value(flags, "--bucket-mb")
    if strategy != "zero3" or "--no-keep-last-block" in flags or bucket_mb is None:
        return []
    cap = float(bucket_mb) * 2**20
    with torch.device("meta"):
        block = repeated_block_bytes(GPT(PRESETS[model]))
    if cap >= block:
        return []
    budget = max(cap / 2**20, float(_last_value(flags, "--keep-gathered-mb") or 0))
    return ["--no-keep-last-block", "--keep-gathered-mb", str(budget)]


def plan(run_args: dict, config: str, inter_bits: float, rates: dict) -> dict:
    """The plan's totals for one row (each rank's view is the same here: rank 0)."""
    from zppc.cli import main

    nodes, per_node = int(run_args["nodes"]), int(run_args["ranks_per_node"])
    batch, block = int(run_args["batch_size"]), int(run_args["block"])
    flags = ["schedule", run_args["model"], "--world-size", str(nodes * per_node)]
    flags += ["--node-size", str(per_node), "--seq", str(block)]
    flags += ["--tokens-per-rank", str(batch * block), "--format", "json"]
    flags += ["--inter-bw", f"{inter_bits:.0f}bit/s", "--inter-link", "node", "--backend", "gloo"]
    # Ranks of a node share its loopback: effectively free next to the shaped link.
    flags += ["--intra-bw", "10GB/s", "--latency", "0", "--kernels", "torch"]
    flags += ["--tflops", f"{rates['flops_per_second'] / 1e12:.6g}"]
    flags += ["--memory-bw", f"{rates['memory_bytes_per_second']:.6g}B/s"]
    # Runs recorded before run.py had --reduce-scatter ran gloo's own.
    reduce_scatter = run_args.get("reduce_scatter", "native")
    if reduce_scatter == "auto" and run_args.get("reduce_scatter_auto") != "two_hop":
        reduce_scatter = auto_before_two_hops(nodes, per_node)
    flags += ["--reduce-scatter", reduce_scatter]
    if run_args.get("bucket_mb", "None") != "None":
        flags += ["--bucket-mb", run_args["bucket_mb"]]
    elif run_args.get("bucket_default") != "block":
        flags += ["--bucket-mb", "25"]  # the default before it followed the model's block
    if run_args.get("zero3_default_keeps") != "last_block":
        flags += ["--no-keep-last-block"]  # what zero3 ran before Config.keep_last_block
    if run_args.get("edge_buckets") != "on":
        flags += ["--no-edge-buckets"]  # what every row ran before Config.edge_buckets
    flags += schedule_flags(config)
    if run_args.get("zero3_keep_budget") != "prefetch_buckets":
        flags += keep_budget_of_one_bucket(flags, run_args["model"])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        with contextlib.redirect_stdout(io.StringIO()):
            main([*flags, "-o", str(out)])
        return json.loads(out.read_text())["totals"]


def predictions(
    report: dict, calibrate: str = "zppc-zero3", rates: dict | None = None
) -> tuple[dict, list[dict]]:
    """(the calibration, one row per zppc configuration and link: measured
    and predicted step seconds). `rates`: one thread's (benchmarks/machine.py),
    default the run's record, else the recorded file."""
    run_args = report["args"]
    if run_args.get("lowering", "eager") != "eager":
        raise SystemExit(
            "predict.py plans the graph the eager lowering runs op by op; an inductor run "
            "fuses those ops, which the plan does not model"
        )
    rates = rates or report.get("machine_rates") or json.loads(RECORDED_RATES.read_text())
    links = sorted(report["links"], key=lambda link: -link["measured_bits_per_second"])
    rows = [
        (link, row)
        for link in links
        for row in link["rows"]
        if row.get("status") == "ok" and schedule_flags(row["config"]) is not None
    ]
    # Calibration: the chosen row on the fastest link. Its plan at one
    # thread's rates gives its compute and link time; the cluster computes
    # the measured step minus that link time.
    fastest = links[0]
    measured = next(r for link, r in rows if link is fastest and r["config"] == calibrate)
    bits = link_bits(fastest)
    probe = plan(run_args, calibrate, bits, rates)
    slowdown = solve_slowdown(
        lambda s: plan(run_args, calibrate, bits, _scaled(rates, s))["step_seconds"],
        measured["median_step_seconds"],
        probe,
    )
    cluster_rates = _scaled(rates, slowdown)
    calibration = {
        "config": calibrate,
        "link": fastest["rate"],
        "flops": probe["flops"],
        "step_seconds": measured["median_step_seconds"],
        "link_seconds": probe["communication_seconds"],
        "one_thread_compute_seconds": probe["compute_seconds"],
        "slowdown": slowdown,
        "one_thread_rates": {key: rates[key] for key in _RATES},
        **cluster_rates,
    }
    table = []
    for link, row in rows:
        totals = plan(run_args, row["config"], link_bits(link), cluster_rates)
        table.append(
            {
                "link": link["rate"],
                "measured_bits_per_second": link_bits(link),
                "priced": "all-gathers" if "collective_bits_per_second" in link else "one-way",
                "config": row["config"],
                "calibration": link is fastest and row["config"] == calibrate,
                "measured_seconds": row["median_step_seconds"],
                "predicted_seconds": totals["step_seconds"],
            }
        )
    return calibration, table


def link_bits(link: dict) -> float:
    """The rate a link's plan prices: the all-gathers' where the run measured
    it, else the one-way stream's."""
    return link.get("collective_bits_per_second", link["measured_bits_per_second"])


def _scaled(rates: dict, slowdown: float) -> dict:
    return {key: rates[key] / slowdown for key in _RATES}


def solve_slowdown(step_at, measured: float, probe: dict, tolerance: float = 1e-3) -> float:
    """The factor by which a rank computes slower than one thread, at which the
    plan's step (`step_at(factor)`, growing with it) equals the measured step.
    It starts from the serial reading (the measured step minus the plan's
    link time, over its one-thread compute time), which the link time the
    plan hides makes too small, and takes secant steps."""
    a = (measured - probe["communication_seconds"]) / probe["compute_seconds"]
    fa = step_at(a) - measured
    b = a - fa / probe["compute_seconds"]  # the step grows by at most the compute
    for _ in range(8):
        if abs(fa) <= tolerance * measured:
            return a
        fb = step_at(b) - measured
        if fb == fa:
            return b
        a, fa, b = b, fb, b - fb * (b - a) / (fb - fa)
    raise SystemExit(f"predict.py: no slowdown reproduces the calibration row's {measured:.3f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench", type=Path, help="a bench.json of benchmarks/run.py")
    p.add_argument("--calibrate", default="zppc-zero3", help="the row the slowdown comes from")
    p.add_argument(
        "--rates",
        type=Path,
        default=None,
        help="one thread's rates (benchmarks/machine.py -o FILE) when the run has no record "
        f"of its own (default: {RECORDED_RATES.relative_to(HERE.parent)})",
    )
    args = p.parse_args(argv)
    rates = json.loads(args.rates.read_text()) if args.rates else None
    calibration, table = predictions(json.loads(args.bench.read_text()), args.calibrate, rates)
    c, one = calibration, calibration["one_thread_rates"]
    print(
        f"one thread: {one['flops_per_second'] / 1e9:.1f} GFLOP/s, "
        f"{one['memory_bytes_per_second'] / 1e9:.2f} GB/s elementwise; both / {c['slowdown']:.2f}, "
        f"calibrated on {c['config']} at {c['link']}: at {c['slowdown']:.2f} x the plan's "
        f"{c['one_thread_compute_seconds']:.3f} s of compute at one thread's rates "
        f"({c['flops'] / 1e9:.2f} GFLOP a step) and {c['link_seconds']:.3f} s of link time, "
        f"its predicted step is the {c['step_seconds']:.3f} s measured\n"
    )
    print("| link (measured) | configuration | measured step (s) | predicted step (s) | error |")
    print("|---|---|---:|---:|---:|")
    for r in table:
        error = r["predicted_seconds"] / r["measured_seconds"] - 1
        print(
            f"| {r['link']} ({r['measured_bits_per_second'] / 1e6:.1f} Mbit/s {r['priced']}) | {r['config']}"
            f"{' (calibration)' if r['calibration'] else ''} | {r['measured_seconds']:.3f} | "
            f"{r['predicted_seconds']:.3f} | {error:+.0%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
