"""The `overlap` pass: decide when each collective is issued and waited.

Requires: every pass that creates or rewrites collectives has run (zero, qwz,
bucket, qgz, sync_buffers): collectives in the `CollectiveMatch` form, ledger
hook + issue + wait. Must run last.

Rewrite (node order only; nothing is added or removed, so numerics are
unchanged):

1. Every collective other than a parameter gather (reductions, qgZ's hops,
   buffer broadcasts) is issued as soon as its input exists: the ops that
   produce its input from the gradients move up to just after their own
   inputs (a weight's gradient matmul among them).
2. Parameter gathers are prefetched `Config.prefetch` buckets ahead, bounded
   by memory: gather k (in program order) is issued right after the last use
   of gather k - prefetch - 1's weights (the first prefetch + 1 gathers at the
   top of the graph), together with its ledger hook and the shard-side ops
   that produce its input (casts, qwZ's quantization, the bucket's concat). So
   gather k crosses the wire while the compute of gathers k - prefetch .. k - 1
   runs, and at most prefetch + 1 gathered buckets are alive at any point,
   besides resident ones (weights the model reads again later, such as a tied
   embedding: see `prefetch_gathers`). In a backward, the weights the forward
   kept gathered (`Config.keep_last_block`) count as its first bucket. Given
   `Config.cost_model`, each gather
   is issued instead as late as that bound still leaves it hidden: at the
   last point where the estimated compute before its first use covers its
   estimated transfer, on a link not busy with another collective then (see
   `LinkTimeline`, which reads the compute in its order after step 1); where
   no such point exists, as early as the bound allows.
3. Every wait moves to just before the first node that uses its result. A
   gradient reduction (a result only the graph's output reads) is waited just
   before the reduction `prefetch + 1` places later is issued: it stays in
   flight while the backward computes, and the gradient buckets in flight stay
   bounded too (waiting all of them at the end kept every bucket's full
   gradient alive: +72 MiB peak per rank on gpt-medium at 2 ranks).

4. On gloo groups, at most one collective per group is in flight
   (`one_in_flight_on_gloo`), except where the runtime chains them: over a
   hop world (gathers and reductions over several nodes of several ranks) a
   two-hop collective's runtime issues each hop once the previous
   collective's same hop is done, so each of its gloo groups carries one hop
   at a time while step 3's order stands: `prefetch` gathers ahead, as on
   NCCL, and `prefetch + 1` reductions in flight, one's intra-node hop beside
   the previous one's crossing of the link. Gathers over a plain gloo group
   are chained the same way, one hop each, so they too stay `prefetch` ahead
   and cross in the order they are needed. Other collectives on a plain gloo
   group (the reductions, on its twin) have been spread by the `lanes` pass
   over `prefetch + 1` groups over the same ranks, so the rule holds per lane
   and as many are in flight.

Why a zppc pass and not torch's `schedule_overlap_bucketing`: torch's decides
by estimated runtimes and a memory-ratio budget, and it reorders compute too.
zppc's contract is a stated prefetch depth with a hard bound on gathered
buckets alive, the same decisions on every rank (graph order and the config,
its cost model included, only) and identical behaviour under both lowerings (the eager lowering runs the
graph in this order; for Inductor the backend keeps it, see `backend.py`).
"""

from __future__ import annotations

import bisect
import dataclasses

import torch
from torch import fx
from zppc.passes.zero import (
    COLLECTIVE_KINDS,
    KEPT_GATHERED,
    PARAM_GATHER,
    RECORD,
    CollectiveMatch,
    find_collectives,
)
from zppc.runtime import compat
from zppc.runtime.topology import (
    gathers_in_issue_order,
    group_backend,
    group_ranks,
    two_hop_gather_over,
    two_hop_reduce_over,
)

from zppc.cost import CostModel, collective_seconds

WAIT = torch.ops._c10d_functional.wait_tensor.default
# A tail that reaches one of these is not a pure consumer of a result.
COLLECTIVE_OPS = {*COLLECTIVE_KINDS, RECORD}


