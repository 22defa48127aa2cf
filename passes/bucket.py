"""The `bucket` pass: coalesce small collectives into flat buckets.

Requires: `zero` (and `qwz` when enabled): collectives in the form
`record_comm(input, kind, group) ; c = collective(input) ; w = wait(c)`
(`zero.CollectiveMatch`).

Rewrite: consecutive collectives of one kind, group and dtype are grouped, in
graph order, into buckets of at most `Config.bucket_bytes` (a collective larger
than that is a bucket of its own). At the default cap (`bucket_bytes=None`, one
repeated block's bytes) a bucket also never splits a repeated block that fits
in one: it closes before the block instead, so each bucket gathers whole blocks
(FSDP2's unit when each block is wrapped). What counts is the full tensor a bucket
materializes: an all-gather's gathered size in the parameter dtype (shard bytes
x group size, unquantized), a reduction's input. So a gathered bucket never
outgrows the cap as the world grows. Each bucket becomes one collective over
the concatenated inputs:

- parameter all-gathers (forward, and the backward re-gather): issued where the
  bucket's first member was (the inputs, which depend only on the shards, are
  hoisted there), so later members are prefetched; each member's result is
  its [world, n] column block of the gathered [world, sum n], made contiguous.
- reduce-scatters and all-reduces: issued where the bucket's last member was,
  once every input exists; reduce-scatter inputs are laid out rank-major
  ([world, sum n]) so each rank receives its shard of every member. The users
  of members' results move below the bucket.

Edge buckets: each graph's first parameter-gather bucket and its last
reduction bucket hold at most half the cap, or half a repeated block where
the cap is larger (`PassContext.edge_bucket_bytes`, `Config.edge_buckets`):
the leading gathers and the trailing reductions, whichever blocks they belong
to. Nothing computes before the first gather's use or after the last
reduction, so those buckets are exposed whole; half a block exposes half as
much, and the rest of the block, the next bucket, crosses the wire while the
edge's weights compute, hidden whenever compute takes as long as the link for
the same bytes. The cost model puts gpt-small at 50 Mbit/s from 80% of the
link hidden to 92%, zero3 + qwZ + hpZ from 73% to 89%; a third of the cap
gives 85% (the edge then holds no matrix weight). DDP's small first bucket is
the same idea.

Every rank buckets identically (graph order and sizes only). Numerics:
unchanged; each element is reduced with the same peers in the same dtype.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from zppc.passes.graph_utils import GraphBuilder
from zppc.passes.zero import (
    BLOCK_UNIT,
    GRAD_REDUCE,
    PARAM_GATHER,
    UNPADDED_BYTES,
    UNQUANTIZED_BYTES,
    CollectiveMatch,
    collective,
    flatten_padded,
    reduce_scatter,
)
from zppc.passes.zero import find_collectives as find_lowered
from zppc.runtime.topology import group_size

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
BUCKETED = ("all_gather", "reduce_scatter", "all_reduce")


def full_bytes(m: CollectiveMatch) -> int:
    """Bytes of the full tensor a collective materializes (see module doc)."""
    if m.kind != "all_gather":
        return m.input_bytes
    return m.wait.meta.get(UNQUANTIZED_BYTES, m.input_bytes) * group_size(m.group_name)


def find_collectives(graph: fx.Graph) -> list[CollectiveMatch]:
    """The collectives this pass may bucket: parameter gathers and reductions."""
    return [
        m
        for m in find_lowered(graph)
        if m.kind in BUCKETED and (m.kind != "all_gather" or m.wait.meta.get(PARAM_GATHER))
    ]


def plan_buckets(
    matches: list[CollectiveMatch],
    bucket_bytes: int,
    by_block: bool = False,
    edge_bytes: int | None = None,
) -> list[list[CollectiveMatch]]:
    """Greedy, in graph order: a bucket closes when the next member would not
    fit. With `by_block`, a run of consecutive members from one repeated block
    (`BLOCK_UNIT`) counts as one member, measured unpadded as the default cap
    is: a bucket closes before a block that would not fit, so a block is split
    only when it alone exceeds the cap. With `edge_bytes`, the edge buckets
    (`edge_buckets`) are set apart first and the rest planned as above."""
    edges = edge_buckets(matches, edge_bytes) if edge_bytes is not None else []
    in_edge = {m.wait for bucket in edges for m in bucket}
    rest = [m for m in matches if m.wait not in in_edge]
    run_of, run_bytes = _block_runs(rest) if by_block else ({}, [])
    buckets: list[list[CollectiveMatch]] = []
    open_by_key: dict[tuple, list[CollectiveMatch]] = {}
    filled: dict[tuple, int] = {}
    last_run: dict[tuple, int | None] = {}
    whole_run: dict[tuple, bool] = {}
    for m in rest:
        key = _key(m)
        current = open_by_key.get(key)
        run = run_of.get(m.wait)
        starts_run = run is not None and last_run.get(key) != run
        last_run[key] = run
        if run is not None and not starts_run and whole_run[key]:
            overflow = False  # the rest of a block that went in whole
        else:
            needed = run_bytes[run] if starts_run else full_bytes(m)
            overflow = current is None or filled[key] + needed > bucket_bytes
            if starts_run:
                whole_run[key] = run_bytes[run] <= bucket_bytes
        if overflow:
            current = []
            buckets.append(current)
            open_by_key[key], filled[key] = current, 0
        current.append(m)
        filled[key] += full_bytes(m)
    order = {m.wait: i for i, m in enumerate(matches)}
    planned = sorted(edges + buckets, key=lambda b: order[b[0].wait])
    return [b for b in planned if len(b) > 1]


def edge_buckets(matches: list[CollectiveMatch], edge_bytes: int) -> list[list[CollectiveMatch]]:
    """Per kind, group and dtype: the leading parameter gathers, or the trailing
    reductions, whose bytes together stay within `edge_bytes` (see module doc);
    none where the first (last) alone exceeds it."""
    by_key: dict[tuple, list[CollectiveMatch]] = {}
    for m in matches:
        by_key.setdefault(_key(m), []).append(m)
    edges = []
    for members in by_key.values():
        from_end = members[0].kind != "all_gather"
        edge, filled = [], 0
        for m in reversed(members) if from_end else members:
            if filled + full_bytes(m) > edge_bytes:
                break
            edge.append(m)
            filled += full_bytes(m)
        if edge:
            edges.append(edge[::-1] if from_end else edge)
    return edges


def _key(m: CollectiveMatch) -> tuple:
    """Collectives bucket together only with their own kind, group and dtype."""
    return (m.kind, m.group_name, m.dtype)


def _block_runs(matches: list[CollectiveMatch]) -> tuple[dict[fx.Node, int], list[int]]:
    """Runs of consecutive same-kind collectives whose parameters one repeated
    block uses (or no block): each member's wait -> its run, and each run's
    bytes unpadded."""
    run_of: dict[fx.Node, int] = {}
    run_bytes: list[int] = []
    open_run: dict[tuple, tuple[str | None, int]] = {}
    for m in matches:
        key = _key(m)
        unit = m.wait.meta.get(BLOCK_UNIT)
        previous = open_run.get(key)
        if previous is None or previous[0] != unit:
            previous = open_run[key] = (unit, len(run_bytes))
            run_bytes.append(0)
        run_of[m.wait] = previous[1]
        run_bytes[previous[1]] += m.wait.meta.get(UNPADDED_BYTES, full_bytes(m))
    return run_of, run_bytes


def bucket_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    # Buckets at the default cap (one repeated block's bytes) follow the blocks.
    by_block = ctx.config.bucket_bytes is None
    matches = find_collectives(gm.graph)
    for bucket in plan_buckets(matches, ctx.bucket_bytes, by_block, ctx.edge_bucket_bytes):
        if bucket[0].kind == "all_gather":
            _gather_bucket(gm, bucket)
        else:
            _reduce_bucket(gm, bucket)
    return gm


def _positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _hoist(node: fx.Node, before: fx.Node, pos: dict[fx.Node, int]) -> None:
    """Move `node`, and the inputs it needs, above `before` (gather inputs depend
    on graph inputs only: shards and their casts or quantization)."""
    if node.op != "call_function" or pos[node] < pos[before]:
        return
    for inp in node.all_input_nodes:
        _hoist(inp, before, pos)
    before.prepend(node)
    pos[node] = pos[before] - 0.5


def _sink_users(node: fx.Node) -> None:
    """Move the transitive users of `node` that sit above it to just below it,
    keeping their relative order (their other inputs are all above them)."""
    pos = _positions(node.graph)
    above: set[fx.Node] = set()
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user.op != "output" and pos[user] < pos[node] and user not in above:
                above.add(user)
                stack.append(user)
    cursor = node
    for user in sorted(above, key=pos.__getitem__):
        cursor.append(user)
        cursor = user


def _gather_bucket(gm: fx.GraphModule, bucket: list[CollectiveMatch]) -> None:
    first = bucket[0]
    pos = _positions(gm.graph)
    for m in bucket:
        _hoist(m.input, first.issue, pos)
    b = GraphBuilder(gm, first.issue)
    world = group_size(first.group_name)
    sizes = [m.input.meta["val"].numel() for m in bucket]
    flat = b.call(aten.cat.default, [m.input for m in bucket])
    gathered = collective(
        b,
        "all_gather",
        first.group_name,
        c10d.all_gather_into_tensor.default,
        flat,
        world,
        first.group_name,
    )
    gathered.meta[PARAM_GATHER] = True
    gathered.meta[UNQUANTIZED_BYTES] = sum(
        m.wait.meta.get(UNQUANTIZED_BYTES, m.input_bytes) for m in bucket
    )
    columns = b.call(
        aten.split_with_sizes.default,
        b.call(aten.view.default, gathered, [world, sum(sizes)]),
        sizes,
        1,
    )
    results = []
    for i in range(len(bucket)):
        column = b.call(operator.getitem, columns, i)
        contiguous = b.call(aten.clone.default, column, memory_format=torch.contiguous_format)
        results.append(b.call(aten.view.default, contiguous, [-1]))
    # Replace only once every new node exists: replacing erases the anchor.
    for m, result in zip(bucket, results, strict=True):
        m.replace_with(result)


def _reduce_bucket(gm: fx.GraphModule, bucket: list[CollectiveMatch]) -> None:
    last = bucket[-1]
    b = GraphBuilder(gm, last.issue)
    group_name, kind = last.group_name, last.kind
    world = group_size(group_name)
    sizes = [m.input.meta["val"].numel() for m in bucket]
    if kind == "reduce_scatter":
        # Rank-major: row r holds every member's slice for rank r.
        rows = [
            b.call(aten.view.default, m.input, [world, n // world])
            for m, n in zip(bucket, sizes, strict=True)
        ]
        flat = b.call(aten.view.default, b.call(aten.cat.default, rows, 1), [-1])
        reduced = reduce_scatter(b, flat, group_name, world)
        sizes = [n // world for n in sizes]
        if all(m.wait.meta.get(GRAD_REDUCE) for m in bucket):
            reduced.meta[GRAD_REDUCE] = True
    else:
        flats = [flatten_padded(b, m.input, n) for m, n in zip(bucket, sizes, strict=True)]
        reduced = collective(
            b,
            kind,
            group_name,
            c10d.all_reduce.default,
            b.call(aten.cat.default, flats),
            "sum",
            group_name,
        )
    pieces = b.call(aten.split_with_sizes.default, reduced, sizes)
    for i, m in enumerate(bucket):
        result = b.call(
            aten.view.default, b.call(operator.getitem, pieces, i), list(m.wait.meta["val"].shape)
        )
        m.replace_with(result)
        _sink_users(result)
