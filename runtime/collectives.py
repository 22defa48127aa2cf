"""Collectives as zppc runs them: eager helpers and the in-graph ledger hook.

The eager helpers back the eager implementation of the IR ops (`zppc::unshard`,
`zppc::reduce_grad`), which is the reference every compiled graph is compared
against. Compiled graphs use functional collectives instead and call
`zppc::record_comm` on each collective's input as it is issued, so the ledger
counts what really ran without ever touching a result (a hook on the result
would keep gathered weights alive and pin the scheduler).
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from zppc.runtime import compat
from zppc.runtime.failures import waiting_on
from zppc.runtime.ledger import record
from zppc.runtime.topology import (
    TWO_HOPS_NEED,
    HopGroups,
    gathers_in_issue_order,
    group_ranks,
    group_size,
    reduction_hops,
    two_hop_gather_over,
    two_hop_reduce_over,
    world_epoch,
)

_GROUP_FROM_NAME = dist.distributed_c10d._resolve_process_group


def bytes_per_peer(kind: str, inp: Tensor, world: int) -> int:
    """Bytes each peer sends me, given the collective's input on this rank."""
    nbytes = inp.numel() * inp.element_size()
    if kind in ("all_gather", "broadcast"):
        return nbytes
    if kind in ("reduce_scatter", "all_to_all"):
        return nbytes // world
    if kind == "all_reduce":
        return 2 * nbytes // world
    raise ValueError(f"unknown collective kind {kind!r}")


# Backends whose reduce-scatter is an all-reduce underneath.
REDUCE_SCATTER_IS_ALL_REDUCE = ("gloo",)


def reduce_scatter_algorithm(algorithm: str, group_name: str, backend: str) -> str:
    """How a reduce-scatter over `group_name` runs (`Config.reduce_scatter`,
    for a group of `backend`): "native", "all_to_all" (the rank-major slices
    exchanged directly and summed locally) or "two_hop"
    (`reduce_scatter_in_two_hops`).

    "auto": on a backend whose reduce-scatter is an all-reduce (gloo), in two
    hops where the group has reduction hop groups (several nodes of several
    ranks: D (N - 1) chunks into each node of D ranks, against D (W - D)
    direct and 2 (W - 1) through the all-reduce's ring: 2 x 2 2 / 4 / 6,
    2 x 4 4 / 16 / 14); otherwise all_to_all when the direct exchange brings
    no more bytes into a node than that ring (a rank per node: W - 1 against
    2 (W - 1); a tie, one node, where nothing crosses, goes to the
    all-to-all, which moves half the bytes in all); else native. NCCL's ring
    reduce-scatter is kept. Counted for the group's first rank, so every rank
    decides alike. "two_hop" on a group without hop groups is an error."""
    from zppc.runtime.ledger import node_link_bytes

    hops = reduction_hops(group_name)
    if algorithm == "two_hop":
        if hops is None:
            raise ValueError(
                f"{TWO_HOPS_NEED}; group {group_name!r} over ranks {group_ranks(group_name)} has no hop groups"
            )
        return algorithm
    if algorithm != "auto":
        return algorithm
    if backend not in REDUCE_SCATTER_IS_ALL_REDUCE:
        return "native"
    if hops is not None:
        return "two_hop"
    first = group_ranks(group_name)[0]
    direct = node_link_bytes("all_to_all", group_name, first, 1)
    ring = 2 * node_link_bytes("reduce_scatter", group_name, first, 1)
    return "all_to_all" if direct <= ring else "native"


@torch.library.custom_op("zppc::record_comm", mutates_args=())
def record_comm(inp: Tensor, kind: str, group_name: str) -> None:
    """Ledger hook placed where each collective is issued in compiled graphs; it
    reads only the size of the collective's input."""
    record(kind, group_name, bytes_per_peer(kind, inp, group_size(group_name)))


@record_comm.register_fake
def _(inp: Tensor, kind: str, group_name: str) -> None:
    return None


# The hook returns nothing; without this mark dead-code elimination (FX and
# Inductor alike) would drop it.
torch.fx.node.has_side_effect(torch.ops.zppc.record_comm.default)


