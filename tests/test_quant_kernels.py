"""Block quantization: Triton kernels (under the interpreter on CPU) equal the
torch reference bit for bit, and the quantization error is what it should be."""

import math

import pytest
import torch
from torch._inductor import config as inductor_config
from zppc.kernels import quant

import zppc
from zppc.inductor_fixes import cpu_loop_split_keeps_tails

SHAPES = [1, 7, 255, 1000, 4099]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def gaussian(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def snr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 10 * math.log10(x.pow(2).sum().item() / (x - y).pow(2).sum().item())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [64, 130])
def test_triton_equals_reference(bits, dtype, block):
    if not quant.HAS_TRITON:
        pytest.skip("triton is not installed")
    for n in SHAPES:
        x = gaussian(n, dtype, seed=n)
        ref = quant.quantize_pack_reference(x, block, bits)
        tri = quant.quantize_pack_triton(x, block, bits)
        assert torch.equal(ref, tri), f"payload differs for n={n}"
        world = 3
        payload = torch.cat([ref, quant.quantize_pack_reference(2 * x, block, bits), ref])
        out_ref = quant.unpack_dequantize_reference(payload, world, n, block, bits, dtype)
        out_tri = quant.unpack_dequantize_triton(payload, world, n, block, bits, dtype)
        assert torch.equal(out_ref, out_tri), f"dequantized values differ for n={n}"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_within_half_a_step(bits, dtype):
    block = 96
    for n in SHAPES:
        x = gaussian(n, dtype, seed=n)
        payload = quant.quantize_pack(x, block, bits)
        assert payload.numel() == quant.PayloadLayout(n, block, bits).nbytes
        y = quant.unpack_dequantize(payload, 1, n, block, bits, torch.float32)
        layout = quant.PayloadLayout(n, block, bits)
        scale = payload[: layout.scale_bytes].view(quant.SCALE_DTYPE).float()
        step = scale.repeat_interleave(block)[:n]
        # Half a step of the rounded scale the values were quantized against,
        # plus the rounding of the output.
        assert ((x.float() - y).abs() <= step / 2 * (1 + 1e-5) + 1e-30).all()


@pytest.mark.parametrize("bits, floor_db", [(8, 38.0), (4, 18.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_signal_to_noise_on_gaussian_data(bits, floor_db, dtype):
    block = zppc.Config(qwz=f"int{bits}").qwz_block_size  # the default users get
    x = gaussian(1 << 16, dtype)
    y = quant.unpack_dequantize(
        quant.quantize_pack(x, block, bits), 1, x.numel(), block, bits, dtype
    )
    measured = snr_db(x.float(), y.float())
    print(f"int{bits} {dtype}: SNR {measured:.1f} dB")
    assert measured >= floor_db


@pytest.mark.parametrize("bits", [8, 4])
def test_scales_are_bf16_rounded_to_nearest_even(bits):
    """absmax / qmax = 1 + 3 * 2^-8 lies halfway between two bf16 values: the
    scale is the even one, 1 + 2^-6 (truncation would give 1 + 2^-7), in the
    reference and the kernel alike."""
    qmax = quant.QMAX[bits]
    x = torch.tensor([qmax * (1 + 3 * 2**-8), -1.0, 0.5, 0.0])
    ways = [quant.quantize_pack_reference]
    if quant.HAS_TRITON:
        ways.append(quant.quantize_pack_triton)
    for quantize in ways:
        payload = quantize(x, 4, bits)
        assert payload[:2].view(torch.bfloat16).item() == 1 + 2**-6
        y = quant.unpack_dequantize_reference(payload, 1, 4, 4, bits, torch.float32)
        assert y[0] == qmax * (1 + 2**-6)  # q = qmax against the rounded scale


def test_zero_block_does_not_divide_by_zero():
    x = torch.zeros(300)
    x[200:] = torch.randn(100)
    for bits in (8, 4):
        y = quant.unpack_dequantize(
            quant.quantize_pack(x, 128, bits), 1, 300, 128, bits, torch.float32
        )
        assert torch.isfinite(y).all()
        assert (y[:128] == 0).all()


def test_small_integers_are_exact():
    # absmax 127 * 2^-7 gives scale 2^-7: every multiple of 2^-7 is representable.
    x = torch.randint(-127, 128, (1000,)).float() / 128
    x[0] = 127 / 128
    y = quant.unpack_dequantize(quant.quantize_pack(x, 1000, 8), 1, 1000, 1000, 8, torch.float32)
    assert torch.equal(x, y)


def test_layout_rejects_bad_blocks():
    with pytest.raises(ValueError, match="even"):
        quant.PayloadLayout(10, 7, 4)
    with pytest.raises(ValueError, match="bits"):
        quant.PayloadLayout(10, 8, 3)


@pytest.mark.parametrize("bits", [8, 4])
def test_inductor_lowering_of_the_reference_is_bit_identical(bits):
    """The CPU path is the reference fused by Inductor: it must produce the same
    payload and values as eager. (Inductor folds a `.to(bf16).float()` pair
    inside a fused kernel; a scale rounded that way was dropped, and values got
    quantized against a scale the payload did not carry.)"""
    block, n = 130, 4099

    def round_trip(x):
        payload = quant.quantize_pack_reference(x, block, bits)
        return payload, quant.unpack_dequantize_reference(
            payload, 1, n, block, bits, torch.bfloat16
        )

    x = gaussian(n, torch.bfloat16, seed=bits)
    eager = round_trip(x)
    # As zppc's backend compiles: the loop-split fix on, the FX graph cache off.
    with cpu_loop_split_keeps_tails(), inductor_config.patch(fx_graph_cache=False):
        compiled = torch.compile(round_trip, backend="inductor", fullgraph=True)(x)
    assert torch.equal(eager[0], compiled[0]), "payloads differ"
    assert torch.equal(eager[1], compiled[1]), "dequantized values differ"
