"""The `zppc` command line.

    zppc schedule gpt-small --world-size 384 --node-size 16 --qwz int8

`schedule` compiles one training step of a model against a fake process group
of any size, in this one process, and prints the collectives of the step with
the bytes this rank receives and a predicted time from link bandwidths.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Iterator
from typing import TextIO

DTYPES = ["float32", "bfloat16", "float16"]


def _is_true(value: str) -> bool:
    """A boolean field's value in `--compare` (hpz=true, edge_buckets=off)."""
    return value.lower() in ("1", "true", "yes", "on")


# What `--compare` may change, and how to read its values.
_COMPARABLE = {
    "strategy": str,
    "qwz": lambda v: None if v == "none" else v,
    "qgz": lambda v: None if v == "none" else v,
    "hpz": _is_true,
    "param_dtype": lambda v: None if v == "none" else v,
    "osp": lambda v: None if v == "none" else float(v),
    "bucket_mb": lambda v: None if v == "auto" else float(v),
    "prefetch": int,
    "overlap": str,
    "keep_gathered_mb": float,
    "keep_last_block": _is_true,
    "edge_buckets": _is_true,
    "reduce_scatter": str,
}


def _compare_overrides(spec: str) -> dict:
    """ "zero3" or "zero3,qwz=int8,hpz=true" -> the fields it sets."""
    overrides = {}
    for i, part in enumerate(p for p in spec.split(",") if p):
        key, _, value = part.partition("=")
        if not value and i == 0:
            key, value = "strategy", key
        key = key.replace("-", "_")
        if key not in _COMPARABLE:
            raise SystemExit(
                f"zppc schedule: --compare cannot set {key!r}; it sets {sorted(_COMPARABLE)}"
            )
        overrides[key] = _COMPARABLE[key](value)
    if "strategy" in overrides and "hpz" not in overrides:
        overrides["hpz"] = False  # "zero3" means plain zero3, not the first config's extras
    if "strategy" in overrides:
        overrides.setdefault("keep_gathered_mb", 0.0)
    for key in ("qwz", "qgz", "osp"):
        if "strategy" in overrides:
            overrides.setdefault(key, None)
    return overrides


# Flags that refine a feature, and the feature they need.
_REFINES = {
    "qwz_block": "qwz",
    "qgz_block": "qgz",
    "qgz_intra_node": "qgz",
    "osp_split": "osp",
}


def _model_and_inputs(spec: str, seq: int | None, tokens_per_rank: int):
    """A built-in model (`zppc.models.PRESETS`) on sequences of `seq` tokens
    (default: its block size, at most `tokens_per_rank`), as many as make
    `tokens_per_rank`; or `package.module:factory`, a callable returning
    `(model, example_inputs)`. Returns the model, its inputs and the tokens
    traced (None for a factory). On meta, tracing every token costs nothing, and
    the activations' bytes are then the step's own."""
    import importlib

    import torch

    from zppc.models import GPT, PRESETS

    if spec in PRESETS:
        cfg = PRESETS[spec]
        tokens = min(seq or tokens_per_rank, cfg.block_size)
        batch = max(1, tokens_per_rank // tokens)
        inputs = (torch.randint(0, cfg.vocab_size, (batch, tokens)),)
        return GPT(cfg), inputs, batch * tokens
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(
            f"zppc schedule: unknown model {spec!r}; give one of {sorted(PRESETS)} "
            "or package.module:factory returning (model, example_inputs)"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"zppc schedule: cannot load {spec!r}: {exc}") from None
    built = factory()
    if not (isinstance(built, tuple) and len(built) == 2):
        raise SystemExit(f"zppc schedule: {spec} must return (model, example_inputs)")
    model, inputs = built
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), None


def _first_tensor(output):
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        output = list(output.values())
    for item in output:
        if isinstance(item, torch.Tensor):
            return item
    raise SystemExit("zppc schedule: the model's output holds no tensor to take a loss from")


