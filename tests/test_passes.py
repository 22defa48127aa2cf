"""Pass unit tests on small traced graphs, in one process (fake process group
where a pass needs a group's size): the ops each pass inserts, their groups
and sizes."""

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore
from zppc.passes import PassContext, build_passes, run_passes
from zppc.passes.bucket import find_collectives, full_bytes, plan_buckets
from zppc.passes.dedupe import dedupe_unshard_pass
from zppc.passes.graph_utils import REDUCE_GRAD, UNSHARD, op_census
from zppc.passes.partition import zppc_partition

import zppc

WORLD = 4
c10d = torch.ops._c10d_functional


@pytest.fixture
def fake_pg():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=WORLD)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def unshard(shard, shape, mode="zero3", group="0"):
    return torch.ops.zppc.unshard(shard, list(shape), group, mode, None, None)


def count(gm, target) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=target))


def test_dedupe_merges_identical_gathers_only():
    def f(a, b):
        return unshard(a, [3, 2]) + unshard(a, [3, 2]) * unshard(b, [3, 2])

    gm = make_fx(f, tracing_mode="fake")(torch.randn(2), torch.randn(2))
    assert count(gm, UNSHARD) == 3
    gm = dedupe_unshard_pass(gm, None)
    gm.graph.eliminate_dead_code()
    assert count(gm, UNSHARD) == 2


def partitioned(mode, group):
    """Forward and backward graphs of x @ W.T with W = unshard(shard), split by zppc_partition."""
    graphs = {}

    def keep(kind):
        def compiler(gm, inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)

        return compiler

    from torch._functorch.aot_autograd import aot_function, make_boxed_func

    def f(shard, x):
        return (x @ unshard(shard, [5, 7], mode, group).t()).sum()

    shard = torch.randn(9, requires_grad=True)  # ceil(35 / 4)
    x = torch.randn(3, 7, requires_grad=True)
    aot_function(f, keep("forward"), keep("backward"), partition_fn=zppc_partition)(
        shard, x
    ).backward()
    return graphs


def saved_shapes(forward_gm) -> list:
    (outputs,) = forward_gm.graph.find_nodes(op="output")[0].args
    return [tuple(n.meta["val"].shape) for n in outputs[1:]]


def test_partition_regathers_for_zero3_and_saves_for_zero2(fake_pg):
    zero3 = partitioned("zero3", fake_pg)
    assert not {(5, 7), (7, 5)} & set(saved_shapes(zero3["forward"]))
    assert count(zero3["backward"], UNSHARD) == 1 and count(zero3["backward"], REDUCE_GRAD) == 1

    zero2 = partitioned("zero2", fake_pg)
    assert {(5, 7), (7, 5)} & set(saved_shapes(zero2["forward"]))
    assert count(zero2["backward"], UNSHARD) == 0


def test_zero_pass_lowers_to_collectives_with_ledger_hooks(fake_pg):
    graphs = partitioned("zero3", fake_pg)
    config = zppc.Config(lowering="eager", disable_passes=("bucket",))
    for kind, expected in (
        ("forward", {"all_gather"}),
        ("backward", {"all_gather", "reduce_scatter"}),
    ):
        gm = run_passes(graphs[kind], PassContext(config, kind))
        assert count(gm, UNSHARD) == count(gm, REDUCE_GRAD) == 0
        records = gm.graph.find_nodes(op="call_function", target=torch.ops.zppc.record_comm.default)
        assert {r.args[1] for r in records} == expected
        assert {r.args[2] for r in records} == {fake_pg}
        for r in records:
            # Counted at issue from the input (never the result): a 9-element
            # shard gathered, or the 36-element padded gradient reduce-scattered.
            assert r.next.args[0] is r.args[0]
            assert r.args[0].meta["val"].numel() == (9 if r.args[1] == "all_gather" else WORLD * 9)
    gather = graphs["forward"].graph.find_nodes(
        op="call_function", target=c10d.all_gather_into_tensor.default
    )
    assert gather[0].args[1:] == (WORLD, fake_pg)


