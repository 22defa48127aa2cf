"""zppc's graph passes: one function `(gm, ctx) -> gm` each, in one ordered list.

`build_passes(config)` is the only place that decides which passes run and in
which order; `run_passes` applies them to one graph, lints the graph after each
pass, and records a snapshot and the op-count difference of every pass for
`zppc.inspect` (and the log, with `Config(log_passes=True)`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import fx

from zppc.config import MAX_BUCKET_BYTES

# Every pass zppc knows, in pipeline order. Config.disable_passes is checked
# against this tuple, so it must not import anything heavy.
PASS_NAMES = (
    "dedupe_unshard",
    "rtp",
    "osp",
    "zero",
    "qwz",
    "bucket",
    "qgz",
    "reduce_scatter",
    "sync_buffers",
    "reduction_groups",
    "gather_hops",
    "lanes",
    "overlap",
)

log = logging.getLogger("zppc.passes")


@dataclass(frozen=True)
class Plan:
    """What a plan being compiled stands for (see `planning`)."""

    kernels: str
    backend: str


_PLANNING: ContextVar[Plan | None] = ContextVar("zppc_planning", default=None)
PLAN_KERNELS = ("triton", "torch")
PLAN_BACKENDS = ("nccl", "gloo")


@contextmanager
def planning(kernels: str = "triton", backend: str = "nccl") -> Iterator[None]:
    """Compiles inside this block serve a plan (`zppc schedule`) and nothing
    else: passes keep no per-pass code (unless ZPPC_DUMP_DIR asks for it), and
    the eager lowering returns empty outputs instead of executing the graph.
    On meta tensors execution computes nothing, and at 40 layers the graphs
    hold tens of thousands of ops whose code generation and op-by-op dispatch
    made most of a plan's time.

    `kernels`: how the plan lowers quantization: "triton", zppc's custom ops
    as a GPU compile does; "torch", the reference's aten ops as a CPU run
    executes them (the graph whose ops a CPU cluster's cost model charges).
    `backend`: the backend whose algorithms the passes choose for (the plan's
    groups are the fake process group's)."""
    if kernels not in PLAN_KERNELS:
        raise ValueError(f"planning(kernels=...) must be one of {PLAN_KERNELS}, got {kernels!r}")
    if backend not in PLAN_BACKENDS:
        raise ValueError(f"planning(backend=...) must be one of {PLAN_BACKENDS}, got {backend!r}")
    token = _PLANNING.set(Plan(kernels, backend))
    try:
        yield
    finally:
        _PLANNING.reset(token)


def is_planning() -> bool:
    return _PLANNING.get() is not None


def planned_backend() -> str | None:
    """The backend the plan being compiled stands for (None: not a plan)."""
    plan = _PLANNING.get()
    return plan.backend if plan else None


def planned_kernels() -> str | None:
    """The quantization kernels the plan being compiled lowers to (None: not a plan)."""
    plan = _PLANNING.get()
    return plan.kernels if plan else None


@dataclass(frozen=True)
class GraphPass:
    """A pass and the graphs it applies to ("dynamo", "forward", "backward")."""

    name: str
    fn: Callable[[fx.GraphModule, PassContext], fx.GraphModule]
    graphs: tuple[str, ...]


@dataclass
class PassRecord:
    """What one pass did to one graph."""

    name: str
    added: dict[str, int]
    removed: dict[str, int]
    code: str | None
    """The graph's code after the pass; None in a plan (see `planning`)."""
    seconds: float = 0.0
    """Wall time of the pass (compile-time budget: passes must stay linear)."""


@dataclass
class PassContext:
    """What a pass may know: the config, which graph it is looking at, and the
    model's `DistributedState` (None for a model compiled without `distribute`)."""

    config: object
    graph_kind: str
    records: list[PassRecord] = field(default_factory=list)
    state: object = None
    buffer_inputs: tuple[int, ...] = ()
    """Positions of the model's buffers among the graph's inputs (dynamo's
    order, which aot_autograd's forward keeps)."""
    input_fqns: tuple[str | None, ...] = ()
    """Per graph input (the same order): the parameter whose flat shard it is,
    or None. A backward's outputs are the gradients of these inputs."""

    @property
    def groups(self):
        """The model's process groups, by name."""
        return self.state.groups

    @property
    def bucket_bytes(self) -> int:
        """`Config.bucket_bytes`, or for None the cap `distribute` derived from
        the model's repeated block (`block_bucket_bytes`)."""
        if self.config.bucket_bytes is not None:
            return self.config.bucket_bytes
        if self.state is not None:
            return self.state.block_bucket_bytes
        return MAX_BUCKET_BYTES

    @property
    def edge_bucket_bytes(self) -> int | None:
        """The cap of a graph's edge buckets (`zppc.passes.bucket`): half a
        bucket, or half a repeated block where a larger `Config.bucket_bytes`
        would hold more (an exposed edge should not grow with the cap); None
        with `Config.edge_buckets` off."""
        if not self.config.edge_buckets:
            return None
        block = self.state.block_bytes if self.state is not None else 0
        return min(self.bucket_bytes, block or self.bucket_bytes) // 2

    @property
    def kept_gathered_bytes(self) -> int:
        """Gathered bytes zero3 keeps from forward to backward:
        `Config.keep_gathered_bytes`, or where larger `Config.keep_last_block`'s
        budget: one repeated block's bytes, no more than the `prefetch + 1`
        buckets the backward's start would hold re-gathering them."""
        config = self.config
        if config.strategy != "zero3" or not config.keep_last_block or self.state is None:
            return config.keep_gathered_bytes
        last_block = min(self.state.block_bytes, (config.prefetch + 1) * self.bucket_bytes)
        return max(config.keep_gathered_bytes, last_block)


def build_passes(config) -> list[GraphPass]:
    """The ordered pass list for `config`."""
    from zppc.passes.bucket import bucket_pass
    from zppc.passes.dedupe import dedupe_unshard_pass
    from zppc.passes.gather_hops import gather_hops_pass
    from zppc.passes.lanes import lanes_pass
    from zppc.passes.osp import osp_pass
    from zppc.passes.overlap import overlap_pass
    from zppc.passes.qgz import qgz_pass
    from zppc.passes.qwz import qwz_pass
    from zppc.passes.reduce_scatter import reduce_scatter_pass
    from zppc.passes.reduction_groups import reduction_groups_pass
    from zppc.passes.rtp import rtp_pass
    from zppc.passes.sync_buffers import sync_buffers_pass
    from zppc.passes.zero import zero_pass

    passes = [
        GraphPass("dedupe_unshard", dedupe_unshard_pass, ("dynamo",)),
    ]
    if config.strategy == "rtp":
        passes.append(GraphPass("rtp", rtp_pass, ("dynamo",)))
    if config.osp is not None:
        passes.append(GraphPass("osp", osp_pass, ("backward",)))
    passes.append(GraphPass("zero", zero_pass, ("forward", "backward")))
    if config.qwz is not None:
        passes.append(GraphPass("qwz", qwz_pass, ("forward", "backward")))
    passes.append(GraphPass("bucket", bucket_pass, ("forward", "backward")))
    if config.qgz is not None:
        passes.append(GraphPass("qgz", qgz_pass, ("backward",)))
    if config.reduce_scatter != "native":
        passes.append(GraphPass("reduce_scatter", reduce_scatter_pass, ("backward",)))
    if config.buffer_sync is not None:
        passes.append(GraphPass("sync_buffers", sync_buffers_pass, ("forward",)))
    passes.append(GraphPass("reduction_groups", reduction_groups_pass, ("forward", "backward")))
    passes.append(GraphPass("gather_hops", gather_hops_pass, ("forward", "backward")))
    passes.append(GraphPass("lanes", lanes_pass, ("forward", "backward")))
    passes.append(GraphPass("overlap", overlap_pass, ("forward", "backward")))
    return [p for p in passes if p.name not in config.disable_passes]


def lint(gm: fx.GraphModule, graph_kind: str) -> None:
    """The invariants every pass must leave: a valid graph, fake values current."""
    gm.graph.lint()
    if graph_kind == "dynamo":
        return
    for node in gm.graph.nodes:
        # Higher-order ops (activation checkpointing's rng state) come from
        # aot_autograd without fake values; every op node must have one.
        is_hop = isinstance(node.target, torch._ops.HigherOrderOperator)
        # Ops that return nothing (zppc::defer_grad) get no fake value from aot_autograd.
        returns_nothing = (
            isinstance(node.target, torch._ops.OpOverload) and not node.target._schema.returns
        )
        if (
            node.op in ("call_function", "placeholder")
            and not (is_hop or returns_nothing)
            and "val" not in node.meta
        ):
            raise AssertionError(
                f"node {node.name} ({node.target}) has no meta['val'] after a pass"
            )


def run_passes(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    from zppc.passes.graph_utils import FAKE_MODE_META, op_census

    if ctx.config.log_passes and not log.handlers:
        log.addHandler(logging.StreamHandler())
        log.setLevel(logging.INFO)

    snapshots = not is_planning() or bool(os.environ.get("ZPPC_DUMP_DIR"))
    ctx.records.append(PassRecord("input", {}, {}, gm.code if snapshots else None))
    for p in build_passes(ctx.config):
        if ctx.graph_kind not in p.graphs:
            continue
        before = op_census(gm.graph)
        start = time.perf_counter()
        gm = p.fn(gm, ctx)
        if ctx.graph_kind != "dynamo":
            # Only aot graphs are functional. In the dynamo graph an in-place
            # method with no users (BatchNorm's `num_batches_tracked.add_(1)`)
            # looks dead to FX, and removing it loses the buffer update.
            gm.graph.eliminate_dead_code()
        lint(gm, ctx.graph_kind)
        if snapshots:
            gm.recompile()
        seconds = time.perf_counter() - start
        after = op_census(gm.graph)
        code = gm.code if snapshots else None
        record = PassRecord(p.name, dict(after - before), dict(before - after), code, seconds)
        ctx.records.append(record)
        if ctx.config.log_passes:
            log.info(
                "zppc pass %s on %s graph (%.3f s): +%s -%s",
                p.name,
                ctx.graph_kind,
                seconds,
                record.added,
                record.removed,
            )
    if not snapshots:
        gm.recompile()
    # GraphBuilder's per-graph cache of the fake mode: left in the graph's meta it
    # makes Inductor's FX graph cache key unpicklable, and the cache is bypassed.
    gm.meta.pop(FAKE_MODE_META, None)
    return gm