def _settings(args: argparse.Namespace):
    """The Config, links and compute rate `args` ask for, or a SystemExit naming
    what is wrong; cheap, so every plan's settings are checked before any runs."""
    import torch

    import zppc
    from zppc.cost import Links, device_rates, parse_rate, parse_time

    if args.node_size > args.world_size:
        raise SystemExit(
            f"zppc schedule: --node-size ({args.node_size}) exceeds --world-size ({args.world_size})"
        )
    if not 0 <= args.rank < args.world_size:
        raise SystemExit(
            f"zppc schedule: --rank must be in [0, {args.world_size}), got {args.rank}"
        )
    if args.seq is not None and args.seq < 1:
        raise SystemExit(f"zppc schedule: --seq must be at least 1, got {args.seq}")
    if args.tokens_per_rank < 1:
        raise SystemExit(
            f"zppc schedule: --tokens-per-rank must be at least 1, got {args.tokens_per_rank}"
        )
    if args.jobs < 1:
        raise SystemExit(f"zppc schedule: --jobs must be at least 1, got {args.jobs}")
    for flag, needs in _REFINES.items():
        if getattr(args, flag) is not None and getattr(args, needs) is None:
            raise SystemExit(
                f"zppc schedule: --{flag.replace('_', '-')} changes nothing without --{needs}"
            )
    if args.kernels == "torch" and args.memory_bw is None:
        raise SystemExit(
            "zppc schedule: --kernels torch changes nothing without --memory-bw: the "
            "quantization ops' FLOPs are the same either way, only their bytes differ"
        )
    if args.osp_split == "magnitude":
        raise SystemExit(
            "zppc schedule: --osp-split magnitude picks stage 2 from the gradients' measured "
            "magnitudes, which a plan on meta tensors has none of; --osp-split last plans the "
            "same bytes in stage 2 (F of the gradient bytes), ordered by backward"
        )
    param_dtype = getattr(torch, args.param_dtype) if args.param_dtype else None
    reduce_dtype = getattr(torch, args.reduce_dtype) if args.reduce_dtype else None
    # Refinements the user gave; the others keep Config's defaults.
    refinements = {
        flag: getattr(args, flag) for flag in _REFINES if getattr(args, flag) is not None
    }
    if refinements.get("qgz_intra_node") == "none":
        refinements["qgz_intra_node"] = None
    try:
        config = zppc.Config(
            strategy=args.strategy,
            qwz=args.qwz,
            hpz=args.hpz,
            qgz=args.qgz,
            osp=args.osp,
            **refinements,
            node_size=args.node_size,
            bucket_bytes=None if args.bucket_mb is None else int(args.bucket_mb * 2**20),
            reduce_scatter=args.reduce_scatter,
            prefetch=1 if args.prefetch is None else args.prefetch,
            keep_gathered_bytes=int(args.keep_gathered_mb * 2**20),
            keep_last_block=args.keep_last_block,
            edge_buckets=args.edge_buckets,
            lowering="eager",
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
        )
        links = Links(
            parse_rate(args.intra_bw) if args.intra_gbps is None else args.intra_gbps * 1e9 / 8,
            parse_rate(args.inter_bw) if args.inter_gbps is None else args.inter_gbps * 1e9 / 8,
            parse_time(args.latency),
            inter_per_node=args.inter_link == "node",
            gloo=args.backend == "gloo",
        )
        half = param_dtype in (torch.bfloat16, torch.float16)
        memory = (
            args.memory_bw if args.memory_bw in (None, "device") else parse_rate(args.memory_bw)
        )
        rate = device_rates(args.device, args.tflops, half, memory)
    except (ValueError, NotImplementedError) as exc:
        raise SystemExit(f"zppc schedule: {exc}") from None
    return config, links, rate


