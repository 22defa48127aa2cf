"""The `dedupe_unshard` pass: one gather per parameter per graph.

Requires: the dynamo graph, before aot_autograd. Tied parameters (a GPT's
embedding and output weight) and parameters read twice produce several identical
`zppc::unshard` calls; merging them here, before autograd is traced, means aot
sees one use, autograd sums the gradients of all uses first, and the backward
holds a single `reduce_grad` for the parameter: gathered once, reduced once.

Numerics: unchanged (unshard is a pure function of its arguments).
"""

from __future__ import annotations

import torch
from torch import fx

UNSHARD_TARGETS = (torch.ops.zppc.unshard, torch.ops.zppc.unshard.default)


def _key(node: fx.Node) -> tuple:
    freeze = lambda a: tuple(a) if isinstance(a, (list, tuple)) else a  # noqa: E731
    return tuple(freeze(a) for a in node.args) + tuple(sorted(node.kwargs.items()))


def dedupe_unshard_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    first: dict[tuple, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in UNSHARD_TARGETS:
            continue
        key = _key(node)
        if key in first:
            node.replace_all_uses_with(first[key])
            gm.graph.erase_node(node)
        else:
            first[key] = node
    return gm
