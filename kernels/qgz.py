"""qgZ's arithmetic around its two all-to-all hops.

The pure-torch functions are the definition; the `qgz` pass inlines them into
the backward graph off CUDA, so Inductor fuses each hop's dequantize + sum with
the next hop's requantize. On CUDA the step between the hops is one Triton
kernel (`zppc::dequantize_sum_requantize`), bit-identical to the reference. Payload rows
use `quant.PayloadLayout` (bf16 block scales, then int8 or packed int4 values):
one row per destination rank.

Sums run over the received rows in a fixed order (row 0 first, then 1, ...) in
fp32, so a result does not depend on how a backend would tree-reduce.
"""

from __future__ import annotations

import torch
from torch import Tensor
from zppc.kernels.quant import (
    HAS_TRITON,
    QMAX,
    PayloadLayout,
    quantize_pack_rows_reference,
    unpack_dequantize_reference,
)

if HAS_TRITON:
    import triton
    import triton.language as tl
    from zppc.kernels.quant import (
        block_scale,
        load_quantized,
        load_scale,
        payload_values,
        round_clamp,
        store_scale,
    )


def reorder_for_two_hops(flat: Tensor, nodes: int, per_node: int) -> Tensor:
    """[K*D*S] (shard k*D + d at its place) -> [D, K*S]: row d holds the shards
    that local rank d of every node owns, node by node."""
    return flat.view(nodes, per_node, -1).permute(1, 0, 2).reshape(per_node, -1)


def quantize_rows(rows: Tensor, block: int, bits: int) -> Tensor:
    """[P, n] values -> [P, nbytes] payloads, each row quantized on its own."""
    return quantize_pack_rows_reference(rows, block, bits)


def dequantize_rows(payload: Tensor, peers: int, numel: int, block: int, bits: int) -> Tensor:
    """[P, nbytes] payloads -> the [P, n] fp32 values their receivers will see."""
    values = unpack_dequantize_reference(payload.view(-1), peers, numel, block, bits, torch.float32)
    return values.view(peers, numel)


def ordered_sum(values: Tensor) -> Tensor:
    """Sum of the rows of a [P, n] fp32 tensor, row 0 first."""
    total = values[0]
    for row in range(1, values.shape[0]):
        total = total + values[row]
    return total


def dequantize_sum(received: Tensor, peers: int, numel: int, block: int, bits: int) -> Tensor:
    """`peers` payload rows of `numel` values each -> their fp32 sum, [numel]."""
    return ordered_sum(dequantize_rows(received, peers, numel, block, bits))


def exact_sum(received: Tensor, peers: int) -> Tensor:
    """Unquantized rows (qgz_quantize=False) -> their fp32 sum."""
    return ordered_sum(received.view(peers, -1).float())


def dequantize_sum_requantize(
    received: Tensor, peers: int, numel: int, block: int, bits: int, rows: int, out_bits: int
) -> Tensor:
    """Between the hops: the `peers` payloads of the first hop, summed in fp32
    and requantized as `rows` payload rows (one per node) in `out_bits`."""
    total = dequantize_sum(received, peers, numel, block, bits)
    return quantize_rows(total.view(rows, -1), block, out_bits)


# --------------------------------------------------------------------- triton