def _plan(args: argparse.Namespace) -> dict:
    """Compile one step against a fake process group; its collectives, bytes,
    FLOPs and the predicted step time."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zppc
    from zppc.cost import CostModel, collective_seconds, graph_flops
    from zppc.passes import planning
    from zppc.schedule import graph_schedule

    config, links, rate = _settings(args)
    torch._dynamo.reset()  # each plan compiles afresh (no recompile limit across plans)
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world_size)
    try:
        # Shards stay on meta under the fake group, so the step runs on shapes
        # only, whatever the model's size.
        with torch.device("meta"):
            model, inputs, traced_tokens = _model_and_inputs(
                args.model, args.seq, args.tokens_per_rank
            )
        # The graphs were traced on `traced_tokens` (the tokens per rank, rounded
        # down to whole sequences); FLOPs scale to the tokens computed (a
        # factory's model computes on its example inputs as they are).
        scale = args.tokens_per_rank / traced_tokens if traced_tokens else 1.0
        # One cost model predicts the step and, with --overlap cost, places the gathers.
        cost = CostModel(links, rate, scale)
        if args.overlap == "cost":
            config = dataclasses.replace(config, cost_model=cost)
        # Inside the plan: what `distribute` decides for the backend (OSP's
        # stage-2 algorithm) is decided for the one planned.
        with planning(args.kernels, args.backend):
            try:
                zppc.distribute(model, config)  # its checks cover the topology (hpz: world % node)
            except ValueError as exc:
                raise SystemExit(f"zppc schedule: {exc}") from None
            step = torch.compile(model, backend="zppc")
            # The loss is taken from the output outside the graph (cross-entropy has
            # no autograd formula on meta); the collectives do not depend on it.
            _first_tensor(step(*inputs)).float().square().mean().backward()
        compiles = zppc.inspect(step).compiles
        graphs = [
            (kind, record.final[kind], graph_schedule(record.final[kind], kind, args.rank))
            for record in compiles
            for kind in ("forward", "backward")
            if kind in record.final
        ]
        kept = [size for record in compiles for _, size in record.kept_gathered]
        estimate = cost.simulate(graphs)
        flops = sum(graph_flops(gm) for _, gm, _ in graphs) * scale
    finally:
        dist.destroy_process_group()

    rows = [
        {**c.__dict__, "predicted_seconds": collective_seconds(links, c)}
        for _, _, entries in graphs
        for c in entries
    ]
    totals = {
        "collectives": len(rows),
        "intra_node_bytes": sum(r["intra_node_bytes"] for r in rows),
        "inter_node_bytes": sum(r["inter_node_bytes"] for r in rows),
        "node_link_bytes": sum(r["node_link_bytes"] for r in rows),
        "communication_seconds": estimate.communication_seconds,
        "flops": flops,
        "compute_seconds": estimate.compute_seconds,
        "step_seconds": estimate.step_seconds,
        "hidden_fraction": estimate.hidden_fraction,
        "parameters": sum(p.numel() for p in model.parameters()),
        # zero3: weights the forward keeps gathered for the backward (not re-gathered).
        "kept_gathered_weights": len(kept),
        "kept_gathered_bytes": sum(kept),
    }
    timeline = [dataclasses.asdict(span) for span in estimate.timeline]
    return {"config": vars(args), "collectives": rows, "totals": totals, "timeline": timeline}


def _features(args: argparse.Namespace) -> str:
    features = [args.strategy]
    features += [f"qwz {args.qwz}"] if args.qwz else []
    features += ["hpz"] if args.hpz else []
    features += [f"qgz {args.qgz}"] if args.qgz else []
    features += [args.param_dtype] if args.param_dtype else []
    return " + ".join(features)


def _summary(plan: dict) -> str:
    t = plan["totals"]
    return (
        f"{t['collectives']} collectives, {t['intra_node_bytes'] / 1e6:,.3f} MB intra-node, "
        f"{t['inter_node_bytes'] / 1e6:,.3f} MB inter-node received by this rank (MB = 10^6 bytes; "
        f"logical, the ledger's), {t['node_link_bytes'] / 1e6:,.3f} MB into its node over the "
        f"inter-node link (ring / direct / two-hop algorithms, all the node's ranks); "
        f"communication {t['communication_seconds'] * 1e3:,.3f} ms, compute "
        f"{t['compute_seconds'] * 1e3:,.3f} ms ({t['flops'] / 1e9:,.3f} GFLOP), "
        f"step {t['step_seconds'] * 1e3:,.3f} ms predicted "
        f"({t['hidden_fraction']:.0%} of the smaller of the two hidden behind the other)"
    )


def _comparison_args(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with what `--compare` changes."""
    overrides = _compare_overrides(args.compare)
    fields = {**vars(args), **overrides, "compare": None}
    # A feature the comparison turns off takes its refinements with it.
    fields.update({flag: None for flag, needs in _REFINES.items() if fields[needs] is None})
    return argparse.Namespace(**fields)


def _plan_both(args: argparse.Namespace, other_args: argparse.Namespace, jobs: int):
    """The plans of `args` and of the comparison; with `jobs` > 1 the
    comparison runs in a forked process while this one plans `args`. The two
    are independent (each compiles on its own fake process group), and a plan
    uses one core."""
    if jobs < 2 or not hasattr(os, "fork"):
        return _plan(args), _plan(other_args)
    pid, reader = _fork_plan(other_args)
    try:
        plan = _plan(args)
    except BaseException:  # no plan left running, or blocked on its pipe
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(reader)
        raise
    return plan, _collect(pid, reader)