class _Order:
    """Node positions that stay comparable while nodes move: one O(n) scan,
    then O(1) per move and per comparison, so the pass stays linear in the
    graph's size. Positions are integers 2^64 apart; a moved node takes a
    point at most 2^32 above its new predecessor (the midpoint if the gap is
    narrower), so a cursor placing node after node, or nodes inserted one by
    one before the same anchor, use up a gap only after 2^32 moves. Only
    alternating insertions halve a gap each time; when one runs out the graph
    is numbered afresh (a gpt-18b plan halved floats' gaps 764 times: 55 s)."""

    SPACING = 1 << 64
    STEP = 1 << 32

    def __init__(self, graph: fx.Graph):
        self._number(graph)

    def _number(self, graph: fx.Graph) -> None:
        self.pos = {n: i * self.SPACING for i, n in enumerate(graph.nodes)}

    def __getitem__(self, node: fx.Node) -> int:
        return self.pos[node]

    def move_before(self, node: fx.Node, anchor: fx.Node) -> None:
        if node is anchor or node.next is anchor:
            return
        anchor.prepend(node)
        low, high = self.pos[node.prev], self.pos[anchor]
        if high - low < 2:
            self._number(anchor.graph)
            return
        self.pos[node] = low + min((high - low) // 2, self.STEP)


class _Cursor:
    """Places nodes one after another, starting just after `after`."""

    def __init__(self, after: fx.Node, order: _Order):
        self.after, self.order = after, order

    def place(self, node: fx.Node) -> None:
        if node is not self.after.next:
            self.order.move_before(node, self.after.next)
        self.after = node


def overlap_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    graph = gm.graph
    matches = find_collectives(graph)
    order = _Order(graph)
    gathers = [m for m in matches if is_param_gather(m)]
    others = [m for m in matches if not is_param_gather(m)]
    # Step 1, latest first: an earlier collective raised afterwards lands right
    # after its inputs, ahead of the compute a later one pulled up.
    for m in reversed(others):
        issue_early(m, order)
    # The compute is in its final order now (raising a reduction's inputs
    # moves compute: a weight's gradient matmul), so the cost model's clock
    # is read from it.
    cost = ctx.config.cost_model
    timeline = LinkTimeline(graph, matches, gathers, cost) if cost is not None else None
    prefetch_gathers(graph, gathers, ctx.config.prefetch, ctx.bucket_bytes, order, timeline)
    (output,) = graph.find_nodes(op="output")
    defer_reductions(others, ctx.config.prefetch + 1, output, order)
    for m in matches:
        wait_at_first_use(m, order)
    one_in_flight_on_gloo(matches, order)
    return gm


@dataclasses.dataclass(frozen=True)
class StreamedBucket:
    """Gathered weights that die before the next bucket's do, in the order
    they are used: a gather's bucket, or (`gather` None) weights the forward
    kept gathered for the backward (`Config.keep_last_block`), gathered
    already: the backward's first buckets."""

    gather: CollectiveMatch | None
    weights: tuple[fx.Node, ...]
    """The nodes holding the gathered weights: the gather's wait, or the
    backward's inputs the forward saved."""
    last_use: fx.Node


def weights_last_use(weights: tuple[fx.Node, ...], order: _Order) -> fx.Node:
    """The last node that reads gathered `weights` or a tensor made from them
    alone (views, column copies, casts, qwZ's dequantization): after it, the
    gathered bucket is dead. The graph output does not count: what a forward
    saves from a gathered weight (hpZ's secondary shard) is a new, smaller
    tensor."""
    derived, readers = _weight_readers(weights)
    return max([*weights, *derived, *readers], key=order.__getitem__)


def kept_gathered_inputs(graph: fx.Graph) -> tuple[fx.Node, ...]:
    """The backward's inputs that are weights the forward kept gathered."""
    return tuple(n for n in graph.find_nodes(op="placeholder") if n.meta.get(KEPT_GATHERED))


def _weight_readers(weights: tuple[fx.Node, ...]) -> tuple[set[fx.Node], set[fx.Node]]:
    """The tensors made from gathered `weights` alone (the weights among
    them), and the nodes that read one of them but also read something else
    (a matmul, a layer norm's scale): these compute with the weights; what is
    made from them alone is views and copies of the bucket."""
    derived, readers, stack = set(weights), set(), list(weights)
    while stack:
        for user in stack.pop().users:
            if user.op == "output" or user in derived or user in readers:
                continue
            if all(inp in derived for inp in user.all_input_nodes):
                derived.add(user)
                stack.append(user)
            else:
                readers.add(user)
    return derived, readers


def prefetch_gathers(
    graph: fx.Graph,
    gathers: list[CollectiveMatch],
    prefetch: int,
    bucket_bytes: int,
    order: _Order,
    timeline: LinkTimeline | None = None,
) -> None:
    """Step 2 of the module doc. A bucket whose weights outlive the next
    bucket's (a tied embedding, read at both ends of the forward) is resident:
    it stays where it is and does not count against the bound, or it would
    stop all prefetching while it lives. Gathers that share an issue point
    keep their program order (one cursor per point)."""
    placeholders = graph.find_nodes(op="placeholder")
    if not gathers or not placeholders:
        return
    streamed = streamed_buckets(graph, gathers, bucket_bytes, order)
    program_order = {m: i for i, m in enumerate(gathers)}
    streaming = {b.gather for b in streamed}
    resident = [m for m in gathers if m not in streaming]
    cursors: dict[fx.Node, _Cursor] = {}
    for k, bucket in enumerate(streamed):
        m = bucket.gather
        if m is None:
            continue  # the kept weights: gathered in the forward
        # A resident bucket used before this one is issued before it:
        # collectives on one group run in the order they are issued (gloo's
        # one in flight, NCCL's stream), so a tied embedding issued after the
        # first prefetches held the forward's first compute behind all of them.
        used_earlier = [r for r in resident if program_order[r] < program_order[m]]
        resident = resident[len(used_earlier) :]
        release = streamed[k - prefetch - 1].last_use if k > prefetch else placeholders[-1]
        if order[m.issue] <= order[release]:
            continue  # already issued earlier than the memory bound allows
        point = release if timeline is None else timeline.latest_hidden_issue(m, release, order)
        cursor = cursors.setdefault(point, _Cursor(point, order))
        for r in used_earlier:
            if order[r.issue] > order[cursor.after]:
                _place_gather(r, cursor)
        _place_gather(m, cursor)


def _place_gather(m: CollectiveMatch, cursor: _Cursor) -> None:
    """The gather's input (and what makes it), its ledger hook and its issue, at the cursor."""
    _hoist(m.input, cursor)
    cursor.place(m.record)
    cursor.place(m.issue)


def streamed_buckets(
    graph: fx.Graph, gathers: list[CollectiveMatch], bucket_bytes: int, order: _Order
) -> list[StreamedBucket]:
    """The gathers in program order with their weights' last use, resident
    buckets left out (see `prefetch_gathers`), after the weights the forward
    kept gathered where the graph has any (`kept_buckets`): they count against
    the bound like the buckets they replace (counted as nothing, the
    backward's second gather went out at its start too: a third block alive,
    gpt-small at batch 64, +3 MiB at the peak of live tensors). Buckets whose
    weights die at the same node (a linear's weight and bias, split by a
    small cap) both stream: counting the first as resident left its gather
    unprefetched, issued right before its use (gpt-tiny at 30 kB buckets)."""
    buckets = kept_buckets(kept_gathered_inputs(graph), bucket_bytes, order)
    buckets += [StreamedBucket(m, (m.wait,), weights_last_use((m.wait,), order)) for m in gathers]
    return [
        b
        for k, b in enumerate(buckets)
        if k + 1 == len(buckets) or order[b.last_use] <= order[buckets[k + 1].last_use]
    ]


def kept_buckets(
    kept: tuple[fx.Node, ...], bucket_bytes: int, order: _Order
) -> list[StreamedBucket]:
    """The kept weights as the buckets they take the place of: in the order
    the backward is done with them, each group within `bucket_bytes` (a
    weight larger than that alone). The keep budget may exceed one bucket
    (`PassContext.kept_gathered_bytes`); so grouped, the backward's first
    gathers still wait for kept weights to die as for gathered ones, and at
    most `prefetch + 1` buckets' worth stays alive."""
    last_use = {w: weights_last_use((w,), order) for w in kept}
    buckets: list[list[fx.Node]] = []
    filled = 0
    for w in sorted(kept, key=lambda w: order[last_use[w]]):
        value = w.meta["val"]
        size = value.numel() * value.element_size()
        if not buckets or filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(w)
        filled += size
    return [StreamedBucket(None, tuple(b), weights_last_use(tuple(b), order)) for b in buckets]


def pin_gather_issues(gm: fx.GraphModule, prefetch: int, bucket_bytes: int) -> None:
    """Make the memory bound of `prefetch_gathers` a data dependency, for
    Inductor. Its scheduler keeps the graph's order only where data demands
    it: fusion moves a computation down to the kernel it joins, so a block's
    last layer-norm backward, fused with the next block's bias-gradient sum,
    read its gathered weights after the gather two buckets on was issued
    (three gathered buckets alive, gpt-small at world 2: +3 MiB at the peak).
    Here each streamed gather's issue waits, through torch's `control_deps`,
    for every node that computes with the weights of the bucket it replaces
    (and what the graph saves from them); those become buffers of their own,
    so no kernel reads that bucket after the gather. Run on the final graph, right before Inductor lowers it: the
    graph no longer has the `CollectiveMatch` form other passes look for."""
    from torch.utils._ordered_set import OrderedSet

    order = _Order(gm.graph)
    gathers = [m for m in find_collectives(gm.graph) if is_param_gather(m)]
    streamed = streamed_buckets(gm.graph, gathers, bucket_bytes, order)
    deps: dict[fx.Node, OrderedSet[fx.Node]] = {}
    for k in range(prefetch + 1, len(streamed)):
        if streamed[k].gather is None:
            continue  # kept weights: gathered in the forward
        issue = streamed[k].gather.issue
        derived, readers = _weight_readers(streamed[k - prefetch - 1].weights)
        # What the graph outputs from the weights alone (hpZ's secondary shard)
        # is computed from the bucket too.
        saved = {d for d in derived if any(u.op == "output" for u in d.users)}
        before = sorted(
            (r for r in readers | saved if order[r] < order[issue]), key=order.__getitem__
        )
        if before:
            deps[issue] = OrderedSet(before)
    compat.preserve_node_ordering(gm.graph, deps)
    gm.recompile()


# A gather is issued where the compute before its use would hide its
# estimated transfer this many times over: the estimates are good to tens of
# percent (benchmarks/predict.py), and a gather late by its estimate's error
# stalls compute, where one early costs only memory for a while.
HIDING_MARGIN = 2.0


class LinkTimeline:
    """Estimated times of one graph under `Config.cost_model`, for issuing
    each gather as late as still hides it. Compute runs in program order with
    no stalls, each node at the cost model's time; the link carries one
    collective at a time (as gloo's one-in-flight rule and the cost model's
    replay have it). Every collective other than a gather is already where
    step 1 issues it, and holds the link from then, first come first served;
    a gather takes the latest free stretch of link, long enough for its
    transfer, that ends before its first use and starts after its memory
    bound. The estimates depend on the graph and the Config alone (each
    collective costed at its group's first rank), so every rank decides
    alike."""

    def __init__(
        self,
        graph: fx.Graph,
        matches: list[CollectiveMatch],
        gathers: list[CollectiveMatch],
        cost: CostModel,
    ):
        collective_nodes = {n for m in matches for n in (m.record, m.issue, m.wait)}
        moving = {n for m in gathers for n in _private_producers(m.issue)}
        self.compute: dict[fx.Node, float] = {}
        self.clock: dict[fx.Node, float] = {}
        """The compute clock after each node, in the graph's order after step 1."""
        self.anchors: set[fx.Node] = set()
        """The nodes that keep their place: the points a gather may be issued after."""
        clock = 0.0
        for node in graph.nodes:
            # A gather's input chain (casts, quantization, the bucket's concat)
            # moves with the gather: where it stands now, it hides nothing.
            stays = node not in collective_nodes and node not in moving
            self.compute[node] = cost.node_seconds(node) if stays else 0.0
            clock += self.compute[node]
            self.clock[node] = clock
            if stays:
                self.anchors.add(node)
        self.seconds = {m: _transfer_seconds(m, cost) for m in matches}
        self.busy: list[tuple[float, float]] = []
        streamed_later = set(gathers)
        link_free = 0.0
        others = [m for m in matches if m not in streamed_later]
        for m in sorted(others, key=lambda m: self.clock[m.issue]):
            start = max(self.clock[m.issue], link_free)
            link_free = start + self.seconds[m]
            self._occupy(start, link_free)

    def latest_hidden_issue(self, m: CollectiveMatch, release: fx.Node, order: _Order) -> fx.Node:
        """The node after which to issue gather `m`: the latest one after
        `release` from which its transfer, `HIDING_MARGIN` times over, ends on
        a free link before its first use; `release` where there is none."""
        use = min(m.wait.users, key=order.__getitem__)
        seconds = self.seconds[m]
        hiding = HIDING_MARGIN * seconds
        deadline = self.clock[use] - self.compute[use]
        node = use.prev
        while node is not release and node.op != "placeholder":
            start = self.clock[node]
            if node in self.anchors and start + hiding <= deadline and self._free(start, hiding):
                self._occupy(start, start + seconds)
                return node
            node = node.prev
        self._occupy_first_free(self.clock[release], seconds)
        return release

    def _free(self, start: float, seconds: float) -> bool:
        k = bisect.bisect_left(self.busy, (start + seconds,))
        return k == 0 or self.busy[k - 1][1] <= start

    def _occupy(self, start: float, end: float) -> None:
        if end > start:
            bisect.insort(self.busy, (start, end))

    def _occupy_first_free(self, start: float, seconds: float) -> None:
        k = bisect.bisect_left(self.busy, (start,))
        if k and self.busy[k - 1][1] > start:
            start = self.busy[k - 1][1]
        while k < len(self.busy) and self.busy[k][0] < start + seconds:
            start = max(start, self.busy[k][1])
            k += 1
        self._occupy(start, start + seconds)


def _transfer_seconds(m: CollectiveMatch, cost: CostModel) -> float:
    """`m`'s time on the links, costed at its group's first rank (every rank
    the same) under the algorithms its backend runs."""
    from zppc.schedule import point_of, scheduled_collective

    entry = scheduled_collective(point_of(m), "", 0, group_ranks(m.group_name)[0])
    return collective_seconds(dataclasses.replace(cost.links, gloo=on_gloo(m.group_name)), entry)


def _hoist(node: fx.Node, cursor: _Cursor) -> None:
    """Place `node` at the cursor after the producers it needs (a parameter
    gather's input depends on graph inputs only: shards, their casts or
    quantization, the bucket's concat)."""
    if node.op != "call_function" or cursor.order[node] <= cursor.order[cursor.after]:
        return
    for inp in node.all_input_nodes:
        _hoist(inp, cursor)
    cursor.place(node)


def issue_early(m: CollectiveMatch, order: _Order) -> None:
    """Move the collective (and the ops between its inputs' producers and it)
    up to just after the latest node it depends on."""
    chain = _private_producers(m.issue)
    for node in sorted(chain, key=order.__getitem__):
        _raise_to_inputs(node, order)
    # The ledger hook reads the collective's input: it goes right before the issue.
    _raise_to_inputs(m.issue, order)
    order.move_before(m.record, m.issue)


def _private_producers(issue: fx.Node) -> list[fx.Node]:
    """The ops that exist only to build a collective's input (flatten, pad,
    concat, casts, quantization): producers whose every user is in the chain
    (or is the collective's ledger hook)."""
    chain: set[fx.Node] = set()
    stack = [issue]
    while stack:
        for inp in stack.pop().all_input_nodes:
            if inp.op != "call_function" or inp in chain or inp.target == WAIT:
                continue
            if all(u in chain or u is issue or u.target == RECORD for u in inp.users):
                chain.add(inp)
                stack.append(inp)
    return list(chain)


def _raise_to_inputs(node: fx.Node, order: _Order) -> None:
    inputs = node.all_input_nodes
    if not inputs:
        return
    latest = max(inputs, key=order.__getitem__)
    target = latest.next
    while target.op == "placeholder":
        target = target.next
    if order[target] < order[node]:
        order.move_before(node, target)


def defer_reductions(
    others: list[CollectiveMatch], in_flight: int, output: fx.Node, order: _Order
) -> None:
    """Step 3 for collectives whose result only feeds the graph's output (a
    gradient reduction: its average, cast and views): the wait and those ops
    move to just before the collective `in_flight` places later in issue order
    is issued, or before the output. Each such collective completes while the
    backward computes, and at most `in_flight` of them, with the gradient
    buckets they hold, are in flight at once. A result that feeds another
    collective (qgZ's first hop feeds the second) is waited at its first use."""
    tails = {m: _output_only_tail(m.wait, order) for m in others}
    deferred = sorted((m for m in others if m.wait in tails[m]), key=lambda m: order[m.issue])
    for k, m in enumerate(deferred):
        bound = deferred[k + in_flight].record if k + in_flight < len(deferred) else output
        nodes = sorted(tails[m], key=order.__getitem__)
        outside = [i for n in nodes for i in n.all_input_nodes if i not in tails[m]]
        if any(order[i] >= order[bound] for i in outside):
            bound = output  # the tail reads something computed later
        for node in nodes:
            order.move_before(node, bound)


def one_in_flight_on_gloo(matches: list[CollectiveMatch], order: _Order) -> None:
    """On gloo process groups, a collective's wait moves up to just before the
    next collective on the same group is issued: one collective in flight per
    group, still overlapping compute. Observed here: with several in flight on
    one gloo group (zppc's overlap, and FSDP2's prefetch alike), a rank now
    and then died without a message, under load. Two kinds keep step 3's
    depth all the same, because their runtime puts one hop at a time on each
    gloo group (`zppc.runtime.collectives._chain_hops`): collectives over a
    hop world (several nodes of several ranks), and gathers over a plain
    gloo group, which cross in the order they were issued
    (`gathers_in_issue_order`); another collective on that group still waits
    for them, and they for it. NCCL keeps the full order; a plan does what
    the backend it plans for does. The backend is a property of the group,
    the same on every rank."""
    in_flight: dict[str, list[CollectiveMatch]] = {}
    for m in sorted(matches, key=lambda m: order[m.issue]):
        if not one_at_a_time(m.group_name):
            continue
        issued_at = min(m.record, m.issue, key=order.__getitem__)
        still_in_flight = []
        for before in in_flight.get(m.group_name, ()):
            if order[before.wait] < order[m.issue]:
                continue
            if queued_in_issue_order(before) and queued_in_issue_order(m):
                still_in_flight.append(before)
            else:
                order.move_before(before.wait, issued_at)
        in_flight[m.group_name] = [*still_in_flight, m]


def is_param_gather(m: CollectiveMatch) -> bool:
    return bool(m.wait.meta.get(PARAM_GATHER))


def one_at_a_time(group_name: str) -> bool:
    """Whether the plan keeps the group to one collective in flight: a gloo
    group, not a hop world (whose runtime chains the hops itself)."""
    return (
        on_gloo(group_name)
        and two_hop_gather_over(group_name) is None
        and two_hop_reduce_over(group_name) is None
    )


def queued_in_issue_order(m: CollectiveMatch) -> bool:
    """Whether the runtime queues `m` behind the earlier gathers over its group
    (`gathers_in_issue_order`): every all-gather lowers to
    `zppc::all_gather_in_place`, which does."""
    return m.kind == "all_gather" and gathers_in_issue_order(m.group_name, backend_of(m.group_name))


def on_gloo(group_name: str) -> bool:
    return backend_of(group_name) == "gloo"


def backend_of(group_name: str) -> str:
    """The group's backend: a plan's groups (the fake process group) stand for
    the backend it plans for."""
    from zppc.passes import planned_backend

    return planned_backend() or group_backend(group_name)


def _output_only_tail(wait: fx.Node, order: _Order) -> set[fx.Node]:
    """The ops downstream of `wait` whose every user is the output or another
    such op, collectives excluded."""
    downstream, stack = {wait}, [wait]
    while stack:
        for user in stack.pop().users:
            if user.op == "call_function" and user not in downstream:
                downstream.add(user)
                stack.append(user)
    tail: set[fx.Node] = set()
    for node in sorted(downstream, key=order.__getitem__, reverse=True):
        if node.target in COLLECTIVE_OPS:
            continue
        if all(u.op == "output" or u in tail for u in node.users):
            tail.add(node)
    return tail


def wait_at_first_use(m: CollectiveMatch, order: _Order) -> None:
    first = min(m.wait.users, key=order.__getitem__)
    if order[first] > order[m.wait]:
        order.move_before(m.wait, first)
