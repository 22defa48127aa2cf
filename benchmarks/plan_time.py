"""zppc's compile time against the graph's size: GPTs of growing depth through
zppc's passes on the fake process group.

    python benchmarks/plan_time.py                         # 6, 12, 24, 48 layers
    python benchmarks/plan_time.py --layers 12,48 --features zero3

Each model is gpt2-1.5b's width (n_embd 1600, 25 heads, 50304 tokens of
vocabulary) with `--layers` blocks, planned as `zppc schedule` plans (meta
tensors, `--world-size` ranks in nodes of `--node-size`, one sequence of
1024 tokens per rank, `lowering="eager"`): one forward and backward are
compiled and nothing runs. Per depth and feature set the table gives the
nodes of the final forward and backward graphs, the wall time of all zppc's
passes on the dynamo, forward and backward graphs (each pass's own record,
lint included), that time per 1000 final nodes (flat when the passes are
linear in the graph), the slowest pass, and the whole compile (dynamo, aot_autograd and the passes).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
import torch.distributed as dist

FEATURES = {
    "zero3": {},
    "zero++": {"qwz": "int8", "hpz": True, "qgz": "int4"},
}


def plan(layers: int, features: str, world: int, node: int) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from zppc.passes import planning

    import zppc
    from zppc.models import GPT, GPTConfig

    torch._dynamo.reset()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with torch.device("meta"):
            cfg = GPTConfig(
                vocab_size=50304, block_size=1024, n_layer=layers, n_head=25, n_embd=1600
            )
            model = GPT(cfg)
            tokens = torch.randint(0, cfg.vocab_size, (1, cfg.block_size))
        config = zppc.Config(node_size=node, lowering="eager", **FEATURES[features])
        start = time.perf_counter()
        with planning():
            zppc.distribute(model, config)
            step = torch.compile(model, backend="zppc")
            step(tokens)[0].float().square().mean().backward()
        compile_seconds = time.perf_counter() - start
        passes, nodes = Counter(), 0
        for record in zppc.inspect(step).compiles:
            for records in record.passes.values():
                for r in records:
                    passes[r.name] += r.seconds
            nodes += sum(len(gm.graph.nodes) for gm in record.final.values())
    finally:
        dist.destroy_process_group()
    slowest, slowest_seconds = passes.most_common(1)[0]
    return {
        "layers": layers,
        "features": features,
        "nodes": nodes,
        "passes_seconds": sum(passes.values()),
        "slowest": f"{slowest} {slowest_seconds:.2f} s",
        "compile_seconds": compile_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="6,12,24,48")
    parser.add_argument("--features", default="zero3,zero++")
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--node-size", type=int, default=8)
    args = parser.parse_args()
    print(
        f"world {args.world_size} in nodes of {args.node_size}, gpt2-1.5b's width, "
        "one 1024-token sequence per rank, meta tensors\n"
    )
    print(
        "| features | layers | final nodes | zppc passes (s) | per 1000 nodes (ms) "
        "| slowest pass | whole compile (s) |"
    )
    print("|---|---:|---:|---:|---:|---|---:|")
    for features in args.features.split(","):
        for layers in (int(n) for n in args.layers.split(",")):
            row = plan(layers, features, args.world_size, args.node_size)
            per_thousand = 1e6 * row["passes_seconds"] / row["nodes"]
            print(
                f"| {features} | {layers} | {row['nodes']:,} | {row['passes_seconds']:.2f} "
                f"| {per_thousand:.1f} | {row['slowest']} | {row['compile_seconds']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
