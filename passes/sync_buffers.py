"""The `sync_buffers` pass: every rank keeps rank 0's buffers.

Requires: an aot forward graph whose buffer updates are kept in the graph as
`copy_(buffer, new_value)` (aot_autograd does this for inputs that need no
gradient), and `ctx.buffer_inputs`, the positions of the model's buffers among
the graph's inputs (found by identity on the dynamo graph's real inputs).

Guarantees (with `Config.buffer_sync="broadcast"`): the new values of the
buffers this forward changed are broadcast from the world group's first rank,
one collective per dtype, before they are written back, so BatchNorm's running
statistics and counters are identical on every rank after every forward.
Buffers the forward only reads (masks, rotary tables) move nothing. The choice
depends on the graph alone, so every rank issues the same broadcasts.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from zppc.passes.graph_utils import GraphBuilder
from zppc.passes.zero import c10d, collective

aten = torch.ops.aten


def sync_buffers_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    if ctx.config.buffer_sync is None or not ctx.buffer_inputs:
        return gm
    placeholders = gm.graph.find_nodes(op="placeholder")
    buffers = {placeholders[i] for i in ctx.buffer_inputs}
    updates = [
        n
        for n in gm.graph.find_nodes(op="call_function", target=aten.copy_.default)
        if n.args[0] in buffers
    ]
    by_dtype: dict[torch.dtype, list[fx.Node]] = {}
    for copy in updates:
        by_dtype.setdefault(copy.args[0].meta["val"].dtype, []).append(copy)
    for copies in by_dtype.values():
        _broadcast_updates(gm, copies, ctx.groups.world)
    return gm


def _broadcast_updates(gm: fx.GraphModule, copies: list[fx.Node], group_name: str) -> None:
    """Route the values of `copies` (write-backs of one dtype) through one
    broadcast from the group's first rank."""
    b = GraphBuilder(gm, copies[0])
    values = [b.call(aten.view.default, c.args[1], [-1]) for c in copies]
    flat = values[0] if len(values) == 1 else b.call(aten.cat.default, values)
    synced = collective(b, "broadcast", group_name, c10d.broadcast.default, flat, 0, group_name)
    sizes = [v.meta["val"].numel() for v in values]
    parts = b.call(aten.split_with_sizes.default, synced, sizes)
    for i, copy in enumerate(copies):
        shape = list(copy.args[0].meta["val"].shape)
        copy.update_arg(1, b.call(aten.view.default, b.call(operator.getitem, parts, i), shape))
