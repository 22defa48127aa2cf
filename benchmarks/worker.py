"""One benchmark configuration, run on every rank by torchrun (see run.py).

Rank 0 writes a JSON result: median step time after warm-up, tokens/s, peak
resident memory per rank, final loss, the bytes that left every node over its
shaped link during the training loop (read from the link's own counters by
each node's local rank 0), and zppc's ledger totals over the same loop, summed
over ranks (zppc configurations only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
from cluster import join_cpu_share

# Printed by every rank after its first step: benchmarks/run.py retries a run
# whose log lacks it (a start-up failure), never one that trained and failed.
FIRST_STEP_DONE = "worker: first step done"

# name -> (builder kind, zppc Config fields or None)
CONFIGS: dict[str, tuple[str, dict | None]] = {
    "torch-ddp": ("torch-ddp", None),
    "torch-fsdp2": ("torch-fsdp2", None),
    "deepspeed-zero3": ("deepspeed", {"hpz": False}),
    "deepspeed-zero3-hpz": ("deepspeed", {"hpz": True}),
    "deepspeed-zero3-qwz-qgz": ("deepspeed", {"hpz": True, "quantized": True}),
    "zppc-ddp": ("zppc", {"strategy": "ddp"}),
    "zppc-zero3": ("zppc", {"strategy": "zero3"}),
    # gloo's own reduce-scatter (an all-reduce underneath) instead of the
    # two hops (inside the node, then across) Config.reduce_scatter="auto"
    # picks on 2 x 2.
    "zppc-zero3-native-rs": ("zppc", {"strategy": "zero3", "reduce_scatter": "native"}),
    # The direct exchange: an all-to-all of the rank-major slices and a local
    # sum ("auto" on 2 x 2 before the two hops).
    "zppc-zero3-direct-rs": ("zppc", {"strategy": "zero3", "reduce_scatter": "all_to_all"}),
    # The overlap pass off: every collective waited right after its issue.
    "zppc-zero3-serial": ("zppc", {"strategy": "zero3", "disable_passes": ("overlap",)}),
    # Gradient reductions on the same gloo group as the gathers (the
    # reduction_groups pass off): a gather issued behind a reduction waits for it.
    "zppc-zero3-one-group": (
        "zppc",
        {"strategy": "zero3", "disable_passes": ("reduction_groups",)},
    ),
    # One gloo group for all gathers and one for all reductions (the lanes pass
    # off): on a plain gloo group (one rank per node, one node) each collective
    # is waited before the next on its group is issued.
    "zppc-zero3-one-lane": ("zppc", {"strategy": "zero3", "disable_passes": ("lanes",)}),
    "zppc-zero3-prefetch2-one-lane": (
        "zppc",
        {"strategy": "zero3", "prefetch": 2, "disable_passes": ("lanes",)},
    ),
    # World all-gathers as gloo's ring (the gather_hops pass off) instead of
    # two hops, across the nodes then inside them.
    "zppc-zero3-ring-gather": ("zppc", {"strategy": "zero3", "disable_passes": ("gather_hops",)}),
    # The weights the forward reads last re-gathered in backward
    # (Config.keep_last_block off): the backward starts on a gather.
    "zppc-zero3-regather-last": ("zppc", {"strategy": "zero3", "keep_last_block": False}),
    # zero3 as before Config.edge_buckets: a graph's first gathers and last
    # reductions bucketed like the rest (whole blocks).
    "zppc-zero3-no-edge": ("zppc", {"strategy": "zero3", "edge_buckets": False}),
    # Weights kept gathered from forward to backward (what DeepSpeed's
    # prefetcher does for a model this small; FSDP2's reshard_after_forward=False).
    "zppc-zero3-keep": ("zppc", {"strategy": "zero3", "keep_gathered_bytes": 2**30}),
    # gpt-small: its last block whole and the tied embedding the head reads
    # after it (3.41 MB gathered) kept; the default one-block budget leaves the
    # block's attention input projection (0.79 MB) as the backward's first
    # gather, which takes a prefetch slot.
    "zppc-zero3-keep-block": ("zppc", {"strategy": "zero3", "keep_gathered_bytes": 3_500_000}),
    # Gathers issued as late as the cost model (the cluster's measured link
    # and compute rates) says still hides them, up to two buckets ahead.
    "zppc-zero3-cost": ("zppc", {"strategy": "zero3", "prefetch": 2, "cost_model": "cluster"}),
    "zppc-zero3-prefetch2": ("zppc", {"strategy": "zero3", "prefetch": 2}),
    # The same planning with the rates zppc.measure.measure_cost_model takes
    # inside the job (the ranks' compute measured together, no calibration).
    "zppc-zero3-measured": ("zppc", {"strategy": "zero3", "prefetch": 2, "cost_model": "measured"}),
    "zppc-zero3-qwz-int8": ("zppc", {"strategy": "zero3", "qwz": "int8"}),
    "zppc-zero3-qwz-int4": ("zppc", {"strategy": "zero3", "qwz": "int4"}),
    "zppc-zero3-hpz": ("zppc", {"strategy": "zero3", "hpz": True}),
    "zppc-zero3-qwz-int8-hpz": ("zppc", {"strategy": "zero3", "qwz": "int8", "hpz": True}),
    # The same, kept gathered from forward to backward: like for like with
    # DeepSpeed's ZeRO-3 (+ hpZ), whose prefetcher keeps a model this small.
    "zppc-zero3-qwz-int8-hpz-keep": (
        "zppc",
        {"strategy": "zero3", "qwz": "int8", "hpz": True, "keep_gathered_bytes": 2**30},
    ),
    "zppc-zero3-qgz": ("zppc", {"strategy": "zero3", "qgz": "int4"}),
    "zppc-zero++": ("zppc", {"strategy": "zero3", "qwz": "int8", "hpz": True, "qgz": "int4"}),
    "zppc-osp": ("zppc", {"strategy": "zero3", "osp": 0.5}),
    "zppc-ddp-osp": ("zppc", {"strategy": "ddp", "osp": 0.5}),
    "zppc-rtp": ("zppc", {"strategy": "rtp"}),
}


LOWERINGS = ("eager", "inductor")


def config_entry(name: str) -> tuple[str, dict | None]:
    """A row's builder kind and zppc Config fields: a name in CONFIGS, or a zppc
    one followed by `@eager` or `@inductor`, its lowering for that row alone,
    and/or by `:<MiB>mib`, its bucket cap (`Config.bucket_bytes`) for that row
    alone, e.g. `zppc-zero3@inductor:2mib`: one run then measures lowerings and
    bucket caps side by side (otherwise `--lowering` and `--bucket-mb` decide)."""
    rest, colon, bucket = name.partition(":")
    base, at, lowering = rest.partition("@")
    kind, fields = CONFIGS[base]
    if (at or colon) and kind != "zppc":
        raise KeyError(f"{name}: only zppc rows take @lowering or :<MiB>mib")
    if at:
        if lowering not in LOWERINGS:
            raise KeyError(f"{name}: the lowering is one of @{'/@'.join(LOWERINGS)}")
        fields = {**fields, "lowering": lowering}
    if colon:
        mib = bucket.removesuffix("mib")
        try:
            bucket_bytes = int(float(mib) * 2**20) if bucket.endswith("mib") else 0
        except (ValueError, OverflowError):  # not a number, or inf
            bucket_bytes = 0
        if bucket_bytes <= 0:
            raise KeyError(f"{name}: the bucket cap is :<MiB>mib, e.g. :2mib")
        fields = {**fields, "bucket_bytes": bucket_bytes}
    return kind, fields


def config_name(name: str) -> str:
    """`--config`'s argparse type: a name `config_entry` knows."""
    try:
        config_entry(name)
    except KeyError as exc:
        raise argparse.ArgumentTypeError(f"unknown configuration {exc}") from None
    return name