def test_bucket_plan_is_greedy_in_graph_order(fake_pg):
    def f(a, b, c, d):
        return sum(unshard(s, [4 * n]).sum() for s, n in ((a, 2), (b, 2), (c, 1), (d, 3)))

    gm = make_fx(f, tracing_mode="fake")(
        torch.randn(2), torch.randn(2), torch.randn(1), torch.randn(3)
    )
    for node in gm.graph.nodes:
        node.meta.setdefault("val", None)
    from zppc.passes import PassContext
    from zppc.passes.zero import zero_pass

    gm = zero_pass(gm, PassContext(zppc.Config(), "forward"))
    matches = find_collectives(gm.graph)
    assert [m.input_bytes for m in matches] == [8, 8, 4, 12]
    # Capped by what a bucket gathers (shard bytes x WORLD), not by the shards.
    assert [full_bytes(m) for m in matches] == [32, 32, 16, 48]
    plan = plan_buckets(matches, bucket_bytes=64)
    assert [[full_bytes(m) for m in b] for b in plan] == [[32, 32], [16, 48]]
    # A bucket closes when the next member would overflow; singletons are left alone.
    plan = plan_buckets(matches, bucket_bytes=80)
    assert [[full_bytes(m) for m in b] for b in plan] == [[32, 32, 16]]


def test_default_buckets_close_at_block_boundaries(fake_pg):
    """At the default cap a bucket holds whole repeated blocks: it closes before
    a block that would not fit (greedy would split it), and only a block larger
    than the cap is split. Blocks are measured unpadded, as the cap is."""
    from zppc.passes.zero import BLOCK_UNIT, UNPADDED_BYTES

    def f(*shards):
        return sum(unshard(s, [4 * s.numel()]).sum() for s in shards)

    gm = make_fx(f, tracing_mode="fake")(*(torch.randn(n) for n in (1, 1, 2, 2, 3, 3, 1)))
    for node in gm.graph.nodes:
        node.meta.setdefault("val", None)
    from zppc.passes import PassContext
    from zppc.passes.zero import zero_pass

    gm = zero_pass(gm, PassContext(zppc.Config(), "forward"))
    matches = find_collectives(gm.graph)
    units = ["a", "a", "b", "b", "c", "c", None]
    for m, unit in zip(matches, units, strict=True):
        m.wait.meta[BLOCK_UNIT] = unit
        # Padding makes the gathered tensor larger than the parameter (-4 bytes).
        m.wait.meta[UNPADDED_BYTES] = full_bytes(m) - 4
    assert [full_bytes(m) for m in matches] == [16, 16, 32, 32, 48, 48, 16]

    def sizes(plan):
        return [[full_bytes(m) for m in b] for b in plan]

    # Greedy at 64 splits block b across two buckets (b's second member and
    # c's first are singletons, left alone).
    assert sizes(plan_buckets(matches, 64)) == [[16, 16, 32], [48, 16]]
    # By block: a + nothing of b (a's 24 + b's 56 > 64), b whole (its padded 64
    # counted as 56), c alone exceeds the cap (88 > 64) and is split, greedily.
    assert sizes(plan_buckets(matches, 64, by_block=True)) == [[16, 16], [32, 32], [48, 16]]


