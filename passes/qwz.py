"""The `qwz` pass: quantized parameter all-gathers (ZeRO++ qwZ).

Requires: the `zero` pass (it tags the wait node of every parameter
all-gather). Runs on the forward graph and on the backward graph (the zero3
re-gather), except on hpZ's gathers inside the node, which stay unquantized.

Rewrite, per gather: local shard -> quantize-and-pack (bf16 block scales
followed by int8 or packed int4 values, one uint8 payload) -> one all-gather
of the payloads -> unpack-and-dequantize to the shard's dtype. Data and
scales travel in a single collective. On CUDA the two steps are the Triton
kernels (`zppc::quantize_pack` / `zppc::unpack_dequantize`); elsewhere the
torch reference's aten ops are inlined for Inductor to fuse.

Numerics: changes results (opt-in); every element is off by at most half a
quantization step of its block. Forward and backward dequantize the same
payload, so both see the same weights.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import fx
from zppc.kernels import quant
from zppc.passes.graph_utils import GraphBuilder, lowers_to_triton_kernels
from zppc.passes.zero import (
    BLOCK_UNIT,
    NODE_LOCAL,
    PARAM_GATHER,
    UNPADDED_BYTES,
    UNQUANTIZED_BYTES,
    CollectiveMatch,
    all_gather,
    find_collectives,
)
from zppc.runtime.topology import group_size

c10d = torch.ops._c10d_functional


def find_param_gathers(graph: fx.Graph) -> list[CollectiveMatch]:
    """Parameter all-gathers across nodes (hpZ's node-local gathers stay exact)."""
    return [
        m
        for m in find_collectives(graph)
        if m.kind == "all_gather"
        and m.wait.meta.get(PARAM_GATHER)
        and not m.wait.meta.get(NODE_LOCAL)
    ]


def qwz_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    bits = quant.FORMAT_BITS[ctx.config.qwz]
    block = ctx.config.qwz_block_size
    zppc_ops = torch.ops.zppc
    for m in find_param_gathers(gm.graph):
        b = GraphBuilder(gm, m.issue)
        world = group_size(m.group_name)
        numel = m.input.meta["val"].numel()
        dtype = m.input.meta["val"].dtype
        # GPU (and a plan): the Triton kernels, as custom ops. Elsewhere: the
        # torch reference's aten ops, inlined so that Inductor fuses them.
        triton_kernels = lowers_to_triton_kernels(m.input.meta["val"])
        if triton_kernels:
            payload = b.call(zppc_ops.quantize_pack.default, m.input, block, bits)
        else:
            payload = b.inline(
                partial(quant.quantize_pack_reference, block=block, bits=bits), m.input
            )
        gathered = all_gather(b, payload, m.group_name)
        gathered.meta[PARAM_GATHER] = True
        for key in (BLOCK_UNIT, UNPADDED_BYTES):
            gathered.meta[key] = m.wait.meta.get(key)
        gathered.meta[UNQUANTIZED_BYTES] = numel * dtype.itemsize
        unpack = dict(world=world, numel=numel, block=block, bits=bits, dtype=dtype)
        if triton_kernels:
            values = b.call(zppc_ops.unpack_dequantize.default, gathered, *unpack.values())
        else:
            values = b.inline(partial(quant.unpack_dequantize_reference, **unpack), gathered)
        m.replace_with(values)
    return gm