def why_not_runnable(name: str) -> str | None:
    """None if `name` can run here, else the reason (checked before launching)."""
    kind, fields = config_entry(name)
    if kind == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return "deepspeed is not installed (pip install deepspeed with DS_BUILD_OPS=0)"
        if fields.get("quantized") and not torch.cuda.is_available():
            return "DeepSpeed's qwZ/qgZ need its CUDA kernels"
    if kind == "zppc":
        import zppc

        try:
            zppc.Config(**{k: v for k, v in fields.items() if k != "cost_model"})
        except NotImplementedError as exc:
            return str(exc)
    return None


def link_tx_bytes() -> int:
    """Bytes sent so far on this node's shaped link (0 outside the emulated cluster)."""
    link = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        with open(f"/sys/class/net/{link}/statistics/tx_bytes") as f:
            return int(f.read())
    except (OSError, TypeError):
        return 0


def build(name: str, model, args):
    """The step function and optimizer of one configuration."""
    kind, fields = config_entry(name)
    if kind == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel

        step = DistributedDataParallel(model)
        return step, torch.optim.AdamW(model.parameters(), lr=args.lr)
    if kind == "torch-fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=args.lr)
    if kind == "deepspeed":
        import deepspeed

        ds_config = {
            "train_micro_batch_size_per_gpu": args.batch_size,
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
            "zero_optimization": {"stage": 3},
        }
        if fields.get("hpz"):
            ds_config["zero_optimization"]["zero_hpz_partition_size"] = int(
                os.environ["LOCAL_WORLD_SIZE"]
            )
        if fields.get("quantized"):
            ds_config["zero_optimization"].update(
                zero_quantized_weights=True, zero_quantized_gradients=True
            )
        engine, opt, _, _ = deepspeed.initialize(model=model, config=ds_config)
        return engine, opt
    import zppc

    if args.bucket_mb is not None and "bucket_bytes" not in fields:
        fields = {**fields, "bucket_bytes": int(args.bucket_mb * 2**20)}
    fields = {"reduce_scatter": args.reduce_scatter, **fields}
    node_size = getattr(args, "node_size", None) or int(os.environ["LOCAL_WORLD_SIZE"])
    if fields.get("cost_model") == "cluster":
        fields["cost_model"] = cluster_cost_model(args)
    elif fields.get("cost_model") == "measured":
        from zppc.measure import measure_cost_model

        # The emulated nodes' ranks share one link.
        fields["cost_model"] = measure_cost_model(node_size=node_size, inter_per_node=True)
    config = zppc.Config(**{"lowering": args.lowering, **fields}, node_size=node_size)
    zppc.distribute(model, config)
    return torch.compile(model, backend="zppc"), torch.optim.AdamW(model.parameters(), lr=args.lr)


