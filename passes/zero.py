"""The `zero` pass: lower the IR to concrete collectives.

Requires: aot forward or backward graph holding `zppc::unshard` /
`zppc::reduce_grad` nodes (partitioned by `zppc_partition`, so that under zero3
the backward graph re-gathers instead of loading saved full weights).

Guarantees: no IR op is left; each becomes functional collectives, each
preceded by a `zppc::record_comm` ledger hook on its input and followed by its
wait (`CollectiveMatch` finds the three again for later passes):

- unshard, zero*: cast to param_dtype, all-gather of the flat shard, drop the
  padding, view as the parameter's shape. ddp: the parameter itself.
- reduce_grad, zero2/zero3: flatten, pad, reduce-scatter(sum), divide by world.
  zero1: all-reduce(sum) of the padded flat gradient, then this rank's slice.
  ddp: all-reduce(sum), divide by world.
  With qgZ on, every strategy: divide by world, flatten, pad, reduce-scatter
  (tagged `GRAD_REDUCE` for the qgz pass); ddp then all-gathers the shards.

- hpZ's secondary_shard: this rank's node-local slice (chosen at run time);
  unshard_secondary: an all-gather inside the node, unpadded and viewed.

Numerics: identical to the eager IR ops (same collectives, same order of
operations), so compiled results equal eager ones up to reduction order.
Must run first among the lowering passes (qwz, bucket, ... rewrite its output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx
from zppc.passes.graph_utils import (
    SECONDARY_SHARD,
    UNSHARD_SECONDARY,
    GraphBuilder,
    ReduceGradMatch,
    UnshardMatch,
    block_unit,
    find_reduce_grads,
    find_unshards,
    replace_node,
)
from zppc.runtime.topology import group_size

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
zppc_ops = torch.ops.zppc


def zero_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    classes = ctx.state.block_classes if ctx.state is not None else frozenset()
    for match in find_unshards(gm.graph):
        unit = block_unit(match.node, classes)
        replace_node(match.node, lower_unshard(gm, match, unit))
    for node in gm.graph.find_nodes(op="call_function", target=SECONDARY_SHARD):
        replace_node(node, lower_secondary_shard(gm, node))
    for node in gm.graph.find_nodes(op="call_function", target=UNSHARD_SECONDARY):
        unit = block_unit(node, classes)
        replace_node(node, lower_unshard_secondary(gm, node, unit))
    two_hop = ctx.config.qgz is not None
    for match in find_reduce_grads(gm.graph):
        unit = block_unit(match.node, classes)
        replace_node(match.node, lower_reduce_grad(gm, match, two_hop, unit))
    return gm


def cast(b: GraphBuilder, node: fx.Node, dtype: torch.dtype | None) -> fx.Node:
    if dtype is None or node.meta["val"].dtype == dtype:
        return node
    return b.call(torch.ops.prims.convert_element_type.default, node, dtype)


def collective(b: GraphBuilder, kind: str, group_name: str, op, *args) -> fx.Node:
    """Report a functional collective to the ledger from its input, issue it,
    and wait for it; returns the wait. The ledger never reads the result, so
    counting keeps no buffer alive and constrains no schedule."""
    b.call(zppc_ops.record_comm.default, args[0], kind, group_name)
    return b.call(c10d.wait_tensor.default, b.call(op, *args))


RECORD = zppc_ops.record_comm.default
COLLECTIVE_KINDS = {
    c10d.all_gather_into_tensor.default: "all_gather",
    zppc_ops.all_gather_in_place.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    zppc_ops.reduce_scatter_in_two_hops.default: "reduce_scatter",
    c10d.all_reduce.default: "all_reduce",
    c10d.all_to_all_single.default: "all_to_all",
    c10d.broadcast.default: "broadcast",
}


@dataclass(frozen=True)
class CollectiveMatch:
    """One collective as `collective` emits it: ledger hook, issue and wait."""

    record: fx.Node
    issue: fx.Node
    wait: fx.Node
    kind: str
    group_name: str

    @property
    def input(self) -> fx.Node:
        return self.issue.args[0]

    @property
    def input_bytes(self) -> int:
        val = self.input.meta["val"]
        return val.numel() * val.element_size()

    @property
    def dtype(self) -> torch.dtype:
        return self.input.meta["val"].dtype

    def move_to_group(self, group_name: str) -> None:
        """Run the collective, and count it, on another group over the same ranks
        (the group's name is the last argument of the ledger hook and of the issue)."""
        self.record.update_arg(len(self.record.args) - 1, group_name)
        self.issue.update_arg(len(self.issue.args) - 1, group_name)

    def replace_with(self, result: fx.Node) -> None:
        """Route every user of the collective's result to `result`; erase the three."""
        self.wait.replace_all_uses_with(result)
        self.erase()

    def erase(self) -> None:
        """Remove the three nodes (the result must have no user left)."""
        for node in (self.wait, self.issue, self.record):
            node.graph.erase_node(node)


def find_collectives(graph: fx.Graph) -> list[CollectiveMatch]:
    """Every lowered collective, in program order of its ledger hook. A hook's
    collective is the first matching one issued after it on the same input
    (activation checkpointing can gather one shard twice in a backward)."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    claimed: set[fx.Node] = set()
    matches = []
    for record in graph.find_nodes(op="call_function", target=RECORD):
        inp, kind, group_name = record.args
        issues = sorted(
            (
                u
                for u in inp.users
                if COLLECTIVE_KINDS.get(u.target) == kind
                and u.args[-1] == group_name
                and u not in claimed
                and position[u] > position[record]
            ),
            key=position.__getitem__,
        )
        if not issues:
            raise AssertionError(f"ledger hook {record.name} matches no collective")
        claimed.add(issues[0])
        (wait,) = issues[0].users
        matches.append(CollectiveMatch(record, issues[0], wait, kind, group_name))
    return matches


def all_gather(b: GraphBuilder, flat: fx.Node, group_name: str) -> fx.Node:
    world = group_size(group_name)
    return collective(
        b, "all_gather", group_name, c10d.all_gather_into_tensor.default, flat, world, group_name
    )


def gather_in_place(gm: fx.GraphModule) -> fx.GraphModule:
    """Lowering step, after every pass: each functional all-gather becomes
    `zppc::all_gather_in_place` on the same input, whose output buffer holds
    the input's copy (so the input may die at the issue, not at the wait).
    zppc's passes and the schedules they record keep the functional form."""
    for m in find_collectives(gm.graph):
        if m.issue.target is not c10d.all_gather_into_tensor.default:
            continue
        with gm.graph.inserting_before(m.issue):
            issue = gm.graph.call_function(
                zppc_ops.all_gather_in_place.default, (m.input, m.group_name)
            )
        issue.meta.update(m.issue.meta)
        replace_node(m.issue, issue)
    gm.recompile()
    return gm


# meta key on the wait node of every parameter all-gather: later passes (qwz,
# bucket) find the gathers they rewrite by it.
PARAM_GATHER = "zppc_param_gather"
# meta key on a wait node whose collective moves quantized data: the bytes per
# rank the unquantized collective would have moved (the schedule shows both).
UNQUANTIZED_BYTES = "zppc_unquantized_bytes"
# meta key on the wait node of an hpZ gather inside the node (qwz leaves it).
NODE_LOCAL = "zppc_node_local"
# meta key on the wait node of a reduce-scatter of gradients divided by the world
# size beforehand (with qgZ on): its sum is the mean, and qgz rewrites it.
GRAD_REDUCE = "zppc_grad_reduce"
# meta keys on the wait node of a parameter gather or gradient reduction: the
# repeated block whose forward uses the parameter (`block_unit`), or None, and
# the bytes of the full tensor unpadded. Default-sized buckets end at a
# block's boundary (bucket).
BLOCK_UNIT = "zppc_block_unit"
# On a gathered weight the forward saves for the backward (and on the views of
# it the forward saves instead): the backward graph's input carries it too.
KEPT_GATHERED = "zppc_kept_gathered"
UNPADDED_BYTES = "zppc_unpadded_bytes"


def tag_block(wait: fx.Node, unit: str | None, full: fx.Node) -> None:
    """Mark `wait` as moving the parameter or gradient `full` of block `unit`."""
    val = full.meta["val"]
    wait.meta[BLOCK_UNIT] = unit
    wait.meta[UNPADDED_BYTES] = val.numel() * val.element_size()


def unpad_to_shape(b: GraphBuilder, flat: fx.Node, shape: tuple[int, ...], numel: int) -> fx.Node:
    if flat.meta["val"].numel() != numel:
        flat = b.call(aten.slice.Tensor, flat, 0, 0, numel)
    return b.call(aten.view.default, flat, list(shape))


def lower_unshard(gm: fx.GraphModule, m: UnshardMatch, unit: str | None) -> fx.Node:
    b = GraphBuilder(gm, m.node)
    local = cast(b, m.shard, m.param_dtype)
    if m.mode == "ddp":
        return local if local is not m.shard else b.call(aten.alias.default, local)
    gathered = all_gather(b, local, m.group_name)
    gathered.meta[PARAM_GATHER] = True
    full = unpad_to_shape(b, gathered, m.shape, m.numel)
    tag_block(gathered, unit, full)
    return full


def lower_secondary_shard(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """hpZ: this rank's piece of the gathered weight over its node."""
    full, group_name = node.args
    b = GraphBuilder(gm, node)
    numel = full.meta["val"].numel()
    flat = flatten_padded(b, full, -(-numel // group_size(group_name)) * group_size(group_name))
    return b.call(zppc_ops.take_shard.default, flat, group_name)


def lower_unshard_secondary(gm: fx.GraphModule, node: fx.Node, unit: str | None) -> fx.Node:
    """hpZ: the backward's gather, inside the node (never quantized: hpZ already
    keeps it off the slow links)."""
    secondary, shape, group_name = node.args
    b = GraphBuilder(gm, node)
    gathered = all_gather(b, secondary, group_name)
    gathered.meta[PARAM_GATHER] = True
    gathered.meta[NODE_LOCAL] = True
    full = unpad_to_shape(b, gathered, tuple(shape), math.prod(shape))
    tag_block(gathered, unit, full)
    return full


def flatten_padded(b: GraphBuilder, grad: fx.Node, total: int) -> fx.Node:
    if not grad.meta["val"].is_contiguous():
        grad = b.call(aten.clone.default, grad, memory_format=torch.contiguous_format)
    flat = b.call(aten.view.default, grad, [-1])
    missing = total - flat.meta["val"].numel()
    return b.call(aten.constant_pad_nd.default, flat, [0, missing], 0.0) if missing else flat


def lower_reduce_grad(
    gm: fx.GraphModule, m: ReduceGradMatch, two_hop: bool, unit: str | None
) -> fx.Node:
    b = GraphBuilder(gm, m.node)
    world = group_size(m.group_name)
    grad = cast(b, m.grad, m.reduce_dtype)
    if two_hop:
        return cast(b, reduce_for_qgz(b, grad, m, world, unit), m.out_dtype)
    if m.mode == "ddp":
        total = reduced = collective(
            b, "all_reduce", m.group_name, c10d.all_reduce.default, grad, "sum", m.group_name
        )
    else:
        flat = flatten_padded(b, grad, m.shard_numel * world)
        if m.mode == "zero1":
            reduced = collective(
                b, "all_reduce", m.group_name, c10d.all_reduce.default, flat, "sum", m.group_name
            )
            total = b.call(zppc_ops.take_shard.default, reduced, m.group_name)
        else:
            total = reduced = reduce_scatter(b, flat, m.group_name, world)
    tag_block(reduced, unit, grad)
    averaged = b.call(aten.div.Tensor, total, world)
    return cast(b, averaged, m.out_dtype)


def reduce_scatter(b: GraphBuilder, flat: fx.Node, group_name: str, world: int) -> fx.Node:
    return collective(
        b,
        "reduce_scatter",
        group_name,
        c10d.reduce_scatter_tensor.default,
        flat,
        "sum",
        world,
        group_name,
    )


def reduce_for_qgz(
    b: GraphBuilder, grad: fx.Node, m: ReduceGradMatch, world: int, unit: str | None
) -> fx.Node:
    """With qgZ every strategy reduces by one reduce-scatter of the gradient
    divided by the world size beforehand (the sum of the pieces is the mean;
    the qgz pass turns it into its two hops, summed in fp32). zero1 keeps its
    shard of the mean, as zero2/zero3 do; ddp gathers the shards back."""
    numel = grad.meta["val"].numel()
    shard = -(-numel // world) if m.mode == "ddp" else m.shard_numel
    predivided = b.call(aten.div.Tensor, flatten_padded(b, grad, shard * world), world)
    mean = reduce_scatter(b, predivided, m.group_name, world)
    mean.meta[GRAD_REDUCE] = True
    tag_block(mean, unit, grad)
    if m.mode != "ddp":
        return mean
    full = all_gather(b, mean, m.group_name)
    return unpad_to_shape(b, full, tuple(grad.meta["val"].shape), numel)