@torch.library.custom_op("zppc::take_shard", mutates_args=())
def take_shard(flat: Tensor, group_name: str) -> Tensor:
    """This rank's 1/world slice of a flat tensor, chosen at run time so that
    every rank's graph is the same."""
    group = _GROUP_FROM_NAME(group_name)
    return flat.view(group.size(), -1)[dist.get_rank(group)].clone()


@take_shard.register_fake
def _(flat: Tensor, group_name: str) -> Tensor:
    world = group_size(group_name)
    return flat.new_empty(flat.numel() // world)


@torch.library.custom_op("zppc::all_gather_in_place", mutates_args=())
def all_gather_in_place(shard: Tensor, group_name: str) -> Tensor:
    """Issue an all-gather of `shard` whose input is this rank's own slice of
    the output: the shard is copied there first, as FSDP2's copy-in does, so
    no separate input buffer lives while the gather is in flight (a
    functional all-gather keeps its input to the wait: two shard-sized
    buffers at gpt-medium's peak). Asynchronous, like a functional
    collective: `_c10d_functional.wait_tensor` on the result waits for it.
    The slice is chosen at run time, so every rank's graph is the same."""
    group = _GROUP_FROM_NAME(group_name)
    out = shard.new_empty(shard.numel() * group.size())
    if (hops := two_hop_gather_over(group_name)) is not None:
        _two_hop_gather(out, shard.reshape(-1), hops)
        return out
    mine = out.narrow(0, dist.get_rank(group) * shard.numel(), shard.numel())
    mine.copy_(shard.reshape(-1))

    def issue() -> dist.Work:
        return compat.all_gather_single(out, mine, group=group, async_op=True)

    if gathers_in_issue_order(group_name, dist.get_backend(group)):
        _chain_hops(out, group_name, [issue])
    else:
        torch._C._distributed_c10d._register_work(out, issue())
    return out


def _two_hop_gather(out: Tensor, shard: Tensor, hops: HopGroups) -> None:
    """`out` = every rank's shard in rank order, in two hops (a hop world,
    `zppc.runtime.topology.HopGroups`): the N shards of this rank's local
    index across the nodes, then those pieces inside the node, each local
    rank's N pieces landing in its column of `out` viewed as [N, D, n].

    The second hop is gloo's list all-gather with those strided columns as
    its outputs: gloo gathers into a flat buffer of its own either way (its
    `all_gather_into_tensor` is the list form over the output's chunks) and
    copies out of it, so the copy lands where the pieces belong; a
    local-major scratch of the gathered size and a transpose per gather are
    not needed."""
    nodes, per_node, n = hops.cross_node.size(), hops.intra_node.size(), shard.numel()
    across = shard.new_empty(nodes * n)
    columns = list(out.view(nodes, per_node, n).unbind(1))

    _chain_hops(
        out,
        hops.world,
        [
            lambda: compat.all_gather_single(across, shard, group=hops.cross_node, async_op=True),
            lambda: dist.all_gather(
                columns, across.view(nodes, n), group=hops.intra_node, async_op=True
            ),
        ],
    )


@torch.library.custom_op("zppc::reduce_scatter_in_two_hops", mutates_args=())
def reduce_scatter_in_two_hops(flat: Tensor, group_name: str) -> Tensor:
    """This rank's 1/world slice of the sum over the ranks of a rank-major flat
    `flat` [W * S], reduced over a reduction hop world of N nodes of D ranks
    (`zppc.runtime.topology.two_hop_reduce_over`): inside the node first, an
    all-to-all of the [D, N * S] rows that local rank d of every node owns
    (`zppc.kernels.qgz.reorder_for_two_hops`) and a sum of the D rows received,
    the node's partial sums of its N slices; then across the nodes, an
    all-to-all of those N slices and a sum of the N received. Each rank sends
    N - 1 slices over the inter-node link where a direct exchange sends
    W - D. Sums accumulate in fp32 and round to `flat`'s dtype once per hop.
    Asynchronous, like a functional collective: `_c10d_functional.wait_tensor`
    on the result waits for it."""
    from zppc.kernels.qgz import reorder_for_two_hops

    hops = two_hop_reduce_over(group_name)
    if hops is None:
        raise ValueError(f"group {group_name!r} is not a reduction hop world")
    nodes, per_node = hops.cross_node.size(), hops.intra_node.size()
    shard = flat.numel() // (nodes * per_node)
    rows = reorder_for_two_hops(flat.reshape(-1), nodes, per_node).reshape(-1)
    from_node = flat.new_empty(per_node * nodes * shard)
    from_nodes = flat.new_empty(nodes * shard)
    node_sums = flat.new_empty(nodes * shard)
    out = flat.new_empty(shard)

    def across_nodes():
        torch.sum(from_node.view(per_node, -1), dim=0, out=node_sums)
        return dist.all_to_all_single(from_nodes, node_sums, group=hops.cross_node, async_op=True)

    def sum_into_out() -> None:
        torch.sum(from_nodes.view(nodes, shard), dim=0, out=out)

    _chain_hops(
        out,
        hops.world,
        [
            lambda: dist.all_to_all_single(from_node, rows, group=hops.intra_node, async_op=True),
            across_nodes,
        ],
        sum_into_out,
    )
    return out


@reduce_scatter_in_two_hops.register_fake
def _(flat: Tensor, group_name: str) -> Tensor:
    return flat.new_empty(flat.numel() // group_size(group_name))


def _chain_hops(
    out: Tensor,
    chain: str,
    hops: Sequence[Callable[[], dist.Work]],
    finish: Callable[[], None] | None = None,
) -> None:
    """Register on `out` a work that completes once each hop in `hops` (a
    function issuing one collective) has run, in order, then `finish` (which
    fills `out`, where the last hop does not write it itself).

    Each hop is issued once the same hop of the previous collective of the
    chain named `chain` has completed (a hop world's name, or a plain gloo
    group's for its gathers): every rank issues them in the same order, each
    hop's gloo group has one collective in flight however many of the chain's
    collectives are (several in flight on one gloo group killed ranks here
    under load, `zppc.passes.overlap.one_in_flight_on_gloo`), and the link
    serves them in the order they were issued, which is the order the graph
    needs them. Over a hop world, a collective's first hop runs while the
    previous one's second does. A hop whose predecessors are done is issued
    at once, from the calling thread; otherwise from a completion callback,
    so the main thread never waits.

    Callbacks run on gloo's threads, where grad mode is on whatever the
    caller's was: hops are issued and `finish` runs with autograd off (a hop
    issued there once recorded a copy of a shard that required grad into
    c10d's views of the output, failed, and left the other ranks waiting).
    The registered work's `wait` raises a hop's failure on the waiting
    thread; c10d's work made from a future returns as if it had succeeded,
    and the rank went on with an unwritten `out`."""
    key = (world_epoch(), chain)
    before = _LATEST_HOPS.get(key, (_DONE,) * len(hops))
    hop_done = tuple(torch.futures.Future() for _ in hops)
    done: torch.futures.Future = torch.futures.Future()
    _LATEST_HOPS[key] = hop_done
    _UNFINISHED.add(done)
    done.add_done_callback(_UNFINISHED.discard)

    def fail(exc: BaseException) -> None:
        for future in (*hop_done, done):
            if not future.done():
                future.set_exception(exc)

    def finished(index: int) -> Callable[[torch.futures.Future], None]:
        def on_done(work: torch.futures.Future) -> None:
            with _in_chain_callback():
                try:
                    work.wait()
                    hop_done[index].set_result(None)
                    if index == len(hops) - 1:
                        if finish is not None:
                            with torch.no_grad():
                                finish()
                        done.set_result([out])
                except Exception as exc:  # noqa: BLE001  (handed to the waiting thread)
                    fail(exc)

        return on_done

    def issue_when(predecessors: list[torch.futures.Future], index: int) -> None:
        def issue_hop(collected: torch.futures.Future) -> None:
            with _in_chain_callback():
                try:
                    for future in collected.value():
                        future.wait()  # raises an earlier hop's failure
                    with torch.no_grad():
                        work = hops[index]()
                except Exception as exc:  # noqa: BLE001
                    fail(exc)
                    return
                work.get_future().then(finished(index))

        torch.futures.collect_all(predecessors).then(issue_hop)

    for index in range(len(hops)):
        this_collectives_previous_hop = [hop_done[index - 1]] if index else []
        issue_when([before[index], *this_collectives_previous_hop], index)
    torch._C._distributed_c10d._register_work(out, _ChainedWork(done))


class _ChainedWork(dist.Work):
    """A chained collective's work (`_chain_hops`): done once its future is,
    and its `wait` raises the error a hop failed with."""

    def __init__(self, done: torch.futures.Future) -> None:
        super().__init__()
        self._done = done

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for both hops; with a nonzero `timeout` (c10d's `Work.wait`
        argument; `wait_tensor` passes zero, c10d's "no timeout"), raise
        `TimeoutError` if they are not done by then."""
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        if seconds > 0 and not _wait_until_done([self._done], seconds):
            raise TimeoutError(f"a chained collective did not finish within {timeout}")
        self._done.wait()
        return True

    def is_completed(self) -> bool:
        return self._done.done()

    def get_future(self) -> torch.futures.Future:
        return self._done


def _wait_until_done(futures: list[torch.futures.Future], seconds: float) -> bool:
    """Whether every future is done within `seconds` (polled: the callbacks
    that complete them need the GIL this thread gives up while it sleeps)."""
    deadline = time.monotonic() + seconds
    while not all(f.done() for f in futures):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


# Chained collectives issued and not finished, whether or not anyone waits.
_UNFINISHED: set[torch.futures.Future] = set()
# How long the interpreter's exit waits for them (see `_finish_before_exit`).
EXIT_WAIT_S = 120.0
# When the latest of the chains' callbacks started (time.monotonic()), and how
# long after that the interpreter's exit leaves the thread that ran it.
_LATEST_CALLBACK_AT = float("-inf")
CALLBACK_SETTLE_S = 0.5


# Whether this thread is running one of the chains' callbacks (a gloo thread).
_CHAIN_CALLBACK = threading.local()


@contextlib.contextmanager
def _in_chain_callback() -> Iterator[None]:
    """The block a chain's callback runs in: its start is noted for the exit
    hook (`CALLBACK_SETTLE_S`), and `eager_collective` refuses its thread."""
    global _LATEST_CALLBACK_AT
    _LATEST_CALLBACK_AT = time.monotonic()
    # Callbacks nest: completing a future runs the callbacks already waiting
    # on it at once, on this thread.
    outer = getattr(_CHAIN_CALLBACK, "running", False)
    _CHAIN_CALLBACK.running = True
    try:
        yield
    finally:
        _CHAIN_CALLBACK.running = outer


@atexit.register
def _finish_before_exit() -> None:
    """Let chained collectives (`_chain_hops`) still in flight finish before the interpreter
    shuts down. Their next hops are issued from gloo's completion callbacks,
    Python code; one that ran during shutdown aborted the process ("terminate
    called without an active exception", where plain gloo collectives left
    unwaited exit cleanly): a script that ends, or is interrupted, with a
    chained collective issued and not waited (an exception or Ctrl-C between a
    graph's issue and its wait). Bounded, so a peer that is gone does not hold
    the exit: past `EXIT_WAIT_S` it says what it left and returns.

    Then it leaves the last callback's thread `CALLBACK_SETTLE_S` from that
    callback's start: after a Python callback returns, c10d's future still
    takes the GIL on that thread to drop the callback and its result
    (torch's `PythonFunctionGuard`), and a thread that takes the GIL once
    finalization has begun is ended, which aborts the process the same way
    (a 2 x 2 exit test aborted so once, its collectives all finished)."""
    pending = list(_UNFINISHED)
    if pending and not _wait_until_done(pending, EXIT_WAIT_S):
        left = sum(not f.done() for f in pending)
        print(
            f"zppc: {left} chained collective(s) still in flight after waiting "
            f"{EXIT_WAIT_S:.0f} s at exit; the process may abort",
            file=sys.stderr,
        )
        return
    settle = _LATEST_CALLBACK_AT + CALLBACK_SETTLE_S - time.monotonic()
    if settle > 0:
        time.sleep(settle)


# The predecessor of the first collective of a chain.
_DONE: torch.futures.Future = torch.futures.Future()
_DONE.set_result(None)
# (world epoch, chain name) -> futures completed once the latest collective
# of the chain finished each of its hops.
_LATEST_HOPS: dict[tuple[int, str], tuple[torch.futures.Future, ...]] = {}


@contextlib.contextmanager
def eager_collective(what: str, group_name: str) -> Iterator[None]:
    """The block a synchronous eager collective over `group_name` is issued
    in: a failure is named as `what` over the group's ranks (`waiting_on`),
    and the block starts once the collectives the runtime chained on that
    group (a plain gloo group's gathers, `_chain_hops`) are done. Beside
    them it would be a second collective in flight on one gloo group
    (`zppc.passes.overlap.one_in_flight_on_gloo`), matched against the other
    ranks' in whatever order each rank's threads got there. Nothing is in
    flight there between zppc's graphs (each waits its gathers before it
    returns); this keeps zppc's eager collectives (state dicts, clipping, an
    eager `unshard`) from ever doing so regardless.

    Never from a chain's callback (a hop, or the `finish` of `_chain_hops`),
    which raises instead of hanging the rank: a callback runs on a gloo
    thread, which would wait for futures only gloo's threads complete, or on
    the issuing thread where the chain had nothing to wait for, which would
    wait for the chain it is building."""
    where = f"{what} over ranks {group_ranks(group_name)}"
    if getattr(_CHAIN_CALLBACK, "running", False):
        raise RuntimeError(
            f"zppc: {where} was issued inside a chained collective's hop, where it would "
            "wait for that chain, or on a gloo thread for gloo's own work: issue it from "
            "the thread that issues the chained collective, before or after it"
        )
    with waiting_on(where):
        for future in _LATEST_HOPS.get((world_epoch(), group_name), ()):
            if not future.done():
                future.wait()  # raises the chained collective's failure
        yield


@all_gather_in_place.register_fake
def _(shard: Tensor, group_name: str) -> Tensor:
    return shard.new_empty(shard.numel() * group_size(group_name))


def all_gather_flat(shard: Tensor, group_name: str) -> Tensor:
    """Concatenation of every rank's 1-D shard, in group-rank order."""
    group = _GROUP_FROM_NAME(group_name)
    out = shard.new_empty(shard.numel() * group.size())
    with eager_collective("an eager all-gather", group_name):
        compat.all_gather_single(out, shard.contiguous(), group=group)
    record("all_gather", group_name, bytes_per_peer("all_gather", shard, group.size()))
    return out


def reduce_scatter_flat(flat: Tensor, group_name: str) -> Tensor:
    """Sum over ranks of `flat`, scattered: this rank gets its 1/world slice."""
    group = _GROUP_FROM_NAME(group_name)
    out = flat.new_empty(flat.numel() // group.size())
    with eager_collective("an eager reduce-scatter", group_name):
        compat.reduce_scatter_single(out, flat.contiguous(), op=dist.ReduceOp.SUM, group=group)
    record("reduce_scatter", group_name, bytes_per_peer("reduce_scatter", flat, group.size()))
    return out


def broadcast_from_first(tensors: list[Tensor], group_name: str) -> None:
    """Overwrite `tensors` on every rank with the group's first rank's values,
    one collective per dtype."""
    group = _GROUP_FROM_NAME(group_name)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        with eager_collective("the buffer broadcast", group_name):
            dist.broadcast(flat, group_src=0, group=group)
        record("broadcast", group_name, bytes_per_peer("broadcast", flat, group.size()))
        # Through `.data`: a version bump would fail the backward of an op that
        # saved the buffer (BatchNorm saves its running statistics, unused there).
        for t, value in zip(same, flat.split([t.numel() for t in same]), strict=True):
            t.data.copy_(value.view_as(t))


def all_gather_ints(out: Tensor, mine: Tensor, group_name: str) -> None:
    """Every rank's small integer tensor `mine`, concatenated into `out` (control
    decisions all ranks must take together)."""
    group = _GROUP_FROM_NAME(group_name)
    with eager_collective("the gradient check", group_name):
        compat.all_gather_single(out, mine, group=group)
    record("all_gather", group_name, bytes_per_peer("all_gather", mine, group.size()))


def all_reduce_sum(t: Tensor, group_name: str) -> Tensor:
    group = _GROUP_FROM_NAME(group_name)
    out = t.contiguous().clone()
    with eager_collective("an eager all-reduce", group_name):
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    record("all_reduce", group_name, bytes_per_peer("all_reduce", t, group.size()))
    return out
