"""Block quantization: Triton kernels (under the interpreter on CPU) equal the
torch reference bit for bit, and the quantization error is what it should be."""

import math

import pytest
import torch
from zppc.kernels import quant

import zppc

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
        scale = payload[: layout.scale_bytes].view(torch.float32)
        step = scale.repeat_interleave(block)[:n]
        # Half a step, plus the rounding of the scale itself and of the output.
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