def _fork_plan(args: argparse.Namespace) -> tuple[int, int]:
    """Start `_plan(args)` in a child; its pid and the pipe it answers on."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plan, send the result (or the error), and leave
        os.close(reader)
        try:
            try:
                answer = ("plan", _plan(args))
            except SystemExit as exc:
                answer = ("exit", str(exc))
            except BaseException:  # noqa: BLE001  (reported by the parent)
                answer = ("error", traceback.format_exc())
            with os.fdopen(writer, "wb") as pipe:
                pickle.dump(answer, pipe)
        finally:
            os._exit(0)
    os.close(writer)
    return pid, reader


def _collect(pid: int, reader: int, what: str = "the comparison's plan") -> dict:
    with os.fdopen(reader, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise SystemExit(
            f"zppc schedule: {what} ended without an answer "
            f"(wait status {status}); rerun with --jobs 1 to plan it in this process"
        )
    kind, value = pickle.loads(data)
    if kind == "exit":
        raise SystemExit(value)
    if kind == "error":
        raise RuntimeError(f"{what} failed:\n{value}")
    return value


def _plan_many(many: list[argparse.Namespace], jobs: int) -> list[dict]:
    """The plans of `many`, in order; with `jobs` > 1 that many at once, each in
    a forked process (this one plans none of them, so no child is forked from a
    process whose thread pools have run)."""
    if jobs < 2 or not hasattr(os, "fork"):
        return [_plan(args) for args in many]
    plans: list[dict] = []
    for start in range(0, len(many), jobs):
        running: list[tuple[int, int]] = []
        try:
            for args in many[start : start + jobs]:
                running.append(_fork_plan(args))
            while running:
                pid, reader = running.pop(0)
                plans.append(_collect(pid, reader, f"plan {len(plans) + 1} of {len(many)}"))
        except BaseException:  # no plan left running, or blocked on its pipe
            for pid, reader in running:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os.close(reader)
            raise
    return plans


# How close to the fastest predicted step `--tune`'s suggestion may be: the cost
# model is good to tens of percent, so between settings this close it takes the
# one that keeps less gathered memory alive.
TUNE_TOLERANCE = 0.02
TUNE_PREFETCH = (1, 2, 3)


def tune_bucket_caps(block_cap: int) -> list[int | None]:
    """The `Config.bucket_bytes` values `--tune` plans: twice the cap None
    stands for (`block_cap`, where within `MAX_BUCKET_BYTES`), None itself
    (that cap, buckets ending where blocks do), then halving while at least
    `MIN_BUCKET_BYTES`, and that minimum where halving skips it. Largest first."""
    from zppc.config import MAX_BUCKET_BYTES, MIN_BUCKET_BYTES

    caps: list[int | None] = [2 * block_cap] if 2 * block_cap <= MAX_BUCKET_BYTES else []
    caps.append(None)
    cap = block_cap // 2
    while cap >= MIN_BUCKET_BYTES:
        caps.append(cap)
        cap //= 2
    if min(c or block_cap for c in caps) > MIN_BUCKET_BYTES:
        caps.append(MIN_BUCKET_BYTES)
    return caps


def _tune(args: argparse.Namespace) -> int:
    """Plan `args` over `tune_bucket_caps` x `TUNE_PREFETCH` and print them
    ranked, with the settings to use."""
    import torch

    from zppc.config import block_bucket_bytes

    for flag in ("bucket_mb", "prefetch", "compare"):
        if getattr(args, flag) is not None:
            raise SystemExit(
                f"zppc schedule: --tune chooses the bucket cap and the prefetch depth itself; "
                f"leave out --{flag.replace('_', '-')}"
            )
    if args.format == "chrome":
        raise SystemExit("zppc schedule: --tune prints a table or json, not one plan's trace")
    _settings(args)  # bad input is reported before any plan runs
    with torch.device("meta"):
        model, _, _ = _model_and_inputs(args.model, args.seq, args.tokens_per_rank)
    param_dtype = getattr(torch, args.param_dtype) if args.param_dtype else None
    block_cap = block_bucket_bytes(model, param_dtype)
    grid = [(cap, prefetch) for cap in tune_bucket_caps(block_cap) for prefetch in TUNE_PREFETCH]
    plans = _plan_many(
        [
            argparse.Namespace(
                **{**vars(args), "bucket_mb": cap and cap / 2**20, "prefetch": prefetch}
            )
            for cap, prefetch in grid
        ],
        args.jobs,
    )
    default_step = plans[grid.index((None, 1))]["totals"]["step_seconds"]
    rows = sorted(
        (
            {
                "bucket_bytes": cap,  # as Config takes it: None is the block's cap
                "bucket_cap_bytes": cap or block_cap,
                "prefetch": prefetch,
                "default": (cap, prefetch) == (None, 1),
                "collectives": plan["totals"]["collectives"],
                # What `Config.prefetch` bounds: that many gathered buckets alive at once.
                "gathered_bytes_alive_at_most": (prefetch + 1) * (cap or block_cap),
                "node_link_bytes": plan["totals"]["node_link_bytes"],
                "step_seconds": plan["totals"]["step_seconds"],
                "hidden_fraction": plan["totals"]["hidden_fraction"],
                "speedup_over_default": default_step / plan["totals"]["step_seconds"],
            }
            for (cap, prefetch), plan in zip(grid, plans, strict=True)
        ),
        key=lambda row: (row["step_seconds"], row["gathered_bytes_alive_at_most"]),
    )
    fastest = rows[0]["step_seconds"]
    suggested = min(
        (row for row in rows if row["step_seconds"] <= fastest * (1 + TUNE_TOLERANCE)),
        key=lambda row: (row["gathered_bytes_alive_at_most"], row["step_seconds"]),
    )
    with _output(args) as out:
        if args.format == "json":
            json.dump({"config": vars(args), "tune": rows, "suggested": suggested}, out, indent=1)
            out.write("\n")
        else:
            _print_tune(rows, suggested, args, out)
    return 0


@contextlib.contextmanager
def _output(args: argparse.Namespace) -> Iterator[TextIO]:
    """Where `zppc schedule` writes: the `-o` file, or standard output."""
    if not args.output:
        yield sys.stdout
        return
    with open(args.output, "w") as out:
        yield out


def _print_tune(rows: list[dict], suggested: dict, args: argparse.Namespace, out) -> None:
    print(
        f"{args.model}, {_features(args)}, world {args.world_size}, node {args.node_size}; "
        f"{args.backend}, {_links_text(args)}; gathers issued {args.overlap} "
        f"(MiB = 2^20 bytes, MB = 10^6)",
        file=out,
    )
    print(
        f"{'bucket MiB':>10s} {'prefetch':>8s} {'collectives':>11s} {'gathered MiB alive':>18s} "
        f"{'node link MB':>12s} {'step ms':>10s} {'hidden':>6s} {'vs default':>10s}",
        file=out,
    )
    for row in rows:
        print(
            f"{row['bucket_cap_bytes'] / 2**20:10.2f} {row['prefetch']:8d} {row['collectives']:11d} "
            f"{row['gathered_bytes_alive_at_most'] / 2**20:18.2f} "
            f"{row['node_link_bytes'] / 1e6:12.3f} {row['step_seconds'] * 1e3:10,.1f} "
            f"{row['hidden_fraction']:6.0%} {row['speedup_over_default']:9.3f}x"
            f"{'  (the default)' if row['default'] else ''}"
            f"{'  <- suggested' if row is suggested else ''}",
            file=out,
        )
    print(
        f"suggested: zppc.Config(..., bucket_bytes={suggested['bucket_bytes']}, "
        f"prefetch={suggested['prefetch']}): the least gathered memory within "
        f"{TUNE_TOLERANCE:.0%} of the fastest predicted step, "
        f"{suggested['speedup_over_default']:.3f}x the default's (Config(bucket_bytes=None, "
        f"prefetch=1)); predictions, good to tens of percent: measure before you keep it",
        file=out,
    )


# `zppc schedule`'s link flags and their values when neither they nor --links give one.
_LINK_DEFAULTS = {
    "intra_bw": "300GB/s",
    "inter_bw": "100Gbit/s",
    "latency": "5us",
    "inter_link": "rank",
    "backend": "nccl",
}


def _fill_link_flags(args: argparse.Namespace) -> None:
    """Each link flag not given: from the --links measurement, else the
    default; --tflops and --memory-bw from it where it holds compute rates."""
    from zppc.measure import LinkMeasurement

    measured = {}
    if args.links is not None:
        try:
            link = LinkMeasurement.load(args.links)
        except ValueError as exc:
            raise SystemExit(f"zppc schedule: {exc}") from None
        measured = link.schedule_settings(exact=True)
    for flag, default in _LINK_DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, measured.get(flag, default))
    # Compute rates measured with `zppc links --compute`, where not given.
    if args.tflops is None and "tflops" in measured:
        args.tflops = float(measured["tflops"])
    if args.memory_bw is None and "memory_bw" in measured:
        args.memory_bw = measured["memory_bw"]


def _links(args: argparse.Namespace) -> int:
    """`zppc links`: measure on every rank; rank 0 prints (and writes) it."""
    import torch
    import torch.distributed as dist

    from zppc.measure import measure_compute, measure_links

    if not dist.is_initialized() and "RANK" not in os.environ:
        raise SystemExit(
            "zppc links: run it on every rank under torchrun, e.g. "
            "torchrun --nproc-per-node 4 -m zppc links"
        )
    owned = not dist.is_initialized()
    if owned:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    rank = dist.get_rank()
    try:
        dtype = getattr(torch, args.dtype)
        measured = measure_links(
            message_bytes=int(args.message_mb * 2**20),
            repeats=args.repeats,
            node_size=args.node_size,
            inter_per_node=args.inter_link == "node",
        )
        if args.compute:
            compute = measure_compute(dtype, max(args.repeats, 5))
            measured = dataclasses.replace(
                measured,
                flops_per_second=compute.flops_per_second,
                memory_bytes_per_second=compute.memory_bytes_per_second,
                compute_dtype=args.dtype,
            )
    except ValueError as exc:
        raise SystemExit(f"zppc links: {exc}") from None
    finally:
        if owned:
            dist.destroy_process_group()
    if rank == 0:
        _print_links(measured)
        if args.output:
            measured.save(args.output)
            print(f"wrote {args.output} (zppc schedule --links {args.output})")
    return 0


def _print_links(m) -> None:
    nodes = m.world_size // m.node_size
    print(
        f"links over {m.backend}, {m.world_size} ranks as {nodes} node(s) x {m.node_size}; "
        f"all-gathers of {m.message_bytes / 2**20:g} MiB and of 4 bytes a rank, slowest rank, "
        f"median of {m.repeats} (MB = 10^6 bytes):"
    )
    print(f"  {'group':<12}{'all-gather':>12}{'4 bytes':>12}  rate")
    print(f"  {'world':<12}{'':>12}{m.latency_seconds * 1e3:>9.3f} ms  (the latency)")
    inter_unit = "the node's link" if m.inter_per_node else "a rank's link"
    for name, seconds, latency, rate, unit in (
        (
            "intra-node",
            m.intra_seconds,
            m.intra_latency_seconds,
            m.intra_bytes_per_second,
            "a rank",
        ),
        (
            "inter-node",
            m.inter_seconds,
            m.inter_latency_seconds,
            m.inter_bytes_per_second,
            inter_unit,
        ),
    ):
        if seconds is None:
            print(f"  {name:<12}not measured: no such link in this job")
            continue
        print(
            f"  {name:<12}{seconds * 1e3:>9.3f} ms{latency * 1e3:>9.3f} ms  "
            f"{rate / 1e6:,.2f} MB/s into {unit}"
        )
        if latency > seconds / 2:
            print(f"    latency over half the time: a larger --message-mb measures the {name} rate")
    if m.flops_per_second and m.memory_bytes_per_second:
        print(
            f"  compute ({m.compute_dtype}, every rank at once, slowest rank): "
            f"{m.flops_per_second / 1e9:,.1f} GFLOP/s, {m.memory_bytes_per_second / 1e9:,.2f} GB/s"
        )
    print("zppc schedule flags: " + " ".join(m.schedule_flags()))


def _schedule(args: argparse.Namespace) -> int:
    _fill_link_flags(args)
    if args.tune:
        return _tune(args)
    other_args = _comparison_args(args) if args.compare else None
    for a in filter(None, (args, other_args)):
        _settings(a)  # every plan's bad input is reported before any plan runs
    if other_args is None:
        plan, other = _plan(args), None
    else:
        plan, other = _plan_both(args, other_args, args.jobs)
    with _output(args) as out:
        if args.format == "json":
            document = plan if other is None else {**plan, "compare": other}
            json.dump(document, out, indent=1)
            out.write("\n")
        elif args.format == "chrome":
            from zppc.cost import chrome_trace

            json.dump(chrome_trace(plan["timeline"], args.rank), out)
            out.write("\n")
        else:
            _print_table(plan, args, other, other_args, out)
    return 0


def _links_text(args: argparse.Namespace) -> str:
    """The links and compute rate a plan assumes, for a table's first line."""
    return (
        f"links {args.intra_bw if args.intra_gbps is None else f'{args.intra_gbps:g}Gbit/s'} "
        f"intra, {args.inter_bw if args.inter_gbps is None else f'{args.inter_gbps:g}Gbit/s'} "
        f"inter, latency {args.latency}; {args.tokens_per_rank} tokens per rank at "
        f"{f'{args.tflops:g} TFLOP/s' if args.tflops else args.device}"
        f"{f', memory {args.memory_bw}' if args.memory_bw else ''}"
    )


