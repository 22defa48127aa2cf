"""Throughput of the quantization kernels, against the device's copy bandwidth.

    python benchmarks/quant_throughput.py            # CUDA: Triton kernels; CPU: the torch path

GB/s counts the bytes each kernel must read and write (input + payload for
quantize, payload + output for dequantize). "copy" is a plain device copy of
the input, the bound a memory-bound kernel can reach.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
from zppc.kernels import quant


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of one call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 24])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--eager", action="store_true", help="CPU: time the reference op by op, not compiled"
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda" and quant.HAS_TRITON
    if on_gpu:
        quantize, dequantize = quant.quantize_pack_triton, quant.unpack_dequantize_triton
    elif args.eager:
        quantize, dequantize = quant.quantize_pack_reference, quant.unpack_dequantize_reference
    else:
        # What a compiled graph runs on CPU: the reference, fused by Inductor.
        quantize = torch.compile(quant.quantize_pack_reference, dynamic=False)
        dequantize = torch.compile(quant.unpack_dequantize_reference, dynamic=False)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    path = (
        "triton"
        if on_gpu
        else "torch reference, " + ("eager" if args.eager else "Inductor-compiled")
    )
    print(f"device: {name}; path: {path}\n")
    print("| kernel | dtype | elements | block | time (us) | GB/s | copy GB/s | of copy |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for numel in args.sizes:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(numel, device=device).to(dtype)
            copy_s = timed(lambda x=x: x.clone(), device, args.repeats)
            copy_gbs = 2 * x.numel() * x.element_size() / copy_s / 1e9
            for bits, block in ((8, 2048), (4, 128)):
                payload = quantize(x, block, bits)
                moved_q = x.numel() * x.element_size() + payload.numel()
                moved_d = payload.numel() + x.numel() * x.element_size()
                cases = (
                    (f"quantize int{bits}", partial(quantize, x, block, bits), moved_q),
                    (
                        f"dequantize int{bits}",
                        partial(dequantize, payload, 1, numel, block, bits, dtype),
                        moved_d,
                    ),
                )
                for kernel, fn, moved in cases:
                    seconds = timed(fn, device, args.repeats)
                    gbs = moved / seconds / 1e9
                    print(
                        f"| {kernel} | {str(dtype).removeprefix('torch.')} | {numel:,} | {block} | "
                        f"{seconds * 1e6:,.0f} | {gbs:,.1f} | {copy_gbs:,.1f} | {gbs / copy_gbs:.0%} |"
                    )


if __name__ == "__main__":
    main()
