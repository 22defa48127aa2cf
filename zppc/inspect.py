"""`zppc.inspect(step)`: the graphs after every pass and the communication schedule.

`ZPPC_DUMP_DIR=dir` also writes, for every compile on every rank, each graph's
code after each pass and the schedule (`dump_compile`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from zppc.distribute import state_of
from zppc.schedule import CompileRecord, ScheduledCollective, records_for

log = logging.getLogger("zppc.inspect")
GRAPH_KINDS = ("forward", "backward")


@dataclass
class Inspection:
    """What zppc compiled for one model."""

    compiles: list[CompileRecord]
    modes: dict[str, str] = field(default_factory=dict)
    """How each parameter is held, by name (`ShardSpec.mode`): "ddp"
    replicated, "zero1"/"zero2"/"zero3" sharded, "rtp" rotated around the ring."""

    @property
    def rotated(self) -> list[str]:
        """The parameters RTP rotates (every other one of an rtp model is replicated)."""
        return [fqn for fqn, mode in self.modes.items() if mode == "rtp"]

    def graphs(self, kind: str = "forward", index: int = 0) -> dict[str, str]:
        """Code of the `kind` graph of compile `index` after each pass, by pass name."""
        return {r.name: r.code for r in self.compiles[index].passes[kind]}

    @property
    def schedule(self) -> list[ScheduledCollective]:
        return [c for record in self.compiles for c in record.schedule()]

    def estimate(
        self,
        links=None,
        flops_per_second: float | None = None,
        memory_bytes_per_second: float | None = None,
    ):
        """The step replayed by zppc's cost model (`zppc.cost.simulate`) on the
        final graphs. Given none of the rates, those of `Config.cost_model`
        (what the `overlap` pass planned with), else `zppc schedule`'s defaults
        (300 GB/s intra-node, 100 Gbit/s inter-node, 5 us, an A100's float32
        peak; bytes charged only with a memory rate); FLOPs and bytes are those
        of the traced shapes."""
        import torch.distributed as dist

        from zppc.cost import DEFAULT_LINKS, device_rates, simulate
        from zppc.schedule import graph_schedule

        rank = dist.get_rank()
        graphs = [
            (kind, record.final[kind], graph_schedule(record.final[kind], kind, rank))
            for record in self.compiles
            for kind in GRAPH_KINDS
            if kind in record.final
        ]
        planned = next((r.config.cost_model for r in self.compiles if r.config.cost_model), None)
        given = (links, flops_per_second, memory_bytes_per_second)
        if planned is not None and all(g is None for g in given):
            return planned.simulate(graphs)
        tflops = flops_per_second / 1e12 if flops_per_second else None
        rates = device_rates("A100", tflops, False, memory_bytes_per_second)
        return simulate(graphs, links or DEFAULT_LINKS, rates)

    def to_json(self) -> dict:
        """Every compile's config, passes (op changes, seconds), the weights kept
        gathered, and the schedule, as plain data."""
        return {
            "modes": dict(self.modes),
            "compiles": [_record_json(record) for record in self.compiles],
        }

    def to_chrome_trace(
        self,
        path,
        links=None,
        flops_per_second: float | None = None,
        memory_bytes_per_second: float | None = None,
    ) -> None:
        """Write the replayed step (see `estimate`) as a Chrome trace; Perfetto
        and chrome://tracing open it."""
        import torch.distributed as dist

        from zppc.cost import chrome_trace

        estimate = self.estimate(links, flops_per_second, memory_bytes_per_second)
        trace = chrome_trace(estimate.timeline, dist.get_rank())
        Path(path).write_text(json.dumps(trace))

    def __str__(self) -> str:
        lines = []
        for i, record in enumerate(self.compiles):
            lines.append(f"== graph {i}")
            for kind, records in record.passes.items():
                for r in records:
                    change = f"+{r.added} -{r.removed}" if r.name != "input" else ""
                    lines.append(f"  {kind:8s} {r.name:16s} {change}")
            if record.kept_gathered:
                kept = sum(size for _, size in record.kept_gathered)
                lines.append(
                    f"  kept gathered from forward to backward: {len(record.kept_gathered)} "
                    f"weights, {kept / 1e6:.2f} MB (keep_gathered_bytes="
                    f"{record.config.keep_gathered_bytes}, keep_last_block="
                    f"{record.config.keep_last_block})"
                )
        if self.rotated:
            replicated = [fqn for fqn, mode in self.modes.items() if mode == "ddp"]
            lines.append(f"== rtp: rotated {', '.join(self.rotated)}")
            lines.append(f"        replicated {', '.join(replicated) or '-'}")
        lines.append("== communication schedule (bytes received by this rank)")
        lines.append(
            f"  {'graph':8s} {'#':>3s} {'kind':15s} {'group':>5s} {'intra':>12s} {'inter':>12s}"
        )
        for c in self.schedule:
            lines.append(
                f"  {c.graph:8s} {c.index:3d} {c.kind:15s} {c.group_size:5d} "
                f"{c.intra_node_bytes:12d} {c.inter_node_bytes:12d}"
                f"{'  OSP stage 2' if c.stage == 2 else ''}"
            )
        return "\n".join(lines)


def inspect(step) -> Inspection:
    """Everything zppc compiled for `step` (a `torch.compile`d model, or the model)."""
    model = getattr(step, "_orig_mod", step)
    state = state_of(model)
    modes = {fqn: spec.mode for fqn, spec in state.specs.items()} if state is not None else {}
    return Inspection(records_for(state), modes)


def _jsonable(value):
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def _record_json(record: CompileRecord) -> dict:
    return {
        "config": {
            f.name: _jsonable(getattr(record.config, f.name))
            for f in dataclasses.fields(record.config)
        },
        "passes": {
            kind: [
                {"name": r.name, "added": r.added, "removed": r.removed, "seconds": r.seconds}
                for r in records
            ]
            for kind, records in record.passes.items()
        },
        "kept_gathered": [
            {"shape": list(shape), "bytes": size} for shape, size in record.kept_gathered
        ],
        "schedule": [dataclasses.asdict(c) for c in record.schedule()],
    }


def dump_compile(record: CompileRecord, index: int, kind: str) -> Path | None:
    """With ZPPC_DUMP_DIR set: write graph `kind` of compile `index` after every
    pass (`<dir>/rank<r>/compile<index>/<kind>_<k>_<pass>.py`), and once the
    backward is there the compile's JSON (`schedule.json`)."""
    root = os.environ.get("ZPPC_DUMP_DIR")
    if not root:
        return None
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    where = Path(root) / f"rank{rank}" / f"compile{index}"
    where.mkdir(parents=True, exist_ok=True)
    for k, r in enumerate(record.passes[kind]):
        (where / f"{kind}_{k:02d}_{r.name}.py").write_text(r.code)
    if kind == "backward" or not record.passes["backward"]:
        (where / "schedule.json").write_text(json.dumps(_record_json(record), indent=1))
    log.info("zppc: wrote the %s graph of compile %d to %s", kind, index, where)
    return where
