"""Collective failures, named: which zppc operation stopped, on which rank.

A peer that dies, hangs past `Config.timeout_s` or issues other collectives
makes the backend raise an error that names a socket or a buffer, not the
operation. zppc re-raises it as `CollectiveError` naming the graph or eager
collective that failed, so every surviving rank says what it was waiting for.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch.autograd.profiler import record_function

# Words in the errors gloo and NCCL raise when a peer is gone or late (their
# exceptions are plain RuntimeErrors when raised from a functional collective).
_BACKEND_MARKS = ("timed out", "timeout", "connection", "peer", "gloo", "nccl", "c10d", "socket")


class CollectiveError(RuntimeError):
    """A collective zppc issued did not complete on this rank."""


def is_collective_failure(exc: BaseException) -> bool:
    if isinstance(exc, CollectiveError):
        return False
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(mark in text for mark in _BACKEND_MARKS)


@contextmanager
def naming_failures(what: str) -> Iterator[None]:
    """Re-raise a backend's collective failure inside the block as a
    `CollectiveError` that names `what` was running and this rank."""
    try:
        yield
    except RuntimeError as exc:
        if not is_collective_failure(exc):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"zppc: {what} failed on rank {rank}: a peer rank died, stopped calling "
            f"collectives past the timeout, or issued different ones ({exc})"
        ) from exc


def boxed_naming_failures(compiled, what: str):
    """A compiled graph (boxed calling convention) whose collective failures
    name `what`."""

    def run(args):
        with naming_failures(what):
            return compiled(args)

    run._boxed_call = True
    return run


@contextmanager
def waiting_on(what: str) -> Iterator[None]:
    """A block in which this thread waits for collectives (a synchronous eager
    one, or the works of asynchronous ones): a failure is named as `what`, and
    a profiler trace shows the block as `zppc::wait`, time this thread spent
    not computing (benchmarks/step_trace.py reads it)."""
    with naming_failures(what), record_function("zppc::wait"):
        yield


def wait_for(works, what: str) -> None:
    """Wait for asynchronous eager collectives' `works` (see `waiting_on`)."""
    with waiting_on(what):
        for work in works:
            work.wait()
