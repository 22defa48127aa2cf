"""Block quantization for quantized collectives (qwZ, qgZ).

One rank's tensor becomes one flat uint8 *payload* that travels as a single
collective: first one bfloat16 scale per block, then the quantized values
(int8, or int4 packed two per byte, low nibble first; the last block may be
partial, so a tiny tensor costs its own size plus one scale, not a whole
block), padded to a multiple of 4 bytes so that every rank's payload starts
aligned after an all-gather.

Symmetric, round to nearest (ties away from zero), q in [-qmax, qmax] with
qmax 127 (int8) or 7 (int4); scale = bf16(absmax / qmax), rounded to nearest
even, and the values are quantized against that rounded scale, so a block's
worst error stays half a step (the absmax element, clamped, is off by at most
qmax * 2^-9 of a step). bf16 rather than fp32 scales: at qgZ's int4 block of
64 a scale is 2 bytes to 32 of values instead of 4, and bf16 keeps fp32's
exponent range, which tiny gradient blocks need (fp16's would underflow). An
all-zero block has scale 0 and quantizes to 0 without dividing by zero.

Each operation exists three times, which must agree bit for bit:
- `*_reference`: pure torch, the definition (and the CPU path, which Inductor fuses);
- `_*_kernel`: the Triton kernel (GPU; on CPU under TRITON_INTERPRET=1 in tests);
- `zppc::quantize_pack` / `zppc::unpack_dequantize`: custom ops that graphs call,
  dispatching to the kernel on CUDA and to the reference elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is a Linux dependency
    HAS_TRITON = False

QMAX = {8: 127, 4: 7}
SCALE_DTYPE = torch.bfloat16
"""dtype of the block scales in a payload (2 bytes each)."""
FORMAT_BITS = {"int8": 8, "int4": 4}
"""Bits per value of each quantized format a Config names."""


@dataclass(frozen=True)
class PayloadLayout:
    """Where things sit in one rank's payload of `numel` values."""

    numel: int
    block: int
    bits: int

    def __post_init__(self) -> None:
        if self.bits not in QMAX:
            raise ValueError(f"bits must be 8 or 4, got {self.bits}")
        if self.block <= 0 or (self.bits == 4 and self.block % 2):
            raise ValueError(f"block must be positive (and even for int4), got {self.block}")
        if self.numel <= 0:
            raise ValueError(f"numel must be positive, got {self.numel}")

    @property
    def nblocks(self) -> int:
        return math.ceil(self.numel / self.block)

    @property
    def padded(self) -> int:
        return self.nblocks * self.block

    @property
    def scale_bytes(self) -> int:
        return SCALE_DTYPE.itemsize * self.nblocks

    @property
    def value_bytes(self) -> int:
        return self.numel if self.bits == 8 else -(-self.numel // 2)

    @property
    def nbytes(self) -> int:
        return -(-(self.scale_bytes + self.value_bytes) // 4) * 4


# ----------------------------------------------------------------- reference


def round_to_bf16_reference(x: Tensor) -> Tensor:
    """fp32 -> the nearest bf16 value (ties to even), still fp32, by integer
    arithmetic on the bits (finite, non-negative x). Not `x.to(bf16).float()`:
    Inductor folds that pair of casts away inside a fused kernel, and the
    values would then be quantized against a scale the payload does not carry."""
    bits = x.view(torch.int32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.view(torch.float32)


def quantize_pack_reference(x: Tensor, block: int, bits: int) -> Tensor:
    return quantize_pack_rows_reference(x.reshape(1, -1), block, bits).view(-1)


def quantize_pack_rows_reference(rows: Tensor, block: int, bits: int) -> Tensor:
    """[R, n] values -> [R, nbytes]: each row's own payload (qgZ sends row r
    to rank r; qwZ's single payload is the one-row case)."""
    nrows, numel = rows.shape
    layout = PayloadLayout(numel, block, bits)
    qmax = QMAX[bits]
    padded = torch.nn.functional.pad(rows.float(), (0, layout.padded - numel))
    blocks = padded.view(nrows, layout.nblocks, block)
    amax = blocks.abs().amax(dim=2)
    # Tensor / tensor: a Python scalar goes through a reciprocal on CPU and
    # rounds twice; the kernel divides exactly (div_rn).
    rounded = round_to_bf16_reference(amax / torch.full_like(amax, qmax))
    scale = rounded.to(SCALE_DTYPE)  # exact: `rounded` is a bf16 value already
    inv = torch.where(rounded > 0, torch.ones_like(rounded) / rounded, torch.zeros_like(rounded))
    v = blocks * inv[:, :, None]
    q = torch.where(v >= 0, torch.floor(v + 0.5), -torch.floor(-v + 0.5)).clamp(-qmax, qmax)
    q = q.to(torch.int8).view(nrows, -1)[:, : 2 * layout.value_bytes if bits == 4 else numel]
    if bits == 4:
        q = ((q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)).to(torch.int8)
    tail = layout.nbytes - layout.scale_bytes - layout.value_bytes
    return torch.cat(
        [
            scale.view(torch.uint8),
            q.view(torch.uint8),
            q.new_zeros(nrows, tail, dtype=torch.uint8),
        ],
        dim=1,
    )


def unpack_dequantize_reference(
    payload: Tensor, world: int, numel: int, block: int, bits: int, dtype: torch.dtype
) -> Tensor:
    layout = PayloadLayout(numel, block, bits)
    rows = payload.view(world, layout.nbytes)
    scale = rows[:, : layout.scale_bytes].contiguous().view(SCALE_DTYPE).float()
    packed = rows[:, layout.scale_bytes : layout.scale_bytes + layout.value_bytes]
    if bits == 8:
        q = packed.contiguous().view(torch.int8)
    else:
        low = (packed << 4).view(torch.int8) >> 4
        high = packed.contiguous().view(torch.int8) >> 4
        q = torch.stack([low, high], dim=-1).view(world, -1)[:, :numel]
    q = torch.nn.functional.pad(q.float(), (0, layout.padded - numel))
    values = q.view(world, layout.nblocks, block) * scale[:, :, None]
    return values.view(world, layout.padded)[:, :numel].to(dtype).reshape(-1)


# --------------------------------------------------------------------- triton

if HAS_TRITON:

    @triton.jit
    def round_to_bf16(x):
        """fp32 -> the nearest bf16 value (ties to even), still as fp32. By hand:
        the interpreter truncates fp32 -> bf16, and after this the conversion is
        exact on every backend."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def block_scale(amax, QMAX_: tl.constexpr):
        """A block's bf16 scale (as fp32) and the reciprocal it quantizes with."""
        scale = round_to_bf16(tl.math.div_rn(amax, QMAX_ * 1.0))
        return scale, tl.where(scale > 0, tl.math.div_rn(1.0, scale), 0.0)

    @triton.jit
    def load_scale(row, block_index, mask):
        """Block scales of a payload row, as fp32."""
        scales = row.to(tl.pointer_type(tl.bfloat16), bitcast=True)
        return tl.load(scales + block_index, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def payload_values(row, nblocks):
        """Where a payload row's quantized values start: after its bf16 scales."""
        return row + 2 * nblocks

    @triton.jit
    def store_scale(row, block_index, scale):
        tl.store(
            row.to(tl.pointer_type(tl.bfloat16), bitcast=True) + block_index, scale.to(tl.bfloat16)
        )

    @triton.jit
    def round_clamp(v, QMAX_: tl.constexpr):
        """Round to nearest, ties away from zero, into [-QMAX_, QMAX_] (int32)."""
        q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(-v + 0.5))
        return tl.minimum(tl.maximum(q, -QMAX_), QMAX_).to(tl.int32)

    @triton.jit
    def load_quantized(values, idx, mask, INT4: tl.constexpr):
        """The quantized integers at `idx` of a payload's value bytes (int8, or
        int4 packed two per byte, low nibble first), as int32."""
        if INT4:
            byte = tl.load(values + idx // 2, mask=mask, other=0).to(tl.int32)
            nibble = (byte >> (4 * (idx % 2))) & 0xF
            q = tl.where(nibble >= 8, nibble - 16, nibble)
        else:
            q = tl.load(
                values.to(tl.pointer_type(tl.int8), bitcast=True) + idx, mask=mask, other=0
            ).to(tl.int32)
        return q

    @triton.jit
    def _quantize_pack_kernel(
        x_ptr,
        payload_ptr,
        value_ptr,
        numel,
        BLOCK: tl.constexpr,
        BLOCK_POW2: tl.constexpr,
        QMAX_: tl.constexpr,
        INT4: tl.constexpr,
    ):
        b = tl.program_id(0)
        offs = tl.arange(0, BLOCK_POW2)
        idx = b * BLOCK + offs
        x = tl.load(x_ptr + idx, mask=(offs < BLOCK) & (idx < numel), other=0.0).to(tl.float32)
        scale, inv = block_scale(tl.max(tl.abs(x), axis=0), QMAX_)
        store_scale(payload_ptr, b, scale)
        if INT4:
            half = tl.arange(0, BLOCK_POW2 // 2)
            pair_mask = half < BLOCK // 2
            even = b * BLOCK + 2 * half
            lo = (
                tl.load(x_ptr + even, mask=pair_mask & (even < numel), other=0.0).to(tl.float32)
                * inv
            )
            hi = (
                tl.load(x_ptr + even + 1, mask=pair_mask & (even + 1 < numel), other=0.0).to(
                    tl.float32
                )
                * inv
            )
            byte = (round_clamp(lo, QMAX_) & 0xF) | ((round_clamp(hi, QMAX_) & 0xF) << 4)
            tl.store(
                value_ptr + b * (BLOCK // 2) + half,
                byte.to(tl.uint8),
                mask=pair_mask & (even < numel),
            )
        else:
            q = round_clamp(x * inv, QMAX_)
            tl.store(value_ptr + idx, q.to(tl.int8), mask=(offs < BLOCK) & (idx < numel))

    @triton.jit
    def _unpack_dequantize_kernel(
        payload_ptr,
        out_ptr,
        numel,
        row_bytes,
        nblocks,
        BLOCK: tl.constexpr,
        BLOCK_POW2: tl.constexpr,
        INT4: tl.constexpr,
        OUT_BF16: tl.constexpr,
    ):
        b = tl.program_id(0)
        rank = tl.program_id(1)
        row = payload_ptr + rank.to(tl.int64) * row_bytes
        scale = load_scale(row, b, b < nblocks)
        values = payload_values(row, nblocks)
        offs = tl.arange(0, BLOCK_POW2)
        idx = b * BLOCK + offs
        mask = (offs < BLOCK) & (idx < numel)
        out = load_quantized(values, idx, mask, INT4).to(tl.float32) * scale
        if OUT_BF16:
            out = round_to_bf16(out)
        tl.store(
            out_ptr + rank.to(tl.int64) * numel + idx, out.to(out_ptr.dtype.element_ty), mask=mask
        )


def quantize_pack_triton(x: Tensor, block: int, bits: int) -> Tensor:
    layout = PayloadLayout(x.numel(), block, bits)
    payload = torch.zeros(layout.nbytes, dtype=torch.uint8, device=x.device)
    _quantize_pack_kernel[(layout.nblocks,)](
        x.reshape(-1).contiguous(),
        payload,
        payload[layout.scale_bytes :],
        x.numel(),
        BLOCK=block,
        BLOCK_POW2=triton.next_power_of_2(block),
        QMAX_=QMAX[bits],
        INT4=bits == 4,
    )
    return payload


def unpack_dequantize_triton(
    payload: Tensor, world: int, numel: int, block: int, bits: int, dtype: torch.dtype
) -> Tensor:
    layout = PayloadLayout(numel, block, bits)
    out = torch.empty(world * numel, dtype=dtype, device=payload.device)
    _unpack_dequantize_kernel[(layout.nblocks, world)](
        payload.contiguous(),
        out,
        numel,
        layout.nbytes,
        layout.nblocks,
        BLOCK=block,
        BLOCK_POW2=triton.next_power_of_2(block),
        INT4=bits == 4,
        OUT_BF16=dtype == torch.bfloat16,
    )
    return out


# ----------------------------------------------------------------- custom ops


@torch.library.custom_op("zppc::quantize_pack", mutates_args=())
def quantize_pack(x: Tensor, block: int, bits: int) -> Tensor:
    """One rank's payload (scales, then quantized values) for a tensor."""
    if x.is_cuda and HAS_TRITON:
        return quantize_pack_triton(x, block, bits)
    return quantize_pack_reference(x, block, bits)


@quantize_pack.register_fake
def _(x, block, bits):
    return x.new_empty(PayloadLayout(x.numel(), block, bits).nbytes, dtype=torch.uint8)


@torch.library.custom_op("zppc::unpack_dequantize", mutates_args=())
def unpack_dequantize(
    payload: Tensor, world: int, numel: int, block: int, bits: int, dtype: torch.dtype
) -> Tensor:
    """`world` gathered payloads back to `world * numel` values of `dtype`."""
    if payload.is_cuda and HAS_TRITON:
        return unpack_dequantize_triton(payload, world, numel, block, bits, dtype)
    return unpack_dequantize_reference(payload, world, numel, block, bits, dtype)


@unpack_dequantize.register_fake
def _(payload, world, numel, block, bits, dtype):
    return payload.new_empty(world * numel, dtype=dtype)