if HAS_TRITON:

    @triton.jit
    def _sum_received(
        payload_ptr, peers, row_bytes, nblocks, e, mask, BLOCK: tl.constexpr, INT4: tl.constexpr
    ):
        """fp32 sum over the `peers` payload rows of the values at indices `e`,
        row 0 first (the reference's order)."""
        acc = tl.zeros(e.shape, tl.float32)
        for p in range(peers):
            row = payload_ptr + tl.cast(p, tl.int64) * row_bytes
            scale = load_scale(row, e // BLOCK, mask)
            q = load_quantized(payload_values(row, nblocks), e, mask, INT4)
            acc += q.to(tl.float32) * scale
        return acc

    @triton.jit
    def _dequantize_sum_requantize_kernel(
        payload_ptr,
        out_ptr,
        peers,
        row_bytes,
        nblocks,
        shard,
        out_row_bytes,
        out_nblocks,
        BLOCK: tl.constexpr,
        BLOCK_POW2: tl.constexpr,
        INT4: tl.constexpr,
        OUT_INT4: tl.constexpr,
        OUT_QMAX: tl.constexpr,
    ):
        """Program (b, k): block b of output row k, i.e. elements
        [k*shard + b*BLOCK, ...) of the received rows."""
        b = tl.program_id(0)
        k = tl.program_id(1)
        out_row = out_ptr + k.to(tl.int64) * out_row_bytes
        out_values = payload_values(out_row, out_nblocks)
        if OUT_INT4:
            half = tl.arange(0, BLOCK_POW2 // 2)
            even = b * BLOCK + 2 * half
            pairs = half < BLOCK // 2
            lo_mask = pairs & (even < shard)
            hi_mask = pairs & (even + 1 < shard)
            e = k.to(tl.int64) * shard + even
            lo = _sum_received(payload_ptr, peers, row_bytes, nblocks, e, lo_mask, BLOCK, INT4)
            hi = _sum_received(payload_ptr, peers, row_bytes, nblocks, e + 1, hi_mask, BLOCK, INT4)
            amax = tl.maximum(tl.max(tl.abs(lo), axis=0), tl.max(tl.abs(hi), axis=0))
            scale, inv = block_scale(amax, OUT_QMAX)
            byte = (round_clamp(lo * inv, OUT_QMAX) & 0xF) | (
                (round_clamp(hi * inv, OUT_QMAX) & 0xF) << 4
            )
            tl.store(out_values + b * (BLOCK // 2) + half, byte.to(tl.uint8), mask=lo_mask)
        else:
            offs = tl.arange(0, BLOCK_POW2)
            idx = b * BLOCK + offs
            mask = (offs < BLOCK) & (idx < shard)
            e = k.to(tl.int64) * shard + idx
            acc = _sum_received(payload_ptr, peers, row_bytes, nblocks, e, mask, BLOCK, INT4)
            scale, inv = block_scale(tl.max(tl.abs(acc), axis=0), OUT_QMAX)
            q = round_clamp(acc * inv, OUT_QMAX)
            tl.store(
                out_values.to(tl.pointer_type(tl.int8), bitcast=True) + idx,
                q.to(tl.int8),
                mask=mask,
            )
        store_scale(out_row, b, scale)


def dequantize_sum_requantize_triton(
    received: Tensor, peers: int, numel: int, block: int, bits: int, rows: int, out_bits: int
) -> Tensor:
    layout = PayloadLayout(numel, block, bits)
    out_layout = PayloadLayout(numel // rows, block, out_bits)
    out = torch.zeros(rows, out_layout.nbytes, dtype=torch.uint8, device=received.device)
    _dequantize_sum_requantize_kernel[(out_layout.nblocks, rows)](
        received.contiguous(),
        out,
        peers,
        layout.nbytes,
        layout.nblocks,
        numel // rows,
        out_layout.nbytes,
        out_layout.nblocks,
        BLOCK=block,
        BLOCK_POW2=triton.next_power_of_2(block),
        INT4=bits == 4,
        OUT_INT4=out_bits == 4,
        OUT_QMAX=QMAX[out_bits],
    )
    return out


@torch.library.custom_op("zppc::dequantize_sum_requantize", mutates_args=())
def dequantize_sum_requantize_op(
    received: Tensor, peers: int, numel: int, block: int, bits: int, rows: int, out_bits: int
) -> Tensor:
    """qgZ between its hops, fused: the Triton kernel on CUDA, else the reference."""
    args = (received, peers, numel, block, bits, rows, out_bits)
    if received.is_cuda and HAS_TRITON:
        return dequantize_sum_requantize_triton(*args)
    return dequantize_sum_requantize(*args)


@dequantize_sum_requantize_op.register_fake
def _(received, peers, numel, block, bits, rows, out_bits):
    nbytes = PayloadLayout(numel // rows, block, out_bits).nbytes
    return received.new_empty(rows, nbytes, dtype=torch.uint8)
