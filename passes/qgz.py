"""The `qgz` pass: quantized two-hop gradient reduction (ZeRO++ qgZ).

Requires: the `zero` pass with qgZ on (every strategy then reduces gradients
by a reduce-scatter of the gradient already divided by the world size, its wait
tagged `GRAD_REDUCE`), and the topology's intra- and cross-node groups in the
pass context. Runs on the backward graph after `bucket`, so that one bucket of
many gradients becomes one all-to-all per hop.

Rewrite, per such reduce-scatter of W*S elements (W = K nodes x D ranks per
node, S = one rank's shard; a bucket is laid out rank-major, so it is one such
tensor too):

1. reorder: view as [K, D, S] and permute to [D, K, S], so that row d holds
   what local rank d of every node must add up (DeepSpeed's
   `reshape(K, D, -1).permute(1, 0, 2)`; the zero pass already padded to W*S,
   so every size fits);
2. quantize each row in blocks (`qgz_intra_node`, int8 by default),
   intra-node all-to-all, dequantize and sum the D received rows in fp32:
   row k is now the node's partial sum of shard k*D + d;
3. requantize (`qgz`), cross-node all-to-all, dequantize and sum the K rows in
   fp32: this rank's shard, summed over the world; since every gradient was
   divided by W first, that is the true mean (DeepSpeed divides by K only);
4. cast to the reduce-scatter's dtype.

The `overlap` pass then moves each inter-node hop's wait, and all that uses its
result, to the end of the backward: bucket i's inter-node hop is in flight
while the backward goes on and bucket i+1 takes its intra-node hop (the two
hops pipelined).

With `qgz_error_feedback`, each hop adds the residual it left at the previous
step (per bucket, in the model's store) before quantizing, and keeps the new
one (`zppc.runtime.error_feedback`).

A group of one rank skips its hop (one node: the intra-node hop only).
`Config(qgz_quantize=False)` keeps the two hops but sends the values as they
are: a debug mode that checks the reorder and the mean against reduce-scatter.

Numerics: changes results (opt-in); sums are in fp32 whatever the gradient
dtype (DeepSpeed sums in fp16, reading bf16 as fp16).
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
import torch.distributed as dist
from torch import fx
from zppc.kernels import qgz as qgz_kernels
from zppc.kernels.quant import FORMAT_BITS
from zppc.passes.graph_utils import GraphBuilder, lowers_to_triton_kernels
from zppc.passes.zero import (
    GRAD_REDUCE,
    UNQUANTIZED_BYTES,
    CollectiveMatch,
    cast,
    collective,
    find_collectives,
)
from zppc.runtime import error_feedback
from zppc.runtime.topology import Topology, default_node_size, group_size, setup_groups

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def find_grad_reduce_scatters(graph: fx.Graph) -> list[CollectiveMatch]:
    return [
        m
        for m in find_collectives(graph)
        if m.kind == "reduce_scatter" and m.wait.meta.get(GRAD_REDUCE)
    ]


def qgz_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    groups = model_groups(ctx)
    intra, cross = groups.intra_node, groups.cross_node
    nodes, per_node = group_size(cross), group_size(intra)
    matches = find_grad_reduce_scatters(gm.graph)
    if nodes == 1 and matches:
        warnings.warn(
            "qgz on a single node: the gradient reduction is one quantized intra-node "
            "all-to-all (there is no inter-node hop to save)",
            stacklevel=2,
        )
    config = ctx.config
    quantize = config.qgz_quantize
    first = Hop(intra, config.qgz_intra_node if quantize else None, config)
    second = Hop(cross, config.qgz if quantize else None, config)
    store = residual_store(ctx) if config.qgz_error_feedback else None
    for i, m in enumerate(matches):
        b = GraphBuilder(gm, m.issue)
        if store is not None:
            # Keys: this compile of the model, the bucket, the hop (the same on every rank).
            first.feedback = (store, f"g{compile_index(ctx)}_b{i}_intra")
            second.feedback = (store, f"g{compile_index(ctx)}_b{i}_inter")
        shard = m.input.meta["val"].numel() // (nodes * per_node)
        rows = b.inline(
            partial(qgz_kernels.reorder_for_two_hops, nodes=nodes, per_node=per_node), m.input
        )
        fusable = first.quant and second.quant and store is None and nodes > 1 and per_node > 1
        if fusable and lowers_to_triton_kernels(m.input.meta["val"]):
            total = fused_two_hops(b, rows, first, second)
        else:
            node_sums = b.call(aten.view.default, first.run(b, rows), [nodes, shard])
            total = second.run(b, node_sums)
        m.replace_with(cast(b, total, m.dtype))
    return gm


def model_groups(ctx):
    """The process groups of the model being compiled (an undistributed model
    that fell back to ddp: those of its Config's topology, already set up)."""
    if ctx.state is not None:
        return ctx.state.groups
    world = dist.get_world_size()
    topology = Topology(world, ctx.config.node_size or default_node_size(world))
    return setup_groups(topology, timeout_s=ctx.config.timeout_s)


_UNOWNED_RESIDUALS: dict = {}


def residual_store(ctx) -> int:
    """The id of the error-feedback store of the model being compiled."""
    store = ctx.state.qgz_residuals if ctx.state is not None else _UNOWNED_RESIDUALS
    return error_feedback.register_store(store)


def compile_index(ctx) -> int:
    """Which of its model's compiles this graph belongs to (deterministic order)."""
    return len(ctx.state.compiles) - 1 if ctx.state is not None else 0


class Hop:
    """One all-to-all hop over `group_name`: row p of a [P, n] tensor goes to
    group rank p, quantized in `fmt` (None: as it is), and the P rows received
    come back summed in fp32, as [n]."""

    def __init__(self, group_name: str, fmt: str | None, config):
        self.group_name, self.fmt = group_name, fmt
        self.quant = dict(block=config.qgz_block_size, bits=FORMAT_BITS[fmt]) if fmt else None
        self.feedback: tuple[int, str] | None = None
        """(store id, key) of this hop's error-feedback residual, per bucket."""

    @property
    def peers(self) -> int:
        return group_size(self.group_name)

    def run(self, b: GraphBuilder, rows: fx.Node) -> fx.Node:
        peers, numel = rows.meta["val"].shape
        if peers != self.peers:
            raise AssertionError(f"{peers} rows for a group of {self.peers}")
        if peers == 1:
            return b.call(aten.view.default, cast(b, rows, torch.float32), [numel])
        if self.quant:
            payload = self.quantize(b, rows)
        else:
            payload = rows
        unquantized = rows.meta["val"].numel() * rows.meta["val"].itemsize
        return self.sum(b, self.send(b, payload, unquantized), numel)

    def quantize(self, b: GraphBuilder, rows: fx.Node) -> fx.Node:
        """Payload rows; with error feedback, of the rows plus last step's
        residual, keeping what this step's quantization loses."""
        if self.feedback is None:
            return b.inline(partial(qgz_kernels.quantize_rows, **self.quant), rows)
        peers, numel = rows.meta["val"].shape
        zppc_ops = torch.ops.zppc
        values = b.call(
            zppc_ops.qgz_compensate.default, cast(b, rows, torch.float32), *self.feedback
        )
        payload = b.inline(partial(qgz_kernels.quantize_rows, **self.quant), values)
        sent = b.inline(
            partial(qgz_kernels.dequantize_rows, peers=peers, numel=numel, **self.quant), payload
        )
        b.call(zppc_ops.qgz_remember.default, values, sent, *self.feedback)
        return payload

    def send(self, b: GraphBuilder, payload: fx.Node, unquantized_bytes: int) -> fx.Node:
        """The all-to-all of `payload` rows, standing for `unquantized_bytes` of
        values (all rows: each peer would have sent its share of them)."""
        splits = [payload.meta["val"].numel() // self.peers] * self.peers
        received = collective(
            b,
            "all_to_all",
            self.group_name,
            c10d.all_to_all_single.default,
            b.call(aten.view.default, payload, [-1]),
            splits,
            splits,
            self.group_name,
        )
        received.meta[UNQUANTIZED_BYTES] = unquantized_bytes // self.peers
        return received

    def sum(self, b: GraphBuilder, received: fx.Node, numel: int) -> fx.Node:
        if self.quant:
            fn = partial(qgz_kernels.dequantize_sum, peers=self.peers, numel=numel, **self.quant)
        else:
            fn = partial(qgz_kernels.exact_sum, peers=self.peers)
        return b.inline(fn, received)


def fused_two_hops(b: GraphBuilder, rows: fx.Node, first: Hop, second: Hop) -> fx.Node:
    """CUDA, both hops quantized: the step between the hops is one Triton kernel
    (dequantize the intra-node payloads, sum in fp32, requantize per node)."""
    per_node, numel = rows.meta["val"].shape
    payload = b.inline(partial(qgz_kernels.quantize_rows, **first.quant), rows)
    received = first.send(b, payload, rows.meta["val"].numel() * rows.meta["val"].itemsize)
    payload = b.call(
        torch.ops.zppc.dequantize_sum_requantize.default,
        received,
        per_node,
        numel,
        first.quant["block"],
        first.quant["bits"],
        second.peers,
        second.quant["bits"],
    )
    # Unquantized, the inter-node hop would carry the fp32 node sums.
    received = second.send(b, payload, numel * 4)
    return second.sum(b, received, numel // second.peers)