def _print_table(plan, args, other, other_args, out) -> None:
    cfg_params = plan["totals"]["parameters"]
    print(
        f"{args.model} ({cfg_params / 1e6:,.1f}M parameters), {_features(args)}, "
        f"world {args.world_size}, node {args.node_size}, rank {args.rank}; {_links_text(args)}"
        f"{', torch kernels' if args.kernels == 'torch' else ''}",
        file=out,
    )
    print(
        f"{'graph':9s} {'#':>3s} {'kind':15s} {'ranks':>5s} {'per peer':>12s} {'intra':>14s} "
        f"{'inter':>14s} {'node link':>14s} {'ms':>9s}",
        file=out,
    )
    for r in plan["collectives"]:
        print(
            f"{r['graph']:9s} {r['index']:3d} {r['kind']:15s} {r['group_size']:5d} {r['bytes_per_peer']:12,d} "
            f"{r['intra_node_bytes']:14,d} {r['inter_node_bytes']:14,d} {r['node_link_bytes']:14,d} "
            f"{r['predicted_seconds'] * 1e3:9.3f}"
            f"{'  in two hops' if r.get('two_hops') else ''}"
            f"{'  OSP stage 2 (in flight into the next step)' if r['stage'] == 2 else ''}",
            file=out,
        )
    if plan["totals"]["kept_gathered_weights"]:
        print(
            f"kept gathered from forward to backward (not re-gathered): "
            f"{plan['totals']['kept_gathered_weights']} weights, "
            f"{plan['totals']['kept_gathered_bytes'] / 1e6:,.3f} MB",
            file=out,
        )
    print(f"total: {_summary(plan)}", file=out)
    if other is not None:
        print(f"compare ({_features(other_args)}): {_summary(other)}", file=out)
        mine, theirs = plan["totals"], other["totals"]
        inter = (
            f"{mine['inter_node_bytes'] / theirs['inter_node_bytes']:.3f}x"
            if theirs["inter_node_bytes"]
            else "-"
        )
        link = (
            f"{mine['node_link_bytes'] / theirs['node_link_bytes']:.3f}x"
            if theirs["node_link_bytes"]
            else "-"
        )
        print(
            f"ratio: inter-node bytes {inter} (per-node link bytes {link}) of the comparison's, "
            f"predicted speedup "
            f"{theirs['step_seconds'] / mine['step_seconds']:.2f}x",
            file=out,
        )


