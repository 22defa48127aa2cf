"""The links as the collectives see them: rates for the cost model, measured.

`zppc.cost.Links` prices a collective at a link's bytes per second. A link's
nominal speed, or a one-way stream's, is not what a collective gets: on the
emulated gloo cluster an all-gather, with data flowing both ways at once, gets
65-80% of a one-way stream's rate (benchmarks/RESULTS.md). `measure_links`
(every rank calls it; `zppc links` runs it under torchrun) times all-gathers
over the job's own intra- and cross-node groups, the groups and backend a step
uses, and reads each as a rate in the cost model's own terms: the bytes a
collective brings in over a link class, divided by its time less the latency of
an almost empty all-gather. What it returns plugs into `zppc schedule --links`
and `CostModel(links, ...)`; every rank returns the same figures (the slowest
rank's time of each repeat, then the median), so a cost model built from them
plans the same graph on every rank.

`measure_compute` does the same for the compute rates (`zppc.cost.Compute`):
a matrix product and an elementwise op timed on every rank at once, the
slowest rank's, so ranks sharing cores or a device are measured as they run.
`measure_cost_model` puts both together: a `CostModel` for `Config.cost_model`
with no rate written by hand.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from zppc.cost import DEFAULT_LINKS, Compute, CostModel, Links
from zppc.runtime import compat
from zppc.runtime.topology import Topology, default_node_size


@dataclass(frozen=True)
class LinkMeasurement:
    """What `measure_links` timed, and the rates it read from it."""

    backend: str
    world_size: int
    node_size: int
    message_bytes: int
    """What each rank contributed to a timed all-gather."""
    repeats: int
    latency_seconds: float
    """Median time of an all-gather of 4 bytes a rank over the world group."""
    intra_seconds: float | None
    """Median time of the all-gather inside each node, all nodes at once (None:
    one rank per node)."""
    intra_latency_seconds: float | None
    """Median time of an all-gather of 4 bytes a rank inside each node: not
    counted as transfer time (at most half the all-gather's time is)."""
    inter_seconds: float | None
    """Median time of the all-gather across the nodes, every local index at
    once (None: one node)."""
    inter_latency_seconds: float | None
    """The same across the nodes."""
    intra_bytes_per_second: float | None
    inter_bytes_per_second: float | None
    inter_per_node: bool
    """Whether the inter-node rate is the node's one link (the bytes entering
    the node) or each rank's own (the bytes it receives)."""
    flops_per_second: float | None = None
    """`measure_compute`'s FLOP rate, where it was measured too (`zppc links
    --compute`); None otherwise."""
    memory_bytes_per_second: float | None = None
    """`measure_compute`'s memory rate, likewise."""
    compute_dtype: str | None = None
    """The dtype the compute rates were measured in."""

    def links(self, fallback: Links) -> Links:
        """The cost model's links: the measured rates and latency, `fallback`'s
        rate for a link class this job has none of."""
        return Links(
            self.intra_bytes_per_second or fallback.intra_bytes_per_second,
            self.inter_bytes_per_second or fallback.inter_bytes_per_second,
            self.latency_seconds,
            inter_per_node=self.inter_per_node,
            gloo=self.backend == "gloo",
        )

    def schedule_settings(self, exact: bool = False) -> dict[str, str]:
        """The `zppc schedule` settings these links (and compute rates, where
        measured) give, by option name (`intra_bw`, ..., `tflops`,
        `memory_bw`): rounded to read and type, or `exact`."""
        rate = (lambda r: f"{r}B/s") if exact else (lambda r: f"{r / 1e6:.4g}MB/s")
        latency = self.latency_seconds
        settings = {"latency": f"{latency}s" if exact else f"{latency * 1e6:.0f}us"}
        if self.intra_bytes_per_second:
            settings["intra_bw"] = rate(self.intra_bytes_per_second)
        if self.inter_bytes_per_second:
            settings["inter_bw"] = rate(self.inter_bytes_per_second)
        settings["inter_link"] = "node" if self.inter_per_node else "rank"
        settings["backend"] = "gloo" if self.backend == "gloo" else "nccl"
        if self.flops_per_second and self.memory_bytes_per_second:
            tflops = self.flops_per_second / 1e12
            settings["tflops"] = repr(tflops) if exact else f"{tflops:.4g}"
            settings["memory_bw"] = rate(self.memory_bytes_per_second)
        return settings

    def schedule_flags(self) -> list[str]:
        """The `zppc schedule` flags that plan with these links."""
        return [f"--{k.replace('_', '-')}={v}" for k, v in self.schedule_settings().items()]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LinkMeasurement:
        try:
            fields = json.loads(Path(path).read_text())
            return cls(**fields)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"cannot read a link measurement from {path}: {exc}") from None


