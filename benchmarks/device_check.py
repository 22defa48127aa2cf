"""The checks that need a GPU, as one short script that prints a table.

    python benchmarks/device_check.py --out DIR

Each check runs in a process of its own (a crash in one is reported, the
others still run) within one deadline, in this order:

1. environment: torch, Triton, CUDA, NCCL and the GPU; zppc imports.
2. kernels: the Triton quantization kernels, compiled for real, against the
   torch reference: payload bytes and dequantized values bit for bit, odd
   sizes, fp32 / bf16 / fp16, int8 / int4.
3. nccl trace, eager / inductor: benchmarks/step_trace.py on NCCL (one rank
   per GPU): a profiler trace of two zero3 steps, and how much of the time
   NCCL's stream was busy a compute kernel ran beside it (the traces and
   their summaries land in DIR).
4. training on nccl: zero3 + qwz int8, three steps, Inductor (Triton code for
   the compute, the custom ops for quantization) against the eager lowering.
5. quant throughput: benchmarks/quant_throughput.py, the kernels against the
   device's copy bandwidth.

Exits non-zero if a check fails. Needs CUDA; on CPU it says so.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

ENVIRONMENT = """
import torch, triton, zppc
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| triton", triton.__version__)
print("nccl", ".".join(map(str, torch.cuda.nccl.version())), "| gpu", torch.cuda.get_device_name(),
      "| zppc", zppc.__version__, zppc.__file__)
"""

TRAIN = """
import torch, torch.distributed as dist, zppc
from zppc.models import GPT, PRESETS
torch.cuda.set_device(0)
dist.init_process_group("nccl")
losses = {}
for lowering in ("eager", "inductor"):
    torch._dynamo.reset(); torch.manual_seed(0)
    model = zppc.distribute(GPT(PRESETS["gpt-tiny"]).cuda(), zppc.Config(qwz="int8", lowering=lowering))
    step = torch.compile(model, backend="zppc")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (4, 33), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    out = []
    for _ in range(3):
        loss = step(tokens[:, :-1], tokens[:, 1:]); loss.backward(); opt.step(); opt.zero_grad(); out.append(loss.item())
    losses[lowering] = out
print("losses", losses)
gap = max(abs(a - b) for a, b in zip(losses["eager"], losses["inductor"]))
print("max gap", gap)
assert gap < 1e-3, losses
"""


def kernel_equality() -> int:
    from zppc.kernels import quant

    print("| format | block | dtype | elements | payload equal | values equal | status |")
    print("|---|---:|---|---:|---|---|---|")
    failures = 0
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
                failures += status != "ok"
                print(
                    f"| int{bits} | {block} | {str(dtype)[6:]} | {n:,} | {same_payload} | {same_values} | {status} |"
                )
    return 1 if failures else 0


def checks(out: Path, trace_batch: int) -> list[tuple[str, list[str], dict[str, str], int]]:
    """(name, command, extra environment, seconds allowed) in running order."""
    python = sys.executable
    one_rank = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0", "WORLD_SIZE": "1"}
    trace = [python, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    trace += ["--master-port", "29534", str(HERE / "step_trace.py"), "--backend", "nccl"]
    trace += [
        "--preset",
        "gpt-medium",
        "--batch-size",
        str(trace_batch),
        "--block",
        "256",
        "--out",
        str(out),
    ]
    return [
        ("environment", [python, "-P", "-c", ENVIRONMENT], {}, 60),
        ("kernels", [python, __file__, "--kernels"], {}, 120),
        ("nccl trace, eager", trace + ["--lowering", "eager", "--tag", "_nccl_eager"], {}, 150),
        ("training on nccl", [python, "-P", "-c", TRAIN], one_rank, 180),
        (
            "nccl trace, inductor",
            trace + ["--lowering", "inductor", "--tag", "_nccl_inductor"],
            {},
            240,
        ),
        ("quant throughput", [python, str(HERE / "quant_throughput.py")], {}, 90),
    ]


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--deadline", type=float, default=540.0, help="seconds for all checks")
    p.add_argument(
        "--trace-batch",
        type=int,
        default=64,
        help="sequences per traced step: enough that the GPU, not the launching CPU, sets the pace",
    )
    p.add_argument("--only", nargs="+", metavar="WORD", help="run the checks whose names hold one")
    p.add_argument("--kernels", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("device_check: no CUDA device here; nothing to check")
        return 0
    if args.kernels:
        return kernel_equality()
    args.out.mkdir(parents=True, exist_ok=True)
    start, rows = time.monotonic(), []
    for name, command, env, allowed in checks(args.out, args.trace_batch):
        if args.only and not any(word in name for word in args.only):
            continue
        left = args.deadline - (time.monotonic() - start)
        if left < 10:
            rows.append((name, "not run (deadline)", 0.0))
            continue
        print(f"\n## {name}\n", flush=True)
        began = time.monotonic()
        try:
            done = subprocess.run(
                command,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                capture_output=True,
                text=True,
                timeout=min(allowed, left),
            )
            print(done.stdout[-6000:])
            status = "ok" if done.returncode == 0 else f"FAILED (rc {done.returncode})"
            if done.returncode:
                print(done.stderr[-5000:])
        except subprocess.TimeoutExpired as exc:
            for captured in (exc.stdout, exc.stderr):  # bytes, even with text=True
                if isinstance(captured, bytes):
                    captured = captured.decode(errors="replace")
                print((captured or "")[-3000:])
            status = f"FAILED (over {min(allowed, left):.0f} s)"
        rows.append((name, status, time.monotonic() - began))
        print(flush=True)
    print("\n| check | status | seconds |\n|---|---|---:|")
    for name, status, seconds in rows:
        print(f"| {name} | {status} | {seconds:.0f} |")
    return 0 if all(status == "ok" for _, status, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
