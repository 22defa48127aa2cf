"""The `osp` pass: split a backward's gradient reductions into OSP's two stages.

Requires: a backward graph whose gradient reductions are still
`zppc::reduce_grad` (before `zero` lowers them), each feeding the graph's
output at the position of its flat shard's gradient, and the model's OSP state
(`Config.osp` set, `distribute` made it).

Guarantees: the reductions of the gradients the backward produces last (with
`osp_split="magnitude"`: of the gradients of smallest RMS at the first step;
none before that step is measured), as many as bring their bytes closest to
`Config.osp` of the graph's gradient bytes (at least one), become
`zppc::osp_issue` calls, coalesced up to
`Config.bucket_bytes` (stage 2: issued asynchronously on a side group and in
flight past the graph, see `zppc.runtime.osp`); the others stay `reduce_grad`
(stage 1) for the passes after this one.
The choice depends on the graph only, so every rank makes the same one. The
gradients produced last are the first layers': in synchronous training their
reduction is what sits exposed after backward.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx
from zppc.passes.graph_utils import (
    GraphBuilder,
    ReduceGradMatch,
    find_reduce_grads,
    replace_node,
)
from zppc.runtime import osp as osp_runtime  # noqa: F401  (registers zppc::osp_issue)

OSP_ISSUE = torch.ops.zppc.osp_issue.default


@dataclass(frozen=True)
class Stage2Match:
    """One reduction deferred to stage 2 and the parameter it belongs to."""

    reduce: ReduceGradMatch
    fqn: str
    nbytes: int
    order: int
    """Position of the reduction in the graph."""


def osp_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    osp = ctx.state.osp
    if ctx.config.osp_split == "magnitude" and osp.magnitudes is None:
        return gm  # the measuring step: synchronous
    chosen = choose_stage2(gm.graph, ctx.input_fqns, ctx.config.osp, osp.magnitudes)
    for bucket in stage2_buckets(chosen, ctx.bucket_bytes):
        # Issued where the bucket's last gradient is reduced today: all of its
        # gradients exist there.
        last = max(bucket, key=lambda m: m.order).reduce
        b = GraphBuilder(gm, last.node)
        issued = b.call(
            OSP_ISSUE,
            [m.reduce.grad for m in bucket],
            osp.index,
            "\n".join(m.fqn for m in bucket),
            [m.reduce.shard_numel for m in bucket],
            last.mode,
            last.reduce_dtype,
            last.out_dtype,
        )
        for i, m in enumerate(bucket):
            replace_node(m.reduce.node, b.call(operator.getitem, issued, i))
            osp.stage2.add(m.fqn)
    return gm


def stage2_buckets(chosen: list[Stage2Match], bucket_bytes: int) -> list[list[Stage2Match]]:
    """Consecutive stage-2 reductions coalesced up to `bucket_bytes`; one
    bucket holds one kind of reduction (mode and dtypes)."""
    buckets: list[list[Stage2Match]] = []
    for m in sorted(chosen, key=lambda m: m.order):
        r = m.reduce
        key = (r.mode, r.reduce_dtype, r.out_dtype)
        if buckets:
            head = buckets[-1][0].reduce
            same_kind = key == (head.mode, head.reduce_dtype, head.out_dtype)
            if same_kind and sum(x.nbytes for x in buckets[-1]) + m.nbytes <= bucket_bytes:
                buckets[-1].append(m)
                continue
        buckets.append([m])
    return buckets


def choose_stage2(
    graph: fx.Graph,
    input_fqns: tuple[str | None, ...],
    fraction: float,
    magnitudes: dict[str, float] | None = None,
) -> list[Stage2Match]:
    """The stage-2 reductions, in the order they were taken: last produced
    first or, given each parameter's gradient `magnitudes`, smallest first
    (ties: last produced first)."""
    (output,) = graph.find_nodes(op="output")
    position = {id(v): i for i, v in enumerate(output.args[0]) if isinstance(v, fx.Node)}
    order = {node: i for i, node in enumerate(graph.nodes)}
    matches = []
    for r in sorted(find_reduce_grads(graph), key=lambda r: order[r.node]):
        if id(r.node) not in position or input_fqns[position[id(r.node)]] is None:
            raise AssertionError(
                f"osp: reduction {r.node.name} is not the gradient of a zppc parameter input"
            )
        val = r.grad.meta["val"]
        nbytes = val.numel() * val.element_size()
        matches.append(Stage2Match(r, input_fqns[position[id(r.node)]], nbytes, order[r.node]))
    budget = fraction * sum(m.nbytes for m in matches)
    candidates = list(reversed(matches))
    if magnitudes is not None:
        candidates.sort(key=lambda m: magnitudes[m.fqn])  # stable: ties keep the order
    chosen, taken = [], 0
    for m in candidates:
        if chosen and abs(taken + m.nbytes - budget) >= abs(taken - budget):
            break
        chosen.append(m)
        taken += m.nbytes
    return chosen