def main(argv: list[str] | None = None) -> int:
    from zppc.config import STRATEGIES
    from zppc.cost import DEVICES
    from zppc.models import PRESETS

    parser = argparse.ArgumentParser(
        prog="zppc", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    s = sub.add_parser("schedule", help="the communication schedule of one training step")
    s.add_argument(
        "model",
        help=f"one of {', '.join(sorted(PRESETS))}, or package.module:factory returning "
        "(model, example_inputs)",
    )
    s.add_argument("--world-size", type=int, required=True)
    s.add_argument("--node-size", type=int, default=8)
    s.add_argument("--rank", type=int, default=0, help="whose view of the schedule")
    s.add_argument("--strategy", default="zero3", choices=list(STRATEGIES))
    s.add_argument("--qwz", choices=["int8", "int4"], default=None, help="quantized weight gathers")
    s.add_argument(
        "--hpz", action="store_true", help="backward gathers inside the node (secondary shard)"
    )
    s.add_argument("--qgz", choices=["int4", "int8"], default=None, help="quantized gradients")
    s.add_argument(
        "--qwz-block", type=int, default=None, help="elements per qwZ scale (default: the format's)"
    )
    s.add_argument(
        "--qgz-block", type=int, default=None, help="elements per qgZ scale (default: the format's)"
    )
    s.add_argument(
        "--qgz-intra-node",
        choices=["int8", "int4", "none"],
        default=None,
        help="format of qgZ's intra-node hop (default int8; none: unquantized)",
    )
    s.add_argument("--osp", type=float, default=None, help="fraction of gradients in stage 2")
    s.add_argument(
        "--osp-split",
        choices=["last", "magnitude"],
        default=None,
        help="which gradients make up stage 2 (magnitude needs measured gradients: not plannable)",
    )
    s.add_argument("--param-dtype", choices=DTYPES, default=None)
    s.add_argument(
        "--reduce-dtype", choices=DTYPES, default=None, help="dtype of the gradient reductions"
    )
    s.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="bucket cap in MiB (default: the model's largest repeated block, within 1-25 MiB)",
    )
    s.add_argument(
        "--reduce-scatter",
        choices=["auto", "native", "all_to_all", "two_hop"],
        default="auto",
        help="how gradient reduce-scatters run: the backend's own, an all-to-all and a "
        "local sum, or two hops (inside each node, then across: gloo, several nodes of "
        "several ranks); auto on --backend gloo: two_hop where it applies, else all_to_all "
        "where that moves fewer bytes into a node than gloo's reduce-scatter (an "
        "all-reduce); native on nccl",
    )
    s.add_argument(
        "--prefetch",
        type=int,
        default=None,
        help="gathered buckets issued ahead of the one in use (default 1)",
    )
    s.add_argument(
        "--overlap",
        choices=["earliest", "cost"],
        default="earliest",
        help="when gathers are issued: as early as --prefetch allows, or as late as this "
        "plan's links and compute rate still hide them (Config.cost_model)",
    )
    s.add_argument(
        "--keep-gathered-mb",
        type=float,
        default=0.0,
        help="zero3: MiB of the last-used weights kept gathered from forward to backward",
    )
    s.add_argument(
        "--no-keep-last-block",
        dest="keep_last_block",
        action="store_false",
        help="zero3: re-gather in backward the weights the forward reads last "
        "(Config.keep_last_block=False); by default one repeated block's bytes stay gathered",
    )
    s.add_argument(
        "--no-edge-buckets",
        dest="edge_buckets",
        action="store_false",
        help="bucket a graph's first gathers and last reductions like any others "
        "(Config.edge_buckets=False); by default they hold at most half a bucket",
    )
    s.add_argument(
        "--seq",
        type=int,
        default=None,
        help="tokens per traced sequence (default: the model's block size, at most "
        "--tokens-per-rank); the trace holds as many sequences as make --tokens-per-rank",
    )
    s.add_argument(
        "--tokens-per-rank",
        type=int,
        default=1024,
        help="tokens each rank computes per step (compute time; the traced FLOPs are scaled to it)",
    )
    # The link flags default to None so that --links can tell what was given.
    s.add_argument(
        "--intra-bw", default=None, help="intra-node link per rank, e.g. 600GB/s (default 300GB/s)"
    )
    s.add_argument(
        "--inter-bw",
        default=None,
        help="inter-node link per rank, e.g. 100Gbit/s (default 100Gbit/s)",
    )
    s.add_argument(
        "--latency", default=None, help="latency of every collective, e.g. 5us (default 5us)"
    )
    s.add_argument(
        "--inter-link",
        choices=["rank", "node"],
        default=None,
        help="what --inter-bw is: each rank's own inter-node link (costs the bytes each rank "
        "receives; the default), or the node's one link its ranks share (costs the bytes "
        "entering the node)",
    )
    s.add_argument(
        "--backend",
        choices=["nccl", "gloo"],
        default=None,
        help="the collectives' algorithms (default nccl): gloo runs reduce-scatter as an "
        "all-reduce (2x the bytes; --reduce-scatter auto plans it as an all-to-all instead, "
        "as a gloo run does)",
    )
    s.add_argument(
        "--links",
        default=None,
        help="a `zppc links -o` measurement: its rates, latency, --inter-link and --backend "
        "where those flags are not given",
    )
    s.add_argument("--intra-gbps", type=float, default=None, help=argparse.SUPPRESS)
    s.add_argument("--inter-gbps", type=float, default=None, help=argparse.SUPPRESS)
    s.add_argument(
        "--device",
        default="A100",
        choices=sorted(DEVICES),
        help="compute rate: the device's published dense peak (16-bit with --param-dtype "
        "bfloat16/float16, else float32)",
    )
    s.add_argument("--tflops", type=float, default=None, help="compute rate instead of --device")
    s.add_argument(
        "--memory-bw",
        default=None,
        help="memory bandwidth, e.g. 900GB/s, or 'device' for the --device's published one: "
        "each op then costs the longer of its FLOPs and the bytes it reads and writes, as the "
        "eager lowering runs it (unfused: on a GPU an upper bound; default: FLOPs only)",
    )
    s.add_argument(
        "--kernels",
        choices=["triton", "torch"],
        default="triton",
        help="quantization as zppc's Triton kernels (a GPU compile's graph) or as the torch "
        "reference's ops (what a CPU run executes, for a CPU cluster's plan)",
    )
    s.add_argument(
        "--compare",
        default=None,
        help='a second configuration to plan beside this one: "zero3", "zero3,qwz=int8,hpz=true"',
    )
    s.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="plans at once: with --compare, 2 plans the comparison in a second process "
        "(default: 2 when there are 2 cores or more)",
    )
    s.add_argument(
        "--tune",
        action="store_true",
        help="plan the step at each bucket cap (twice the model's repeated block, then halving "
        "down to 1 MiB) and prefetch depth (1-3), rank them by predicted step time, and name "
        "the settings to use: the least gathered memory within 2%% of the fastest",
    )
    s.add_argument("--format", choices=["table", "json", "chrome"], default="table")
    s.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    m = sub.add_parser(
        "links",
        help="measure the links as collectives get them (on every rank, under torchrun)",
        description="Times all-gathers inside and across the nodes on this job's backend and "
        "prints the rates `zppc schedule` and zppc.cost.Links take. Run it as the training "
        "job runs: torchrun --nnodes 2 --nproc-per-node 8 ... -m zppc links -o links.json",
    )
    m.add_argument(
        "--message-mb",
        type=float,
        default=4.0,
        help="MiB each rank contributes to a timed all-gather (default 4)",
    )
    m.add_argument("--repeats", type=int, default=5, help="timed all-gathers of each kind")
    m.add_argument(
        "--node-size", type=int, default=None, help="ranks per node (default LOCAL_WORLD_SIZE)"
    )
    m.add_argument(
        "--inter-link",
        choices=["rank", "node"],
        default="rank",
        help="whether each rank has its own inter-node link (a NIC per GPU) or the node's ranks "
        "share one (a CPU cluster): the inter-node rate counts the bytes a rank receives, or "
        "the bytes entering the node",
    )
    m.add_argument(
        "--compute",
        action="store_true",
        help="also time a matrix product and an elementwise add on every rank at once "
        "(zppc.measure.measure_compute): the --tflops and --memory-bw zppc schedule plans with",
    )
    m.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="the dtype --compute measures in (the parameters'; default float32)",
    )
    m.add_argument("-o", "--output", default=None, help="write the measurement as JSON (rank 0)")
    args = parser.parse_args(argv)
    if args.version:
        import zppc

        print(zppc.__version__)
        return 0
    if args.command == "schedule":
        return _schedule(args)
    if args.command == "links":
        return _links(args)
    parser.print_help()
    return 2