def test_edge_buckets_halve_the_first_gathers_and_the_last_reductions(fake_pg):
    """The first gathers and the last reductions of a graph have no compute to
    hide behind: they form an edge bucket of at most `edge_bytes` (half the
    cap in the pass), taking part of a block; the rest of that block is the
    next bucket, and whole blocks follow as before."""
    from zppc.passes.zero import BLOCK_UNIT, UNPADDED_BYTES

    def f(*tensors):
        shards, grads = tensors[:6], tensors[6:]
        gathered = sum(unshard(s, [4 * s.numel()]).sum() for s in shards)
        reduced = [
            torch.ops.zppc.reduce_grad(g, g.numel() // 4, "0", "zero3", None, g.dtype)
            for g in grads
        ]
        return gathered, reduced

    numels = (1, 1, 2, 2, 3, 3)
    gm = make_fx(f, tracing_mode="fake")(
        *(torch.randn(n) for n in numels), *(torch.randn(4 * n) for n in reversed(numels))
    )
    for node in gm.graph.nodes:
        node.meta.setdefault("val", None)
    from zppc.passes.zero import zero_pass

    gm = zero_pass(gm, PassContext(zppc.Config(), "backward"))
    matches = find_collectives(gm.graph)
    gathers = [m for m in matches if m.kind == "all_gather"]
    reductions = [m for m in matches if m.kind != "all_gather"]
    # Gathers: an embedding-like weight, block a (three), block b (two); the
    # reductions mirror them, last block first.
    for ms in (gathers, reductions[::-1]):
        for m, unit in zip(ms, [None, "a", "a", "a", "b", "b"], strict=True):
            m.wait.meta[BLOCK_UNIT] = unit
            m.wait.meta[UNPADDED_BYTES] = full_bytes(m) - 4
    assert [full_bytes(m) for m in gathers] == [16, 16, 32, 32, 48, 48]
    assert [full_bytes(m) for m in reductions] == [48, 48, 32, 32, 16, 16]

    def sizes(plan, kind):
        return [[full_bytes(m) for m in b] for b in plan if (b[0].kind == "all_gather") == kind]

    # Without edges, by block at 96: the first weight and block a (68 unpadded)
    # share a bucket, as do the reductions of block a and the last weight.
    plan = plan_buckets(matches, 96, by_block=True)
    assert sizes(plan, True) == [[16, 16, 32, 32], [48, 48]]
    assert sizes(plan, False) == [[48, 48], [32, 32, 16, 16]]
    # Edges of 48: the first weight and block a's first; a's rest; block b.
    plan = plan_buckets(matches, 96, by_block=True, edge_bytes=48)
    assert sizes(plan, True) == [[16, 16], [32, 32], [48, 48]]
    assert sizes(plan, False) == [[48, 48], [32, 32], [16, 16]]
    # Buckets come in graph order, and an edge whose first member alone is
    # larger than edge_bytes is no edge: the plan is the one without edges.
    order = {m.wait: i for i, m in enumerate(matches)}
    assert [order[b[0].wait] for b in plan] == sorted(order[b[0].wait] for b in plan)
    assert sizes(plan_buckets(matches, 96, True, edge_bytes=15), True) == [
        [16, 16, 32, 32],
        [48, 48],
    ]


def test_pass_list_and_disable():
    with_qwz = [
        "dedupe_unshard",
        "zero",
        "qwz",
        "bucket",
        "reduce_scatter",
        "sync_buffers",
        "reduction_groups",
        "gather_hops",
        "lanes",
        "overlap",
    ]
    assert [p.name for p in build_passes(zppc.Config(qwz="int8"))] == with_qwz
    config = zppc.Config(qwz="int8", qgz="int4", buffer_sync=None, reduce_scatter="native")
    names = [p.name for p in build_passes(config)]
    assert names == [
        "dedupe_unshard",
        "zero",
        "qwz",
        "bucket",
        "qgz",
        "reduction_groups",
        "gather_hops",
        "lanes",
        "overlap",
    ]
    # Every pass a default config runs after `zero`, disabled.
    config = zppc.Config(disable_passes=tuple(with_qwz[with_qwz.index("qwz") + 1 :]))
    assert [p.name for p in build_passes(config)] == ["dedupe_unshard", "zero"]


def test_run_passes_records_every_pass(fake_pg):
    graphs = partitioned("zero3", fake_pg)
    ctx = PassContext(zppc.Config(lowering="eager"), "backward")
    run_passes(graphs["backward"], ctx)
    assert [r.name for r in ctx.records] == [
        "input",
        "zero",
        "bucket",
        "reduce_scatter",
        "reduction_groups",
        "gather_hops",
        "lanes",
        "overlap",
    ]
    assert ctx.records[1].removed == {"unshard.default": 1, "reduce_grad.default": 1}
    assert op_census(graphs["backward"].graph)["record_comm.default"] == 2


def test_dynamo_graph_keeps_in_place_updates_nobody_reads():
    """Root cause of lost buffer mutations: the dynamo graph is not functional,
    and FX's dead-code elimination calls `num_batches_tracked.add_(1)` (a method
    call whose result nobody reads) dead. The dynamo passes must keep it."""
    captured = {}

    def capture(gm, example_inputs):
        captured["gm"] = gm
        return gm.forward

    bn = torch.nn.BatchNorm1d(3)
    torch._dynamo.reset()
    torch.compile(bn, backend=capture)(torch.randn(4, 3))
    gm = captured["gm"]

    def in_place_updates(graph):
        return [n for n in graph.nodes if n.op == "call_method" and n.target == "add_"]

    assert in_place_updates(gm.graph), gm.code
    gm = run_passes(gm, PassContext(zppc.Config(), "dynamo"))
    assert in_place_updates(gm.graph), gm.code


def _quantize_like(x):
    """Fresh values, views of inputs and of intermediates, a dtype view."""
    rows = x.view(2, -1)
    scale = rows.abs().amax(dim=1, keepdim=True)
    q = (rows / scale).to(torch.int8)
    return torch.cat([scale.view(torch.uint8).view(2, -1), q.view(torch.uint8)[:, 1:]], dim=1)


def test_inline_from_a_cached_trace_gives_the_values_running_the_ops_would():
    """`GraphBuilder.inline` fills a reused trace's copies from the trace's
    values (fresh storage, or the base's storage for a view) instead of
    running every op again: the metadata and the aliasing must be exactly
    those of running the ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._pytree import tree_map_only
    from zppc.passes import graph_utils
    from zppc.passes.graph_utils import GraphBuilder, node_value

    with FakeTensorMode() as mode:
        # The same shape and strides: one a fresh tensor, one a view at an offset.
        fresh, offset_view = torch.empty(24), torch.empty(48)[24:]
    gm = make_fx(lambda a, b: (a, b))(fresh, offset_view)
    inputs = list(gm.graph.find_nodes(op="placeholder"))
    for node, fake in zip(inputs, (fresh, offset_view), strict=True):
        node.meta["val"] = fake
    builder = GraphBuilder(gm, next(iter(gm.graph.find_nodes(op="output"))))
    builder.inline(_quantize_like, inputs[0])
    traces = len(graph_utils._TRACES)
    builder.inline(_quantize_like, inputs[1])
    assert len(graph_utils._TRACES) == traces  # the second copy came from the cache

    def storage(node):
        return StorageWeakRef(node_value(node).untyped_storage())

    copies = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert len(copies) > 10
    for node in copies:
        val = node_value(node)
        with mode:
            expected = node.target(*tree_map_only(torch.fx.Node, node_value, node.args))
        assert (val.shape, val.stride(), val.dtype, val.storage_offset()) == (
            expected.shape,
            expected.stride(),
            expected.dtype,
            expected.storage_offset(),
        ), node.format_node()
        is_view = node.target._schema.returns[0].alias_info is not None
        aliases = [i for i in node.all_input_nodes if storage(i) == storage(node)]
        assert bool(aliases) == is_view, node.format_node()
    # The second copy's first view is of the offset view's storage, at its offset.
    second_rows = [n for n in copies if inputs[1] in n.all_input_nodes][0]
    assert storage(second_rows) == storage(inputs[1])
    assert node_value(second_rows).storage_offset() == 24


def test_a_plan_lowers_quantization_as_a_gpu_compile_does():
    """Inside `planning()` tensors on meta get the Triton custom ops (the GPU
    build a plan describes); a CPU compile keeps the inlined torch reference.
    That both give the same bytes is `test_planned_bytes_equal_a_live_ledger`."""
    from zppc.passes import planning
    from zppc.passes.graph_utils import lowers_to_triton_kernels

    meta, cpu = torch.empty(3, device="meta"), torch.empty(3)
    assert not lowers_to_triton_kernels(meta) and not lowers_to_triton_kernels(cpu)
    with planning():
        assert lowers_to_triton_kernels(meta) and not lowers_to_triton_kernels(cpu)
    # A CPU cluster's plan (benchmarks/predict.py) asks for the CPU's graph.
    with planning(kernels="torch"):
        assert not lowers_to_triton_kernels(meta)
    with pytest.raises(ValueError, match="must be one of"):
        with planning(kernels="cuda"):
            pass
