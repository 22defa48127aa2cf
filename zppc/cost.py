"""The cost model of one training step: links, compute and their overlap.

Communication: each collective costs the links' latency plus the bytes this
rank receives over each link class divided by that link's bandwidth (intra- and
inter-node bytes come from the schedule, which matches the live ledger).
Compute: each node of the final graphs costs its FLOPs (torch's own formulas,
on the traced shapes) at the device's FLOP rate, or, given a memory rate, the
longer of that and the bytes it reads and writes at that rate (the roofline;
views move nothing). The step time replays each final graph in program order
on two clocks, compute and communication: a collective starts when it is
issued and its link is free, and a wait holds compute until the collective it
waits for is done. With every wait right after its issue that is the serial
sum; any overlap a pass creates shows up as a shorter step.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import torch
from torch import fx
from torch._ops import OpOverload
from torch.utils.flop_counter import flop_registry

import zppc.runtime.collectives  # noqa: F401  (registers zppc::record_comm, zppc::take_shard)

# Published dense peak FLOP/s (16-bit tensor cores, float32) and memory
# bandwidth (bytes/s): NVIDIA's data sheets (V100 SXM2 32 GB, A100 SXM4 80 GB,
# H100 SXM5, H200 SXM).
DEVICES = {
    "V100": (125e12, 15.7e12, 900e9),
    "A100": (312e12, 19.5e12, 2039e9),
    "H100": (989e12, 67e12, 3.35e12),
    "H200": (989e12, 67e12, 4.8e12),
}

_RATE_UNITS = {
    "bit/s": 1 / 8,
    "kbit/s": 1e3 / 8,
    "mbit/s": 1e6 / 8,
    "gbit/s": 1e9 / 8,
    "tbit/s": 1e12 / 8,
    "b/s": 1.0,
    "kb/s": 1e3,
    "mb/s": 1e6,
    "gb/s": 1e9,
    "tb/s": 1e12,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_rate(text: str) -> float:
    """Bytes per second from "600GB/s", "100Gbit/s" or "100gbit" (bits: "bit";
    bytes: "B"; decimal prefixes)."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([a-zA-Z]+)(/s)?\s*", text)
    unit = (match.group(2) + "/s").lower() if match else ""
    if not match or unit not in _RATE_UNITS:
        raise ValueError(
            f"cannot read the bandwidth {text!r}: write a number and a unit such as 600GB/s or 100Gbit/s"
        )
    return float(match.group(1)) * _RATE_UNITS[unit]


def parse_time(text: str) -> float:
    """Seconds from "5us", "1.5ms" or "0"."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([a-zµ]*)\s*", text)
    if not match or (match.group(2) or "s") not in _TIME_UNITS:
        raise ValueError(f"cannot read the time {text!r}: write a number and s, ms, us or ns")
    return float(match.group(1)) * _TIME_UNITS[match.group(2) or "s"]


@dataclass(frozen=True)
class Links:
    """Link speeds (bytes/s), the latency every collective pays, and how the
    inter-node link and the backend's algorithms are read."""

    intra_bytes_per_second: float
    inter_bytes_per_second: float
    latency_seconds: float = 0.0
    inter_per_node: bool = False
    """False: each rank has an inter-node link of its own and a collective
    costs the bytes it receives from other nodes (the ledger's). True: the
    node's ranks share one link, and a collective costs the bytes entering
    the node over it, all its ranks counted (ring / direct / two-hop algorithms)."""
    gloo: bool = False
    """gloo runs a reduce-scatter as an all-reduce: twice a ring
    reduce-scatter's bytes on every link."""

    def seconds(self, intra_bytes: int, inter_bytes: int) -> float:
        return (
            self.latency_seconds
            + intra_bytes / self.intra_bytes_per_second
            + inter_bytes / self.inter_bytes_per_second
        )


# `zppc schedule`'s default links: NVLink-class within a node, 100 Gbit/s
# between nodes, 5 us per collective.
DEFAULT_LINKS = Links(300e9, 100e9 / 8, 5e-6)

# Ops that touch no tensor data: the ledger hook reads only its input's size.
_MOVES_NOTHING = {torch.ops.zppc.record_comm.default, torch.ops.aten._unsafe_view.default}