def measure_links(
    message_bytes: int = 4 * 2**20,
    repeats: int = 5,
    node_size: int | None = None,
    inter_per_node: bool = False,
) -> LinkMeasurement:
    """Time all-gathers inside and across the nodes (collective: every rank
    calls it with the same arguments, after `init_process_group`). Nodes are
    blocks of `node_size` consecutive ranks (default LOCAL_WORLD_SIZE).
    `inter_per_node`: the node's ranks share one inter-node link (a CPU
    cluster's NIC), so the rate is the bytes entering the node; otherwise each
    rank has its own (a GPU per NIC) and the rate is the bytes it receives."""
    if not dist.is_initialized():
        raise ValueError("measure_links needs torch.distributed initialised (run under torchrun)")
    world = dist.get_world_size()
    node_size = node_size or default_node_size(world)
    if message_bytes < 4 or repeats < 1:
        raise ValueError(
            f"measure_links needs message_bytes >= 4 and repeats >= 1, got {message_bytes}, {repeats}"
        )
    if world % node_size:
        raise ValueError(
            f"measure_links needs world_size % node_size == 0, got {world} % {node_size}"
        )
    topology = Topology(world, node_size)
    nodes = topology.num_nodes
    backend = dist.get_backend()
    device = _job_device()
    # Every rank creates every group, in the same order.
    intra, _ = dist.new_subgroups_by_enumeration(topology.intra_node_groups())
    cross, _ = dist.new_subgroups_by_enumeration(topology.cross_node_groups())
    try:
        latency = _median_seconds(dist.group.WORLD, 4, repeats, device)
        intra_seconds, intra_latency, intra_rate = (
            _timed_rate(intra, message_bytes, repeats, device, node_size - 1)
            if node_size > 1
            else (None, None, None)
        )
        sharing = node_size if inter_per_node else 1
        inter_seconds, inter_latency, inter_rate = (
            _timed_rate(cross, message_bytes, repeats, device, sharing * (nodes - 1))
            if nodes > 1
            else (None, None, None)
        )
    finally:
        for group in (intra, cross):
            dist.destroy_process_group(group)
    return LinkMeasurement(
        backend=backend,
        world_size=world,
        node_size=node_size,
        message_bytes=message_bytes,
        repeats=repeats,
        latency_seconds=latency,
        intra_seconds=intra_seconds,
        intra_latency_seconds=intra_latency,
        inter_seconds=inter_seconds,
        inter_latency_seconds=inter_latency,
        intra_bytes_per_second=intra_rate,
        inter_bytes_per_second=inter_rate,
        inter_per_node=inter_per_node,
    )


def _timed_rate(
    group: dist.ProcessGroup, nbytes: int, repeats: int, device: torch.device, chunks_in: int
) -> tuple[float, float, float]:
    """(the median time of an all-gather of `nbytes` a rank over `group`, that
    of one of 4 bytes, the rate of the `chunks_in` chunks it brings over the
    link it measures). The
    group's own latency (an all-gather of 4 bytes on it) is not transfer time;
    at most half the time counts as latency, so a message too small for the
    link reads as a rate too low, never as an infinite one."""
    seconds = _median_seconds(group, nbytes, repeats, device)
    latency = _median_seconds(group, 4, repeats, device)
    return seconds, latency, chunks_in * nbytes / max(seconds - latency, seconds / 2)


