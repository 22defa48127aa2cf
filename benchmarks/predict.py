"""`zppc schedule`'s predicted step times beside an emulated-cluster run's.

    python benchmarks/predict.py benchmarks/results/bench_zeropp_deepspeed.json

For every zppc row of the run (benchmarks/run.py's bench.json) it plans the
same model, world, topology and configuration with the cost model read as
the cluster is built: the measured inter-node rate is the node's one link
(`--inter-link node`), gloo's algorithms (`--backend gloo`), and a compute
rate calibrated once, from one row (default: zppc-zero3 on the fastest link):
its FLOPs per step over its measured step minus its predicted link time. The
other rows are predictions. Prints a markdown table with the errors.
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

from worker import CONFIGS  # noqa: E402

# Config fields `zppc schedule` takes as flags.
_FLAGS = {
    "strategy": "--strategy",
    "qwz": "--qwz",
    "qgz": "--qgz",
    "osp": "--osp",
}


def schedule_flags(config: str) -> list[str] | None:
    """The `zppc schedule` flags of a benchmark configuration (None: not a
    zppc row, or one the plan cannot express)."""
    kind, fields = CONFIGS[config]
    if kind != "zppc":
        return None
    flags = []
    for key, value in fields.items():
        if key == "hpz":
            flags += ["--hpz"] if value else []
        elif key == "keep_gathered_bytes":
            flags += ["--keep-gathered-mb", str(value / 2**20)]
        elif key in _FLAGS:
            flags += [_FLAGS[key], str(value)]
        else:
            return None
    return flags


def plan(run_args: dict, config: str, inter_bits: float, tflops: float) -> dict:
    """The plan's totals for one row (each rank's view is the same here: rank 0)."""
    from zppc.cli import main

    nodes, per_node = int(run_args["nodes"]), int(run_args["ranks_per_node"])
    batch, block = int(run_args["batch_size"]), int(run_args["block"])
    flags = ["schedule", run_args["model"], "--world-size", str(nodes * per_node)]
    flags += ["--node-size", str(per_node), "--seq", str(block)]
    flags += ["--tokens-per-rank", str(batch * block), "--format", "json"]
    flags += ["--inter-bw", f"{inter_bits:.0f}bit/s", "--inter-link", "node", "--backend", "gloo"]
    # Ranks of a node share its loopback: effectively free next to the shaped link.
    flags += ["--intra-bw", "10GB/s", "--latency", "0", "--tflops", f"{tflops:.6g}"]
    if run_args.get("bucket_mb", "None") != "None":
        flags += ["--bucket-mb", run_args["bucket_mb"]]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        with contextlib.redirect_stdout(io.StringIO()):
            main([*flags, *schedule_flags(config), "-o", str(out)])
        return json.loads(out.read_text())["totals"]


def predictions(report: dict, calibrate: str = "zppc-zero3") -> tuple[dict, list[dict]]:
    """(the calibration, one row per zppc configuration and link: measured
    and predicted step seconds)."""
    run_args = report["args"]
    links = sorted(report["links"], key=lambda link: -link["measured_bits_per_second"])
    rows = [
        (link, row)
        for link in links
        for row in link["rows"]
        if row.get("status") == "ok" and schedule_flags(row["config"]) is not None
    ]
    # Calibration: the chosen row on the fastest link. Its plan at any rate
    # gives its FLOPs and link time; compute = measured step - link time.
    fastest = links[0]
    measured = next(r for link, r in rows if link is fastest and r["config"] == calibrate)
    probe = plan(run_args, calibrate, fastest["measured_bits_per_second"], 1.0)
    compute = measured["median_step_seconds"] - probe["communication_seconds"]
    calibration = {
        "config": calibrate,
        "link": fastest["rate"],
        "flops": probe["flops"],
        "step_seconds": measured["median_step_seconds"],
        "link_seconds": probe["communication_seconds"],
        "tflops": probe["flops"] / compute / 1e12,
    }
    table = []
    for link, row in rows:
        totals = plan(
            run_args, row["config"], link["measured_bits_per_second"], calibration["tflops"]
        )
        table.append(
            {
                "link": link["rate"],
                "measured_bits_per_second": link["measured_bits_per_second"],
                "config": row["config"],
                "calibration": link is fastest and row["config"] == calibrate,
                "measured_seconds": row["median_step_seconds"],
                "predicted_seconds": totals["step_seconds"],
            }
        )
    return calibration, table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench", type=Path, help="a bench.json of benchmarks/run.py")
    p.add_argument("--calibrate", default="zppc-zero3", help="the row the compute rate comes from")
    args = p.parse_args(argv)
    calibration, table = predictions(json.loads(args.bench.read_text()), args.calibrate)
    c = calibration
    print(
        f"compute rate {c['tflops'] * 1e3:.2f} GFLOP/s, calibrated on {c['config']} at "
        f"{c['link']}: {c['flops'] / 1e9:.2f} GFLOP a step in {c['step_seconds']:.3f} s "
        f"measured - {c['link_seconds']:.3f} s predicted link time\n"
    )
    print("| link (measured) | configuration | measured step (s) | predicted step (s) | error |")
    print("|---|---|---:|---:|---:|")
    for r in table:
        error = r["predicted_seconds"] / r["measured_seconds"] - 1
        print(
            f"| {r['link']} ({r['measured_bits_per_second'] / 1e6:.1f} Mbit/s) | {r['config']}"
            f"{' (calibration)' if r['calibration'] else ''} | {r['measured_seconds']:.3f} | "
            f"{r['predicted_seconds']:.3f} | {error:+.0%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
