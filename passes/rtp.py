"""The `rtp` pass: uses of rotated weights become ring loops.

Requires: the dynamo graph (before aot_autograd, after `dedupe_unshard`), with
`zppc::unshard(..., mode="rtp")` for every rotated weight (`distribute` gives
that mode to the weights of `nn.Linear` and `nn.Embedding` modules; every other
parameter is replicated, mode "ddp").

Rewrites, for each rotated weight W = unshard(shard):
- `linear(x, W, b)` -> `zppc::rtp_linear(x, shard, b)`;
- `embedding(indices, W, padding_idx)` (no max_norm, scale_grad_by_freq or
  sparse) -> `zppc::rtp_embedding(indices, shard, padding_idx)`.

Why rows for every layer: each rank applies every shard to its own micro-batch,
so a ring op ends with the layer's whole output for that micro-batch whichever
way the weight is split; splitting by output rows fills disjoint output
columns (no partial sums, no reshuffle before the next layer), and it is the
`Shard(0)` layout the parameter already has. An embedding split by rows
(vocabulary entries) shares that layout with a tied output head.

Both ops carry their own autograd rule, so aot_autograd derives a backward that
re-rotates the weight rather than saving it. A use the pass does not know
(a slice of the weight, a custom matmul) keeps reading the gathered W: correct,
at zero3's memory for that weight. When every use is rewritten the gather goes.

The ring runs on the model's own ring group (`DistributedState.ring_group`).

Guarantees: no `unshard` of a rotated weight remains for the rewritten uses;
the choice depends on the graph alone (the same on every rank).
Numerics: the same products summed in the same order per output element as
`F.linear` / `F.embedding` (each output column comes from one shard).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import zppc.runtime.rtp  # noqa: F401  (registers the ring ops)
from torch import fx
from zppc.passes.dedupe import UNSHARD_TARGETS

LINEAR_TARGETS = (torch._C._nn.linear, F.linear)
EMBEDDING_TARGETS = (F.embedding,)


@dataclass(frozen=True)
class RotatedUse:
    """One use of a rotated weight the pass rewrites."""

    node: fx.Node
    unshard: fx.Node
    kind: str
    """"linear" or "embedding"."""
    data: fx.Node
    """The input (linear) or the indices (embedding)."""
    bias: fx.Node | None = None
    padding_idx: int = -1


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def match_use(user: fx.Node, unshard: fx.Node) -> RotatedUse | None:
    """The rewrite for `user` of the gathered weight `unshard`, if it has one."""
    if user.op != "call_function":
        return None
    shape = unshard.args[1]
    if user.target in LINEAR_TARGETS and len(shape) == 2:
        x, weight = _arg(user, 0, "input"), _arg(user, 1, "weight")
        bias = _arg(user, 2, "bias")
        if weight is unshard and x is not unshard and bias is not unshard:
            return RotatedUse(user, unshard, "linear", x, bias)
    if user.target in EMBEDDING_TARGETS and len(shape) == 2:
        indices, weight = _arg(user, 0, "input"), _arg(user, 1, "weight")
        padding_idx = _arg(user, 2, "padding_idx")
        plain = (
            _arg(user, 3, "max_norm") is None
            and not _arg(user, 5, "scale_grad_by_freq", False)
            and not _arg(user, 6, "sparse", False)
        )
        if weight is unshard and indices is not unshard and plain:
            if padding_idx is None:
                padding_idx = -1
            elif padding_idx < 0:
                padding_idx += shape[0]
            return RotatedUse(user, unshard, "embedding", indices, padding_idx=padding_idx)
    return None


def find_rotated_uses(graph: fx.Graph) -> list[RotatedUse]:
    uses = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in UNSHARD_TARGETS:
            continue
        if node.args[3] != "rtp":
            continue
        uses.extend(filter(None, (match_use(user, node) for user in list(node.users))))
    return uses


def rtp_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    graph = gm.graph
    for use in find_rotated_uses(graph):
        shard, shape, _world, _mode, param_dtype, reduce_dtype = use.unshard.args
        group_name = ctx.state.ring_group
        with graph.inserting_before(use.node):
            if use.kind == "linear":
                ring = graph.call_function(
                    torch.ops.zppc.rtp_linear.default,
                    (use.data, shard, use.bias, list(shape), group_name, param_dtype, reduce_dtype),
                )
            else:
                ring = graph.call_function(
                    torch.ops.zppc.rtp_embedding.default,
                    (
                        use.data,
                        shard,
                        list(shape),
                        group_name,
                        param_dtype,
                        reduce_dtype,
                        use.padding_idx,
                    ),
                )
        ring.meta.update(use.node.meta)
        use.node.replace_all_uses_with(ring)
        graph.erase_node(use.node)
        if not use.unshard.users:
            graph.erase_node(use.unshard)
    return gm
