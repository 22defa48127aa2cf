"""zppc's partition function: split the joint graph so ZeRO-3 keeps its promise.

The stock partitioners save a gathered weight for backward (the default one) or
merge duplicate gathers back together with CSE (min-cut). Under zero3 the
forward must save no full weight: before the default partition runs, every
backward use of a zero3 `unshard` (directly, or through view ops such as the
transpose a linear layer's backward needs) is rewired to a fresh copy of that
chain. The copy depends only on the shard, a graph input, so the partition puts
it in the backward graph and saves the shard instead: the backward re-gathers.
zero1 / zero2 / ddp keep the gathered weight for backward (that is the
difference between zero2 and zero3). With hpZ the copy starts from a secondary
shard over the node instead (see `regather_in_backward`).
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx
from torch._functorch.partitioners import default_partition
from zppc.passes.graph_utils import SECONDARY_SHARD, UNSHARD, UNSHARD_SECONDARY, GraphBuilder
from zppc.passes.zero import KEPT_GATHERED

aten = torch.ops.aten
VIEW_OPS = {
    aten.t.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.permute.default,
    aten.transpose.int,
    aten.expand.default,
    aten.alias.default,
    aten.slice.Tensor,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    # A weight sliced into parts (attention's packed projection when query is
    # not key): the split, then each part.
    aten.split.Tensor,
    aten.split_with_sizes.default,
    operator.getitem,
}


def forward_nodes(joint: fx.Graph, num_fwd_outputs: int) -> set[fx.Node]:
    """Nodes the forward outputs depend on."""
    outputs = joint.find_nodes(op="output")[0].args[0][:num_fwd_outputs]
    seen: set[fx.Node] = set()
    stack = [n for n in outputs if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _regathers(node: fx.Node) -> bool:
    """Whether `node` is a zero3 gather, or a view chain over one."""
    if node.op != "call_function":
        return False
    if node.target == UNSHARD:
        return node.args[3] in ("zero3", "rtp")  # rtp: a use the ring does not cover
    return node.target in VIEW_OPS and _regathers(node.args[0])


def gathered_bytes(unshard: fx.Node) -> int:
    """Bytes of the full weight a `zppc::unshard` materializes."""
    shard_val = unshard.args[0].meta["val"]
    dtype = unshard.args[4] or shard_val.dtype
    return math.prod(unshard.args[1]) * dtype.itemsize


def weights_to_keep(needed: list[fx.Node], budget: int) -> list[fx.Node]:
    """The zero3 gathers (of those the backward `needed`, in the order of their
    last forward use) whose full weights the forward saves for backward instead
    of re-gathering: the last read in forward first (the backward needs them
    first, before any compute could hide their re-gather; a tied output head
    reads the embedding gathered first), while their gathered bytes fit in
    what is left of `budget`. A weight larger than the whole budget is passed
    over, not an end: GPT-2's tied embedding (154 MB, read last by the head)
    left its last block (28 MB, the one-block budget of `keep_last_block`)
    re-gathered with nothing kept at all. Returned last read first."""
    kept: list[fx.Node] = []
    left = budget
    for node in reversed(needed):
        size = gathered_bytes(node)
        if size > budget:
            continue
        if size > left:
            break
        kept.append(node)
        left -= size
    return kept


def order_of(graph: fx.Graph):
    position = {n: i for i, n in enumerate(graph.nodes)}
    return position.__getitem__


def _root_gather(node: fx.Node) -> fx.Node:
    while node.target != UNSHARD:
        node = node.args[0]
    return node


def regather_in_backward(
    joint: fx.GraphModule,
    num_fwd_outputs: int,
    hpz_group: str | None = None,
    keep_gathered_bytes: int = 0,
    kept: list | None = None,
) -> int:
    """Give backward users their own copies of zero3 gathers; returns how many.

    Without hpZ a copy re-gathers from the shard (a graph input). With hpZ
    (`hpz_group`: the intra-node group) the forward keeps a secondary shard of
    the gathered weight over the node right after the gather, and the copy
    gathers that inside the node: the partition saves the secondary shard.
    Weights chosen by `weights_to_keep` within `keep_gathered_bytes` are left
    alone (the forward saves them); their (shape, bytes), last read first, go
    into `kept`.
    """
    graph = joint.graph
    fwd = forward_nodes(graph, num_fwd_outputs)
    uses = [
        (node, inp)
        for node in graph.nodes
        if node not in fwd and node.op == "call_function"
        for inp in node.all_input_nodes
        if inp in fwd and _regathers(inp)
    ]
    position = order_of(graph)
    last_forward_use: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node in fwd and node.op == "call_function" and not _regathers(node):
            for inp in node.all_input_nodes:
                if _regathers(inp):
                    last_forward_use[_root_gather(inp)] = position(node)
    needed = sorted(
        {_root_gather(inp) for _, inp in uses},
        key=lambda g: (last_forward_use.get(g, position(g)), position(g)),
    )
    keep = weights_to_keep(needed, keep_gathered_bytes)
    if kept is not None:
        kept.extend((tuple(n.args[1]), gathered_bytes(n)) for n in keep)
    copies: dict[fx.Node, fx.Node] = {}

    def regather(node: fx.Node, before: fx.Node) -> fx.Node:
        if hpz_group is None:
            with graph.inserting_before(before):
                new = graph.call_function(UNSHARD, node.args, dict(node.kwargs))
            new.meta = dict(node.meta)
            return new
        secondary = GraphBuilder(joint, node.next).call(SECONDARY_SHARD, node, hpz_group)
        secondary.meta["partitioner_tag"] = "is_forward"
        return GraphBuilder(joint, before).call(
            UNSHARD_SECONDARY, secondary, list(node.args[1]), hpz_group
        )

    def copy_chain(node: fx.Node, before: fx.Node) -> fx.Node:
        if node not in copies:
            if node.target == UNSHARD:
                new = regather(node, before)
            else:
                args = (copy_chain(node.args[0], before), *node.args[1:])
                with graph.inserting_before(before):
                    new = graph.call_function(node.target, args, dict(node.kwargs))
                new.meta = dict(node.meta)
            new.meta["partitioner_tag"] = "is_backward"
            copies[node] = new
        return copies[node]

    kept_gathers = set(keep)
    for node, inp in uses:
        if _root_gather(inp) in kept_gathers:
            inp.meta[KEPT_GATHERED] = True  # what the backward's input will be
        else:
            node.replace_input_with(inp, copy_chain(inp, node))
    graph.lint()
    return sum(1 for n in copies if n.target == UNSHARD)


def zppc_partition(
    joint: fx.GraphModule,
    joint_inputs,
    *,
    num_fwd_outputs: int,
    hpz_group: str | None = None,
    keep_gathered_bytes: int = 0,
    kept: list | None = None,
    **kwargs,
):
    regather_in_backward(joint, num_fwd_outputs, hpz_group, keep_gathered_bytes, kept)
    return default_partition(
        joint,
        joint_inputs,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
    )
