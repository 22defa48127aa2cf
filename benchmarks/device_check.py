"""The checks that need a GPU, as one short script that prints a table.

    python benchmarks/device_check.py

1. The Triton quantization kernels, compiled for real, against the torch
   reference: payload bytes and dequantized values bit for bit, odd sizes,
   fp32 / bf16 / fp16, int8 / int4.
2. Their throughput against the device's copy bandwidth (benchmarks/quant_throughput.py).
3. zppc on NCCL (world of one GPU): zero3 + qwz int8 compiled by Inductor
   (Triton code for the compute, the custom ops for quantization) against the
   eager lowering, three training steps.

Exits non-zero if a correctness check fails. Needs CUDA; on CPU it says so.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def kernel_equality() -> list[str]:
    from zppc.kernels import quant

    failures = []
    for bits, block in ((8, 2048), (8, 130), (4, 128), (4, 64)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for n in (1, 7, 1000, 4099, 1 << 20):
                x = torch.randn(n, device="cuda").to(dtype)
                ref = quant.quantize_pack_reference(x, block, bits)
                tri = quant.quantize_pack_triton(x, block, bits)
                same_payload = torch.equal(ref, tri)
                payload = torch.cat([ref, ref])
                same_values = torch.equal(
                    quant.unpack_dequantize_reference(payload, 2, n, block, bits, dtype),
                    quant.unpack_dequantize_triton(payload, 2, n, block, bits, dtype),
                )
                status = "ok" if same_payload and same_values else "MISMATCH"
                print(
                    f"| int{bits} | {block} | {str(dtype)[6:]} | {n:,} | {same_payload} | {same_values} | {status} |"
                )
                if status != "ok":
                    failures.append(f"int{bits} block {block} {dtype} n={n}")
    return failures


TRAIN = """
import os, torch, torch.distributed as dist, zppc
from zppc.models import GPT, PRESETS
dist.init_process_group("nccl")
torch.cuda.set_device(0)
losses = {}
for lowering in ("eager", "inductor"):
    torch._dynamo.reset(); torch.manual_seed(0)
    model = zppc.distribute(GPT(PRESETS["gpt-tiny"]).cuda(), zppc.Config(qwz="int8", lowering=lowering))
    step = torch.compile(model, backend="zppc")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (4, 33), device="cuda")
    out = []
    for _ in range(3):
        loss = step(tokens[:, :-1], tokens[:, 1:]); loss.backward(); opt.step(); opt.zero_grad(); out.append(loss.item())
    losses[lowering] = out
print("losses", losses)
gap = max(abs(a - b) for a, b in zip(losses["eager"], losses["inductor"]))
print("max gap", gap)
assert gap < 1e-3, losses
"""


def main() -> int:
    if not torch.cuda.is_available():
        print("device_check: no CUDA device here; nothing to check")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| format | block | dtype | elements | payload equal | values equal | status |")
    print("|---|---:|---|---:|---|---|---|")
    failures = kernel_equality()
    print()
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, os.path.join(here, "quant_throughput.py")], check=False)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29533",
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", TRAIN], env=env, capture_output=True, text=True, timeout=540
    )
    print(done.stdout[-2000:])
    if done.returncode:
        print(done.stderr[-4000:])
        failures.append("zppc on NCCL")
    print("device_check:", "all passed" if not failures else f"FAILED: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
