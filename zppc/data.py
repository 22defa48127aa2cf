"""A real text corpus present on every machine: the Python standard library's
own source, read as bytes (vocabulary 256). Used by the demo, the benchmarks
and the accuracy tests."""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch


def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """Up to `max_bytes` bytes of the standard library's .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def random_windows(
    data: torch.Tensor, batch: int, block: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (input, target) batches of random windows; each seed its own stream."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - block - 1, (batch,), generator=g)
        window = torch.stack([data[s : s + block + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]
