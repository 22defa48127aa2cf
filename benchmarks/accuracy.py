"""Loss curves of the small GPT trained with zero3 and with ZeRO++'s quantized
collectives, side by side.

    torchrun --nproc-per-node 4 benchmarks/accuracy.py --suite qwz --node-size 2
    torchrun --nproc-per-node 4 benchmarks/accuracy.py --suite zeropp --node-size 2 --dtype bfloat16
    torchrun --nproc-per-node 4 benchmarks/accuracy.py --suite osp --node-size 2

Every configuration of a suite trains from the same initial weights on the
same batches (byte-level Python standard library source). Writes a markdown
table to stdout, and `<suite>_accuracy[_<dtype>].json` / `.png` into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zppc
from zppc.data import random_windows, stdlib_corpus
from zppc.models import GPT, PRESETS

SUITES = {
    "qwz": {
        "zero3": {},
        "zero3 + qwz int8": {"qwz": "int8"},
        "zero3 + qwz int4": {"qwz": "int4"},
    },
    "osp": {
        "zero3": {},
        "zero3 + osp 0.5 (LGP)": {"osp": 0.5},
        "zero3 + osp 0.5, stale (no LGP)": {"osp": 0.5, "osp_lgp": False},
    },
    "zeropp": {
        "zero3": {},
        "zero3 + qgz int4": {"qgz": "int4"},
        "ZeRO++ (qwz int8 + hpz + qgz int4)": {"qwz": "int8", "hpz": True, "qgz": "int4"},
        "ZeRO++ + qgz error feedback": {
            "qwz": "int8",
            "hpz": True,
            "qgz": "int4",
            "qgz_error_feedback": True,
        },
    },
    # Which component of ZeRO++ moves the loss: each added alone, then together.
    "zeropp-parts": {
        "zero3": {},
        "zero3 + qwz int8": {"qwz": "int8"},
        "zero3 + qwz int8 + hpz": {"qwz": "int8", "hpz": True},
        "zero3 + qgz int4": {"qgz": "int4"},
        "ZeRO++ (qwz int8 + hpz + qgz int4)": {"qwz": "int8", "hpz": True, "qgz": "int4"},
        "zero3 + qwz int8, blocks of 256": {"qwz": "int8", "qwz_block": 256},
        "zero3 + qwz int8, blocks of 64": {"qwz": "int8", "qwz_block": 64},
    },
}


def train(fields, args, data, rank, world) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(args.seed)
    model = zppc.distribute(
        GPT(PRESETS[args.preset]).to(getattr(torch, args.dtype)),
        zppc.Config(node_size=args.node_size, lowering=args.lowering, **fields),
    )
    step = torch.compile(model, backend="zppc")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    batches = random_windows(data, args.batch_size, args.block, seed=1000 * (args.seed + 1) + rank)
    losses, start = [], None
    zppc.reset_comm_stats()
    for i in range(args.steps):
        if i == 1:
            start = time.perf_counter()
        loss = step(*next(batches))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach()
        dist.all_reduce(value)
        losses.append(value.item() / world)
        if rank == 0 and (i + 1) % 50 == 0:
            print(f"  step {i + 1}: loss {losses[-1]:.4f}", flush=True)
    seconds = (time.perf_counter() - start) / max(1, args.steps - 1)
    stats = zppc.comm_stats()
    return {
        "losses": [float(v) for v in losses],
        "step_seconds": seconds,
        "inter_node_bytes_per_step": stats.inter_node_bytes / args.steps,
        "total_bytes_per_step": stats.total_bytes / args.steps,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--suite", default="qwz", choices=sorted(SUITES))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--preset", default="gpt-small", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--node-size", type=int, default=None)
    p.add_argument("--lowering", default="eager", choices=["eager", "inductor"])
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="weights and batches (another seed: the run-to-run spread)",
    )
    p.add_argument(
        "--only",
        type=lambda v: sorted({int(i) for i in v.split(",")}),
        default=None,
        help="run only these rows of the suite, by position (0: zero3, the baseline)",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    torch.set_num_threads(
        max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    )
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = stdlib_corpus(8 << 20)
    results = {}
    rows = SUITES[args.suite]
    if args.only:
        rows = {k: v for i, (k, v) in enumerate(rows.items()) if i in args.only}
    for label, fields in rows.items():
        if rank == 0:
            print(f"{label}:", flush=True)
        results[label] = train(fields, args, data, rank, world)
    if rank == 0:
        report(results, args, world)
    dist.destroy_process_group()


def report(results: dict, args, world: int) -> None:
    base = results["zero3"]
    tail = max(1, args.steps // 10)

    def final(r):
        return sum(r["losses"][-tail:]) / tail

    print(
        f"\n{args.preset} in {args.dtype}, {args.steps} steps, {world} ranks, node size "
        f"{args.node_size}; final = mean of the last {tail} steps; bytes are the ledger's, "
        f"received by rank 0 per step (MB = 10^6 bytes)\n"
    )
    print("| configuration | final loss | vs zero3 | inter-node MB/step | vs zero3 | s/step |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in results.items():
        inter = r["inter_node_bytes_per_step"]
        print(
            f"| {label} | {final(r):.4f} | {final(r) / final(base) - 1:+.2%} "
            f"| {inter / 1e6:,.2f} | {inter / base['inter_node_bytes_per_step']:.3f} "
            f"| {r['step_seconds']:.3f} |"
        )
    name = f"{args.suite}_accuracy" + ("" if args.dtype == "float32" else f"_{args.dtype}")
    name += f"_seed{args.seed}" if args.seed else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=1)
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, r in results.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(f"{args.preset} in {args.dtype}: {args.suite} ({world} ranks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / f"{name}.png", dpi=120)
    print(f"\nwrote {args.out / name}.json and .png")


if __name__ == "__main__":
    main()