def node_flops(node: fx.Node) -> int:
    """FLOPs of one graph node by torch's formulas (0 for ops without one)."""
    if node.op != "call_function":
        return 0
    formula = flop_registry.get(getattr(node.target, "overloadpacket", node.target))
    if formula is None:
        return 0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        return int(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except (TypeError, AttributeError, RuntimeError):
        return 0


def graph_flops(gm: fx.GraphModule) -> int:
    return sum(node_flops(n) for n in gm.graph.nodes)


def _tensor_bytes(value) -> int:
    leaves = value if isinstance(value, (list, tuple)) else [value]
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def node_bytes(node: fx.Node) -> int:
    """Bytes one graph node reads and writes in memory: its tensor inputs and
    outputs, by their traced metadata. A view, or a node that only reads
    metadata (the ledger hook), moves none; `zppc::take_shard` reads the slice
    it copies, not the whole flat tensor."""
    if node.op != "call_function" or node.target in _MOVES_NOTHING:
        return 0
    if getattr(node.target, "is_view", False) or not isinstance(node.target, OpOverload):
        return 0
    out = _tensor_bytes(node.meta.get("val"))
    if node.target is torch.ops.zppc.take_shard.default:
        return 2 * out
    return out + sum(_tensor_bytes(n.meta.get("val")) for n in node.all_input_nodes)


@dataclass(frozen=True)
class Compute:
    """A device's rates. A node costs max(FLOPs / flops_per_second, bytes /
    memory_bytes_per_second): a matrix product is bound by its FLOPs, a
    pointwise op or a quantization kernel by its bytes."""

    flops_per_second: float
    memory_bytes_per_second: float | None = None
    """None: bytes are not charged (compute is FLOPs only)."""

    def __post_init__(self):
        for name in ("flops_per_second", "memory_bytes_per_second"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")

    def seconds(self, node: fx.Node, token_scale: float = 1.0) -> float:
        """`node`'s time; FLOPs scale with `token_scale` (the traced tokens to
        the tokens computed), bytes are taken as traced."""
        return self.seconds_of(node, node_flops(node) * token_scale)

    def seconds_of(self, node: fx.Node, flops: float) -> float:
        """`node`'s time given its (scaled) FLOPs, for a caller that has them."""
        flop_seconds = flops / self.flops_per_second
        if self.memory_bytes_per_second is None:
            return flop_seconds
        return max(flop_seconds, node_bytes(node) / self.memory_bytes_per_second)


@dataclass(frozen=True)
class CostModel:
    """The rates one step is estimated with: what `zppc schedule` predicts a
    step with, and, given as `Config.cost_model`, what the `overlap` pass
    decides when to issue each gather with."""

    links: Links
    compute: Compute
    flop_scale: float = 1.0
    """The tokens computed over the tokens traced (a plan traces fewer)."""

    def __post_init__(self):
        if not isinstance(self.links, Links) or not isinstance(self.compute, Compute):
            raise ValueError(
                "CostModel(links, compute) takes a zppc.cost.Links and a zppc.cost.Compute, "
                f"got {type(self.links).__name__} and {type(self.compute).__name__}"
            )
        if not self.flop_scale > 0:
            raise ValueError(f"flop_scale must be positive, got {self.flop_scale}")

    def node_seconds(self, node: fx.Node) -> float:
        """One node's compute time (0 for a node outside the compute stream)."""
        return self.compute.seconds(node, self.flop_scale)

    def simulate(self, graphs: list[tuple[str, fx.GraphModule, list]]) -> StepEstimate:
        """`simulate` at these rates."""
        return simulate(graphs, self.links, self.compute, flop_scale=self.flop_scale)


@dataclass(frozen=True)
class Span:
    """One interval of the replayed step on one track ("compute" or
    "communication"), in seconds from the start of the step."""

    track: str
    name: str
    graph: str
    start: float
    seconds: float
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StepEstimate:
    compute_seconds: float
    communication_seconds: float
    step_seconds: float
    timeline: tuple[Span, ...] = ()

    @property
    def hidden_fraction(self) -> float:
        """Share of the smaller of compute and communication hidden behind the other."""
        smaller = min(self.compute_seconds, self.communication_seconds)
        if smaller == 0:
            return 0.0
        hidden = self.compute_seconds + self.communication_seconds - self.step_seconds
        return max(hidden, 0.0) / smaller  # float rounding can leave -1e-17


def chrome_trace(timeline, pid: int = 0) -> dict:
    """Spans (or their dicts) as a Chrome trace (chrome://tracing, Perfetto):
    one row for compute, one for communication."""
    spans = [s if isinstance(s, dict) else dataclasses.asdict(s) for s in timeline]
    return {
        "traceEvents": [
            {
                "name": span["name"],
                "cat": span["graph"],
                "ph": "X",
                "ts": span["start"] * 1e6,
                "dur": span["seconds"] * 1e6,
                "pid": pid,
                "tid": span["track"],
                "args": span["args"],
            }
            for span in spans
        ],
        "displayTimeUnit": "ms",
    }


def simulate(
    graphs: list[tuple[str, fx.GraphModule, list]],
    links: Links,
    compute: Compute | float,
    flop_scale: float = 1.0,
) -> StepEstimate:
    """Replay `graphs` (name, graph, its schedule entries in program order) on
    a compute clock and a communication clock: a collective starts when it is
    issued and the link is free, a wait holds compute until its collective is
    done. The timeline merges the compute between two such events into one span.

    OSP's stage 2 has no wait: the step ends when compute and stage 1 are done
    (and not before the link could carry all of its bytes), and in the steady
    state the previous step's stage 2 still holds the link for as long as it
    outlived that end (a second replay starts with it).

    `compute`: the device's rates, or a FLOP rate alone (bytes not charged);
    `flop_scale`: the tokens computed over the tokens traced."""
    if not isinstance(compute, Compute):
        compute = Compute(compute)
    estimate, spill = _replay(graphs, links, compute, flop_scale, 0.0)
    if spill == 0.0:  # always without stage 2: every collective is waited
        return estimate
    return _replay(graphs, links, compute, flop_scale, spill)[0]


def _replay(graphs, links, rates: Compute, flop_scale, carried: float):
    """(the estimate, how long stage 2 outlives the step) with the link busy
    for `carried` seconds at the start."""
    from zppc.schedule import schedule_points

    compute = stage1_done = 0.0
    comm_free = carried
    busy_compute, busy_comm = 0.0, carried
    timeline = [Span("communication", "stage 2 of the previous step", "", 0.0, carried)] * (
        carried > 0
    )
    for name, gm, entries in graphs:
        points = schedule_points(gm.graph)
        done_at: dict[fx.Node, float] = {}
        issue_of: dict[fx.Node, list] = {}  # one node may issue several (OSP's qgZ hops)
        for p, e in zip(points, entries, strict=True):
            issue_of.setdefault(p.issue, []).append((p, e))
        waits = {p.wait for p in points if p.wait is not None}
        span_start, span_flops = compute, 0
        for node in gm.graph.nodes:
            if node not in issue_of and node not in waits:
                flops = node_flops(node) * flop_scale
                seconds = rates.seconds_of(node, flops)
                compute += seconds
                busy_compute += seconds
                span_flops += flops
                continue
            timeline.extend(_compute_span(name, span_start, compute, span_flops))
            if node in issue_of:
                for point, entry in issue_of[node]:
                    cost = collective_seconds(links, entry)
                    start = max(compute, comm_free)
                    comm_free = start + cost
                    if point.wait is not None:
                        done_at[point.wait] = comm_free
                        stage1_done = max(stage1_done, comm_free)
                    busy_comm += cost
                    timeline.append(_communication_span(name, entry, start, cost))
                    if point.wait is node:  # an RTP ring op: its transfers overlap its compute
                        seconds = rates.seconds(node, flop_scale)
                        busy_compute += seconds
                        timeline.append(Span("compute", str(node.target), name, start, seconds))
                        compute = max(start + seconds, comm_free)
            else:
                compute = max(compute, done_at[node])
            span_start, span_flops = compute, 0
        timeline.extend(_compute_span(name, span_start, compute, span_flops))
    # The link carries every step's bytes, stage 2 included, once per step.
    end = max(compute, stage1_done, busy_comm - carried)
    estimate = StepEstimate(busy_compute, busy_comm - carried, end, tuple(timeline))
    return estimate, max(0.0, comm_free - end)


def collective_seconds(links: Links, entry) -> float:
    """A scheduled collective's time on the links. An RTP ring moves in
    lockstep, so each of its steps waits for the slowest hop: across nodes if
    any hop is (then its node's link carries bytes)."""
    if not entry.ring:
        inter = entry.node_link_bytes if links.inter_per_node else entry.inter_node_bytes
        # gloo's own reduce-scatter is an all-reduce underneath.
        factor = 2 if links.gloo and entry.kind == "reduce_scatter" and not entry.two_hops else 1
        return links.seconds(factor * entry.intra_node_bytes, factor * inter)
    if entry.node_link_bytes:
        return links.seconds(0, entry.bytes_per_peer)
    return links.seconds(entry.bytes_per_peer, 0)


def _compute_span(graph: str, start: float, end: float, flops: float) -> list[Span]:
    return [Span("compute", "compute", graph, start, end - start, {"flops": flops})] * (end > start)


def _communication_span(graph: str, entry, start: float, seconds: float) -> Span:
    args = {"intra_node_bytes": entry.intra_node_bytes, "inter_node_bytes": entry.inter_node_bytes}
    return Span(
        "communication", f"{entry.kind} ({entry.group_size} ranks)", graph, start, seconds, args
    )


def device_rates(
    device: str | None,
    tflops: float | None,
    half_precision: bool,
    memory_bytes_per_second: float | str | None = None,
) -> Compute:
    """The compute rates: `tflops` if given, else the device's published peak
    for the parameter dtype. Bytes are charged only with a memory rate: bytes/s,
    or "device" for the device's published bandwidth. Each op is charged as the
    eager lowering runs it; Inductor fuses chains of pointwise ops into one
    kernel that reads and writes once, so on a GPU the charge is an upper bound
    (and FLOPs only the lower one)."""
    if device not in DEVICES and (tflops is None or memory_bytes_per_second == "device"):
        raise ValueError(f"unknown device {device!r}; known: {sorted(DEVICES)}")
    if memory_bytes_per_second == "device":
        memory_bytes_per_second = DEVICES[device][2]
    if tflops is not None:
        if tflops <= 0:
            raise ValueError(f"--tflops must be positive, got {tflops}")
        return Compute(tflops * 1e12, memory_bytes_per_second)
    tensor, fp32, _ = DEVICES[device]
    return Compute(tensor if half_precision else fp32, memory_bytes_per_second)
