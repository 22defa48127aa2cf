"""`zppc.inspect(step)`: the graphs after every pass and the communication schedule."""

from __future__ import annotations

from dataclasses import dataclass

from zppc.distribute import state_of
from zppc.schedule import CompileRecord, ScheduledCollective, records_for


@dataclass
class Inspection:
    """What zppc compiled for one model."""

    compiles: list[CompileRecord]

    def graphs(self, kind: str = "forward", index: int = 0) -> dict[str, str]:
        """Code of the `kind` graph of compile `index` after each pass, by pass name."""
        return {r.name: r.code for r in self.compiles[index].passes[kind]}

    @property
    def schedule(self) -> list[ScheduledCollective]:
        return [c for record in self.compiles for c in record.schedule()]

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
                    f"{record.config.keep_gathered_bytes})"
                )
        lines.append("== communication schedule (bytes received by this rank)")
        lines.append(
            f"  {'graph':8s} {'#':>3s} {'kind':15s} {'group':>5s} {'intra':>12s} {'inter':>12s}"
        )
        for c in self.schedule:
            lines.append(
                f"  {c.graph:8s} {c.index:3d} {c.kind:15s} {c.group_size:5d} "
                f"{c.intra_node_bytes:12d} {c.inter_node_bytes:12d}"
            )
        return "\n".join(lines)


def inspect(step) -> Inspection:
    """Everything zppc compiled for `step` (a `torch.compile`d model, or the model)."""
    model = getattr(step, "_orig_mod", step)
    return Inspection(records_for(state_of(model)))