def cluster_cost_model(args):
    """The emulated cluster as benchmarks/predict.py reads it: the node's one
    shaped link at the rate all-gathers get on it (run.py measures it with
    `zppc links`; older runs passed a one-way stream's), gloo's algorithms, loopback within a
    node (free next to it), and a rank's share of the cores."""
    from zppc.cost import Compute, CostModel, Links

    links = Links(10e9, args.link_bits_per_second / 8, 0.0, inter_per_node=True, gloo=True)
    return CostModel(links, Compute(args.flops_per_second, args.memory_bytes_per_second))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True, type=config_name)
    p.add_argument("--preset", default="gpt-small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lowering", default="eager")
    p.add_argument("--bucket-mb", type=float, default=None)
    p.add_argument("--reduce-scatter", default="auto")
    p.add_argument("--link-bits-per-second", type=float, default=None)
    p.add_argument("--flops-per-second", type=float, default=None)
    p.add_argument("--memory-bytes-per-second", type=float, default=None)
    p.add_argument("--result", required=True)
    args = p.parse_args()
    join_cpu_share()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    import zppc
    from zppc.data import random_windows, stdlib_corpus
    from zppc.distribute import state_of
    from zppc.models import GPT, PRESETS

    torch.manual_seed(0)
    model = GPT(PRESETS[args.preset])
    step, opt = build(args.config, model, args)
    kind = config_entry(args.config)[0]
    batches = random_windows(stdlib_corpus(4 << 20), args.batch_size, args.block, seed=1000 + rank)
    times, loss, wire_start = [], None, 0
    for i in range(args.warmup + args.steps):
        x, y = next(batches)
        dist.barrier()
        if i == args.warmup:  # count the timed steps' bytes only, like their time
            wire_start = link_tx_bytes()
            zppc.reset_comm_stats()
        start = time.perf_counter()
        loss = step(x, y)
        if kind == "deepspeed":
            step.backward(loss)
            step.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        if i == 0:  # run.py retries a run that dies before this line, once
            print(f"{FIRST_STEP_DONE} (rank {rank})", flush=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    stats = zppc.comm_stats()
    dist.barrier()
    wire = link_tx_bytes() - wire_start if int(os.environ["LOCAL_RANK"]) == 0 else 0
    summary = torch.tensor(
        [
            loss.item(),
            stats.inter_node_bytes,
            stats.intra_node_bytes,
            statistics.median(times),
            wire,
        ],
        dtype=torch.float64,
    )
    everyone = [torch.zeros_like(summary) for _ in range(world)]
    dist.all_gather(everyone, summary)
    peak_rss = [None] * world
    dist.all_gather_object(peak_rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if rank == 0:
        table = torch.stack(everyone)
        median_step = table[:, 3].max().item()  # the slowest rank sets the pace
        result = {
            "config": args.config,
            "median_step_seconds": median_step,
            "tokens_per_second": args.batch_size * args.block * world / median_step,
            "final_loss": table[:, 0].mean().item(),
            "ledger_inter_node_bytes": int(table[:, 1].sum().item()) if kind == "zppc" else None,
            "ledger_intra_node_bytes": int(table[:, 2].sum().item()) if kind == "zppc" else None,
            "wire_bytes": int(table[:, 4].sum().item()),
            "peak_rss_bytes_per_rank": max(peak_rss),
            "timed_steps": args.steps,
            "warmup_steps": args.warmup,
            "lowering": state_of(model).config.lowering if kind == "zppc" else None,
        }
        cost_model = state_of(model).config.cost_model if kind == "zppc" else None
        if cost_model is not None:  # the rates it planned with, measured or given
            result["cost_model"] = dataclasses.asdict(cost_model)
        with open(args.result, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
