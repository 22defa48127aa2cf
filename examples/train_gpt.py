"""Train a small byte-level GPT with zppc on several CPU ranks.

    torchrun --nproc-per-node 4 examples/train_gpt.py --node-size 2 --steps 200

The corpus is the Python standard library's own source code, read as bytes: it
is on every machine that runs this script, and it is real text with structure
a small model can learn.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from tqdm import tqdm

import zppc
from zppc.data import random_windows, stdlib_corpus
from zppc.models import GPT, PRESETS


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="gpt-small", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--strategy", default="zero3", choices=["ddp", "zero1", "zero2", "zero3"])
    p.add_argument(
        "--qwz", default="int8", choices=["int8", "int4", "none"], help="quantized weight gathers"
    )
    p.add_argument(
        "--qgz", default="int4", choices=["int8", "int4", "none"], help="quantized gradient hops"
    )
    p.add_argument(
        "--hpz",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="backward gathers inside the node",
    )
    p.add_argument("--node-size", type=int, default=None)
    p.add_argument("--lowering", default="inductor", choices=["inductor", "eager"])
    p.add_argument("--corpus-mb", type=float, default=8.0)
    p.add_argument(
        "--checkpoint",
        default=None,
        help="directory to save to every --save-every steps and to resume from (torchrun --max-restarts)",
    )
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument(
        "--fail-at-step",
        type=int,
        default=None,
        help="fault drill: rank 1 kills itself at this step in the first attempt",
    )
    p.add_argument("--log-losses", action="store_true", help="print every step's loss (rank 0)")
    return p.parse_args()


def init_process_group() -> None:
    """gloo, with every torchrun attempt in its own namespace of the store.

    torchrun (2.13) shares its rendezvous store with the workers and, on a
    restart, the new workers can read the addresses the killed attempt left
    there: gloo then connects to a dead port ("connectFullMesh failed ...
    Connection refused"; pytorch/pytorch#135712). Prefixing the keys with the
    restart count keeps attempts apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo")
        return
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timedelta(minutes=5),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"zppc_attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(
        max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    )
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    cfg = PRESETS[args.preset]
    block = min(args.block, cfg.block_size)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    qwz = None if args.qwz == "none" or args.strategy == "ddp" else args.qwz
    hpz = args.hpz and args.strategy == "zero3"
    qgz = None if args.qgz == "none" else args.qgz
    config = zppc.Config(
        strategy=args.strategy,
        qwz=qwz,
        hpz=hpz,
        qgz=qgz,
        node_size=args.node_size,
        lowering=args.lowering,
    )
    zppc.distribute(model, config)
    # The parameters are DTensors of their original shapes: nanoGPT's rule of
    # decaying matrices only, and clipping by the global norm, work unchanged.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
    )
    step = torch.compile(model, backend="zppc")

    data = stdlib_corpus(int(args.corpus_mb * 2**20))
    split = int(0.95 * data.numel())
    train = random_windows(data[:split], args.batch_size, block, seed=1000 + rank)
    if rank == 0:
        print(
            f"zppc {args.strategy}{' + qwz ' + qwz if qwz else ''}{' + hpz' if hpz else ''}"
            f"{' + qgz ' + qgz if qgz else ''} on {world} ranks ({args.lowering}): GPT {args.preset} "
            f"{n_params / 1e6:.2f}M parameters, corpus {data.numel() / 2**20:.1f} MiB of stdlib source"
        )
    progress = {"step": torch.zeros((), dtype=torch.long)}
    if args.checkpoint and os.path.exists(args.checkpoint):
        zppc.load(model, opt, args.checkpoint, extra=progress)
        for _ in range(int(progress["step"])):  # the data streams resume where they were
            next(train)
        if rank == 0:
            print(f"resumed from {args.checkpoint} at step {int(progress['step'])}")
    start = int(progress["step"])
    ran = args.steps - start  # steps this attempt runs (all of them unless resumed)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    bar = tqdm(range(start, args.steps), disable=rank != 0, unit="step", dynamic_ncols=True)
    tokens_per_step = args.batch_size * block * world
    zppc.reset_comm_stats()
    t0, timed_steps, first_loss = None, 0, None
    value = float("nan")
    for i in bar:
        if args.fail_at_step == i and rank == 1 and attempt == 0:
            print(f"fault drill: rank 1 kills itself at step {i}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = next(train)
        loss = step(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach()
        dist.all_reduce(value)
        value = value.item() / world
        first_loss = first_loss if first_loss is not None else value
        if args.log_losses and rank == 0:
            print(f"step {i} loss {value:.6f}", flush=True)
        if args.checkpoint and ((i + 1) % args.save_every == 0 or i + 1 == args.steps):
            progress["step"].fill_(i + 1)
            zppc.save(model, opt, args.checkpoint, extra=progress)
        if i == start + 1:  # the first step compiles; time the rest
            t0, timed_steps = time.perf_counter(), 0
        timed_steps += 1 if t0 is not None and i > start + 1 else 0
        stats = zppc.comm_stats()
        rate = tokens_per_step * timed_steps / (time.perf_counter() - t0) if timed_steps else 0.0
        bar.set_postfix(
            loss=f"{value:.3f}", tok_s=f"{rate:,.0f}", comm_MiB=f"{stats.total_bytes / 2**20:,.1f}"
        )

    stats = zppc.comm_stats()
    val = random_windows(data[split:], args.batch_size, block, seed=7)
    with torch.no_grad():
        val_loss = torch.stack([step(*next(val)) for _ in range(4)]).mean()
    dist.all_reduce(val_loss)
    if rank == 0:
        per_step = stats.total_bytes / max(1, ran)
        first = f"{first_loss:.3f}" if first_loss is not None else "-"
        print(f"loss {first} -> {value:.3f}, validation loss {val_loss.item() / world:.3f}")
        print(
            f"rank 0 received {stats.total_bytes / 2**20:,.1f} MiB over {ran} steps "
            f"({per_step / 2**20:.2f} MiB/step; intra-node {stats.intra_node_bytes / 2**20:,.1f} MiB, "
            f"inter-node {stats.inter_node_bytes / 2**20:,.1f} MiB)"
        )
        for kind, nbytes in sorted(stats.by_kind.items()):
            print(f"  {kind:15s} {nbytes / 2**20:10,.1f} MiB in {stats.calls[kind]} calls")
        # What the same training steps would have moved without quantization,
        # from the compiled schedule of the training graph (the measured bytes
        # above come from the ledger).
        train_schedule = zppc.inspect(step).compiles[0].schedule()
        moved = sum(c.intra_node_bytes + c.inter_node_bytes for c in train_schedule)
        would = sum(
            (c.intra_node_bytes + c.inter_node_bytes)
            * c.unquantized_bytes_per_peer
            // c.bytes_per_peer
            for c in train_schedule
        )
        if would > moved:
            print(
                f"quantization saved {(would - moved) * ran / 2**20:,.1f} MiB on rank 0 over {ran} steps: "
                f"{moved / 2**20:.2f} MiB/step instead of {would / 2**20:.2f} MiB/step ({1 - moved / would:.0%} less)"
            )
        full_ddp = 2 * (world - 1) / world * n_params * 4 * ran
        print(
            f"for reference, an fp32 all-reduce of every gradient (DDP) receives {full_ddp / 2**20:,.1f} MiB"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
