"""This machine's compute rates, measured on one thread as a benchmark rank runs.

    python benchmarks/machine.py            # prints them
    python benchmarks/machine.py -o FILE    # and writes them as JSON

Two rates, the two the cost model charges (`zppc.cost.Compute`):

- FLOP/s of a matrix product of the benchmark GPT's shapes (512 tokens x 256
  features into 768), as its linears run;
- bytes/s of eager elementwise work: qwZ's and qgZ's CPU quantization round
  trip (`zppc.kernels.quant`'s torch reference, int4 in blocks of 64, on a
  64 Ki-element shard), its aten ops' bytes read and written counted as the
  cost model counts them (`zppc.cost.node_bytes`) over its time.

Each figure is the median of 31 timed runs after a warm-up. The cluster's ranks
share the cores and run a whole step around these ops, so
benchmarks/predict.py calibrates one factor on top of both rates (it does not
fit either rate).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

TIMED_RUNS = 31


def _median_seconds(fn) -> float:
    fn()
    times = []
    for _ in range(TIMED_RUNS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[TIMED_RUNS // 2]


def _quantization_round_trip(x: torch.Tensor) -> torch.Tensor:
    from zppc.kernels.quant import quantize_pack_reference, unpack_dequantize_reference

    payload = quantize_pack_reference(x, 64, 4)
    return unpack_dequantize_reference(payload, 1, x.numel(), 64, 4, torch.float32)


def measure_rates() -> dict:
    """{"flops_per_second", "memory_bytes_per_second", ...} of this machine, one thread."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from zppc.cost import node_bytes

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as benchmarks/worker.py runs each rank
    try:
        a, b = torch.randn(512, 256), torch.randn(256, 768)
        flops = 2 * 512 * 256 * 768 / _median_seconds(lambda: a @ b)
        x = torch.randn(2**16)
        traced = make_fx(_quantization_round_trip, tracing_mode="fake")(x)
        moved = sum(node_bytes(node) for node in traced.graph.nodes)
        memory = moved / _median_seconds(lambda: _quantization_round_trip(x))
    finally:
        torch.set_num_threads(threads)
    return {
        "flops_per_second": flops,
        "memory_bytes_per_second": memory,
        "threads": 1,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--output", type=Path, default=None)
    args = p.parse_args(argv)
    rates = measure_rates()
    print(
        f"matrix products {rates['flops_per_second'] / 1e9:.1f} GFLOP/s, eager elementwise "
        f"{rates['memory_bytes_per_second'] / 1e9:.2f} GB/s (one thread)"
    )
    if args.output:
        args.output.write_text(json.dumps(rates, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
