"""zppc's `bucket` pass beside Inductor's FX bucketing, on the same graphs.

    python benchmarks/bucketing.py                      # gpt-small (4 MiB) and gpt2-124m (25 MiB)

One zero3 step is compiled on the fake process group (8 ranks, nodes of 4,
`lowering="eager"`) with the `bucket` and `overlap` passes off: those final
graphs are the unbucketed input. zppc's buckets come from compiling again with
only `overlap` off (the `bucket` pass's own wall time, from its record);
Inductor's from `bucket_all_gather` + `bucket_reduce_scatter`
(torch/_inductor/fx_passes/bucketing.py) with the same cap, then the
`stable_topological_sort` Inductor's post-grad pass runs after them (it
inserts a bucket at its last member and relies on the sort to move earlier
members' users below it). Printed per graph: collectives by op, the pass's
seconds, and for each bucket the number of matrix products issued before it
(where it lands in the compute).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
import torch.distributed as dist

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def compile_step(preset: str, cap_mb: float, disable: tuple[str, ...]):
    import zppc
    from zppc.models import GPT, PRESETS

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = zppc.Config(
        node_size=4, lowering="eager", disable_passes=disable, bucket_bytes=int(cap_mb * 2**20)
    )
    model = zppc.distribute(GPT(PRESETS[preset]), config)
    step = torch.compile(model, backend="zppc")
    tokens = torch.randint(0, 256, (2, 65))
    step(tokens[:, :-1], tokens[:, 1:]).backward()
    return zppc.inspect(step).compiles[-1]


def collectives(gm) -> list[tuple[str, int]]:
    """(op, matrix products before it) per collective issue, in graph order."""
    found, matmuls = [], 0
    for n in gm.graph.nodes:
        matmuls += n.target in MATMULS
        name = str(n.target)
        if n.op == "call_function" and "_c10d_functional" in name and "wait" not in name:
            found.append((name.split(".")[1], matmuls))
    return found


def compare(preset: str, cap_mb: float) -> None:
    from torch._inductor.fx_passes import bucketing
    from torch._inductor.pattern_matcher import stable_topological_sort

    from zppc.backend import _copy_graph_module

    unbucketed = compile_step(preset, cap_mb, ("bucket", "overlap"))
    ours = compile_step(preset, cap_mb, ("overlap",))
    print(f"\n{preset}, buckets of {cap_mb:g} MiB, 8 ranks (fake process group)")
    for kind in ("forward", "backward"):
        gm = _copy_graph_module(unbucketed.final[kind])
        start = time.perf_counter()
        bucketing.bucket_all_gather(gm, lambda _: cap_mb)
        bucketing.bucket_reduce_scatter(gm, lambda _: cap_mb)
        stable_topological_sort(gm.graph)
        gm.graph.lint()
        inductor_seconds = time.perf_counter() - start
        (record,) = [r for r in ours.passes[kind] if r.name == "bucket"]
        zppc_side, inductor_side = collectives(ours.final[kind]), collectives(gm)
        print(f"  {kind} ({len(unbucketed.final[kind].graph.nodes)} nodes unbucketed):")
        print(f"    zppc     {record.seconds:.3f} s  {dict(Counter(k for k, _ in zppc_side))}")
        print(
            f"    inductor {inductor_seconds:.3f} s  {dict(Counter(k for k, _ in inductor_side))}"
        )
        print(f"    matmuls before each bucket, zppc:     {[m for _, m in zppc_side]}")
        print(f"    matmuls before each bucket, inductor: {[m for _, m in inductor_side]}")


def main(argv: list[str] | None = None) -> int:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="gpt-small:4,gpt2-124m:25", help="PRESET:MiB,...")
    args = p.parse_args(argv)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        for case in args.cases.split(","):
            preset, cap = case.split(":")
            compare(preset, float(cap))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