def _median_seconds(
    group: dist.ProcessGroup, nbytes: int, repeats: int, device: torch.device
) -> float:
    """The median over `repeats` of the slowest rank's time for one all-gather
    of `nbytes` a rank over `group` (after one untimed)."""
    mine = torch.ones(nbytes, dtype=torch.uint8, device=device)
    out = torch.empty(nbytes * group.size(), dtype=torch.uint8, device=device)
    return _slowest_median(
        lambda: compat.all_gather_single(out, mine, group=group), repeats, device
    )


def _slowest_median(run, repeats: int, device: torch.device) -> float:
    """The median over `repeats` of the slowest rank's time for `run()`, every
    rank starting each run together (after one untimed run)."""
    times = torch.zeros(repeats, dtype=torch.float64, device=device)
    for i in range(-1, repeats):
        dist.barrier()
        _synchronize(device)
        start = time.perf_counter()
        run()
        _synchronize(device)
        if i >= 0:
            times[i] = time.perf_counter() - start
    # A collective ends for everyone when its slowest rank is done; a plan
    # every rank shares must take the slowest rank's compute too.
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return statistics.median(times.tolist())


# Square matrix products big enough to run a device near its rate: a
# 1024-wide one is 2.1 GFLOP (tens of ms on a CPU thread), a 4096-wide one
# 137 GFLOP (a fraction of a ms on an H100).
MATMUL_SIDE = {"cpu": 1024, "cuda": 4096}
ELEMENTWISE_BYTES = 64 * 2**20


def measure_compute(dtype: torch.dtype = torch.float32, repeats: int = 11) -> Compute:
    """This job's compute rates, as its ranks get them running together
    (collective: every rank calls it with the same arguments, after
    `init_process_group`; CPU on gloo, the current CUDA device on NCCL, with
    this process's thread count). FLOP/s: a square matrix product in `dtype`;
    bytes/s: an elementwise add, bytes read and written counted as
    `zppc.cost.node_bytes` counts them. Each the median of `repeats` runs
    every rank starts together, of the slowest rank: every rank gets the
    same rates."""
    _check_compute_arguments("measure_compute", dtype, repeats)
    device = _job_device()
    side = MATMUL_SIDE[device.type]
    a = torch.randn(side, side, device=device).to(dtype)
    b = torch.randn(side, side, device=device).to(dtype)
    product = torch.empty(side, side, dtype=dtype, device=device)
    matmul = _slowest_median(lambda: torch.mm(a, b, out=product), repeats, device)
    x = torch.ones(ELEMENTWISE_BYTES // dtype.itemsize, dtype=dtype, device=device)
    y = torch.empty_like(x)
    add = _slowest_median(lambda: torch.add(x, 1, out=y), repeats, device)
    return Compute(2 * side**3 / matmul, 2 * ELEMENTWISE_BYTES / add)


def measure_cost_model(
    dtype: torch.dtype = torch.float32,
    node_size: int | None = None,
    inter_per_node: bool = False,
    message_bytes: int = 4 * 2**20,
    repeats: int = 5,
) -> CostModel:
    """A cost model of this job, measured (collective, as `measure_links` and
    `measure_compute`, whose arguments these are): its links, with
    `DEFAULT_LINKS`' rate for a link class it has none of, and its compute in
    `dtype`, the parameters' dtype. For `Config(cost_model=...)`: every rank
    gets the same model, so the `overlap` pass plans the same graph on all."""
    compute_repeats = max(repeats, 5)
    _check_compute_arguments("measure_cost_model", dtype, compute_repeats)  # before any collective
    links = measure_links(message_bytes, repeats, node_size, inter_per_node)
    return CostModel(links.links(DEFAULT_LINKS), measure_compute(dtype, compute_repeats))


def _check_compute_arguments(caller: str, dtype: torch.dtype, repeats: int) -> None:
    if not dist.is_initialized():
        raise ValueError(f"{caller} needs torch.distributed initialised (run under torchrun)")
    if repeats < 1 or not dtype.is_floating_point:
        raise ValueError(
            f"{caller} needs repeats >= 1 and a floating dtype, got {repeats}, {dtype}"
        )


def _job_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
