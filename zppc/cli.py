"""The `zppc` command line.

    zppc schedule gpt-small --world-size 384 --node-size 16 --qwz int8

`schedule` compiles one training step of a model against a fake process group
of any size, in this one process, and prints the collectives of the step with
the bytes this rank receives and a predicted time from link bandwidths.
"""

from __future__ import annotations

import argparse
import json
import sys

BYTES_PER_GBIT = 1e9 / 8


def _schedule(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zppc
    from zppc.models import GPT, PRESETS

    if args.node_size > args.world_size:
        raise SystemExit(
            f"zppc schedule: --node-size ({args.node_size}) exceeds --world-size ({args.world_size})"
        )
    if not 0 <= args.rank < args.world_size:
        raise SystemExit(
            f"zppc schedule: --rank must be in [0, {args.world_size}), got {args.rank}"
        )
    try:
        config = zppc.Config(
            strategy=args.strategy,
            qwz=args.qwz,
            hpz=args.hpz,
            qgz=args.qgz,
            osp=args.osp,
            node_size=args.node_size,
            bucket_bytes=int(args.bucket_mb * 2**20),
            lowering="eager",
            param_dtype=getattr(torch, args.param_dtype) if args.param_dtype else None,
        )
    except (ValueError, NotImplementedError) as exc:
        raise SystemExit(f"zppc schedule: {exc}") from None
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world_size)
    try:
        cfg = PRESETS[args.model]
        with torch.device("meta"):
            model = GPT(cfg)
        try:
            zppc.distribute(model, config)  # its checks cover the topology (hpz: world % node)
        except ValueError as exc:
            raise SystemExit(f"zppc schedule: {exc}") from None
        step = torch.compile(model, backend="zppc")
        tokens = torch.randint(0, cfg.vocab_size, (1, args.seq + 1))
        step(tokens[:, :-1], tokens[:, 1:]).backward()
        schedule = zppc.inspect(step).schedule
    finally:
        dist.destroy_process_group()

    rows = []
    for c in schedule:
        seconds = c.intra_node_bytes / (args.intra_gbps * BYTES_PER_GBIT) + c.inter_node_bytes / (
            args.inter_gbps * BYTES_PER_GBIT
        )
        rows.append({**c.__dict__, "predicted_seconds": seconds})
    totals = {
        "collectives": len(rows),
        "intra_node_bytes": sum(r["intra_node_bytes"] for r in rows),
        "inter_node_bytes": sum(r["inter_node_bytes"] for r in rows),
        "predicted_seconds": sum(r["predicted_seconds"] for r in rows),
        "parameters": cfg.num_parameters,
    }
    out = sys.stdout
    if args.format == "json":
        json.dump({"config": vars(args), "collectives": rows, "totals": totals}, out, indent=1)
        out.write("\n")
    elif args.format == "chrome":
        events, clock = [], 0.0
        for r in rows:
            duration = r["predicted_seconds"] * 1e6
            events.append(
                {
                    "name": f"{r['kind']} ({r['group_size']} ranks)",
                    "ph": "X",
                    "ts": clock,
                    "dur": duration,
                    "pid": args.rank,
                    "tid": r["graph"],
                    "args": {
                        k: r[k] for k in ("intra_node_bytes", "inter_node_bytes", "bytes_per_peer")
                    },
                }
            )
            clock += duration
        json.dump({"traceEvents": events}, out)
        out.write("\n")
    else:
        features = [args.strategy]
        features += [f"qwz {args.qwz}"] if args.qwz else []
        features += ["hpz"] if args.hpz else []
        features += [f"qgz {args.qgz}"] if args.qgz else []
        print(
            f"{args.model} ({cfg.num_parameters / 1e6:,.1f}M parameters), {' + '.join(features)}, "
            f"world {args.world_size}, node {args.node_size}, rank {args.rank}; "
            f"links {args.intra_gbps:g} Gbit/s intra, {args.inter_gbps:g} Gbit/s inter"
        )
        print(
            f"{'graph':9s} {'#':>3s} {'kind':15s} {'ranks':>5s} {'per peer':>12s} {'intra':>14s} {'inter':>14s} {'ms':>9s}"
        )
        for r in rows:
            print(
                f"{r['graph']:9s} {r['index']:3d} {r['kind']:15s} {r['group_size']:5d} {r['bytes_per_peer']:12,d} "
                f"{r['intra_node_bytes']:14,d} {r['inter_node_bytes']:14,d} {r['predicted_seconds'] * 1e3:9.3f}"
            )
        print(
            f"total: {totals['collectives']} collectives, {totals['intra_node_bytes'] / 1e6:,.3f} MB intra-node, "
            f"{totals['inter_node_bytes'] / 1e6:,.3f} MB inter-node received by this rank (MB = 10^6 bytes), "
            f"{totals['predicted_seconds'] * 1e3:,.1f} ms predicted"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    from zppc.config import STRATEGIES
    from zppc.models import PRESETS

    parser = argparse.ArgumentParser(
        prog="zppc", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    s = sub.add_parser("schedule", help="the communication schedule of one training step")
    s.add_argument("model", choices=sorted(PRESETS))
    s.add_argument("--world-size", type=int, required=True)
    s.add_argument("--node-size", type=int, default=8)
    s.add_argument("--rank", type=int, default=0, help="whose view of the schedule")
    s.add_argument("--strategy", default="zero3", choices=list(STRATEGIES))
    s.add_argument("--qwz", choices=["int8", "int4"], default=None, help="quantized weight gathers")
    s.add_argument(
        "--hpz", action="store_true", help="backward gathers inside the node (secondary shard)"
    )
    s.add_argument("--qgz", choices=["int4", "int8"], default=None, help="quantized gradients")
    s.add_argument("--osp", type=float, default=None, help="fraction of gradients in stage 2")
    s.add_argument("--param-dtype", choices=["float32", "bfloat16", "float16"], default=None)
    s.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap in MiB")
    s.add_argument("--seq", type=int, default=8, help="tokens traced (bytes do not depend on it)")
    s.add_argument("--intra-gbps", type=float, default=2400.0, help="intra-node link, Gbit/s")
    s.add_argument("--inter-gbps", type=float, default=100.0, help="inter-node link, Gbit/s")
    s.add_argument("--format", choices=["table", "json", "chrome"], default="table")
    args = parser.parse_args(argv)
    if args.version:
        import zppc

        print(zppc.__version__)
        return 0
    if args.command == "schedule":
        return _schedule(args)
    parser.print_help()
    return 2
