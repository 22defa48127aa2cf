"""The `overlap` pass's schedule, asserted on the final graphs (fake process
group, one process): what is issued before what, where each wait sits, how
many gathered buckets are alive, and that Inductor's code keeps that order."""

import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch import fx
from torch.testing._internal.distributed.fake_pg import FakeStore
from zppc.passes.overlap import pin_gather_issues
from zppc.passes.zero import KEPT_GATHERED, PARAM_GATHER, find_collectives

import zppc
from zppc.config import block_bucket_bytes
from zppc.cost import Compute, CostModel, Links
from zppc.models import GPT, PRESETS

WORLD, NODE = 4, 2
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
WAIT = torch.ops._c10d_functional.wait_tensor.default


def one_step(preset: str, **config):
    """`zppc.inspect` of one compiled step of a GPT preset, on 2 x 2, eager lowering."""
    torch.manual_seed(0)
    config = zppc.Config(**{"node_size": NODE, "lowering": "eager", **config})
    model = zppc.distribute(GPT(PRESETS[preset]), config)
    step = torch.compile(model, backend="zppc")
    tokens = torch.randint(0, PRESETS[preset].vocab_size, (2, 17))
    step(tokens[:, :-1], tokens[:, 1:]).backward()
    return zppc.inspect(step)


def final_graphs(**overrides):
    """Forward and backward graphs of one gpt-small step, zero3 on 2 x 2,
    buckets of about one transformer block."""
    (compile_record,) = one_step("gpt-small", bucket_bytes=3 * 2**20, **overrides).compiles
    return compile_record.final["forward"], compile_record.final["backward"]


def positions(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def last_read(weights, pos):
    """The last read of the gathered `weights` or of a tensor made from them alone."""
    derived, stack, last = set(weights), list(weights), max(pos[w] for w in weights)
    while stack:
        for user in stack.pop().users:
            if user.op == "output" or user in derived:
                continue
            last = max(last, pos[user])
            if set(user.all_input_nodes) <= derived:
                derived.add(user)
                stack.append(user)
    return last


def gathered_lifetime(m, pos):
    """[issue, last read of the gathered weights or of a tensor made from them alone]."""
    return pos[m.issue], last_read([m.wait], pos)


def kept_lifetime(gm, pos):
    """[0, last read] of the weights the forward kept gathered for this
    backward (its inputs tagged so), or None."""
    kept = [n for n in gm.graph.find_nodes(op="placeholder") if n.meta.get(KEPT_GATHERED)]
    return (0, last_read(kept, pos)) if kept else None


def first_use(m, pos):
    return min(pos[u] for u in m.wait.users)


def matmul_positions(gm, pos):
    return sorted(pos[n] for n in gm.graph.nodes if n.target in MATMULS)


def most_alive(intervals, sizes=None) -> int:
    """The most of the (start, end) `intervals` open at once; with `sizes`,
    the largest sum of the sizes of those open at once."""
    sizes = sizes or [1] * len(intervals)
    events = sorted(
        [(a, size) for (a, _), size in zip(intervals, sizes, strict=True)]
        + [(b, -size) for (_, b), size in zip(intervals, sizes, strict=True)]
    )
    alive = peak = 0
    for _, step in events:
        alive += step
        peak = max(peak, alive)
    return peak


@pytest.mark.parametrize("fake_rank", [1], indirect=True)
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_gathers_prefetched_within_the_memory_bound(fake_rank, prefetch):
    for gm in final_graphs(prefetch=prefetch):
        pos = positions(gm)
        gathers = [m for m in find_collectives(gm.graph) if m.wait.meta.get(PARAM_GATHER)]
        assert len(gathers) >= 4, gm.code
        gathers.sort(key=lambda m: pos[m.issue])
        lifetimes = [gathered_lifetime(m, pos) for m in gathers]
        # A tied embedding's weights live across the forward: resident, not counted.
        streamed = [
            k
            for k in range(len(gathers))
            if k + 1 == len(gathers) or lifetimes[k][1] <= lifetimes[k + 1][1]
        ]
        assert len(gathers) - len(streamed) <= 1
        gathers = [gathers[k] for k in streamed]
        lifetimes = [lifetimes[k] for k in streamed]
        # The weights the forward kept gathered are the backward's first bucket.
        if kept := kept_lifetime(gm, pos):
            gathers, lifetimes = [None, *gathers], [kept, *lifetimes]
        assert most_alive(lifetimes) <= prefetch + 1
        # Gather k is issued before the compute on gather k - prefetch starts.
        for k in range(prefetch, len(gathers)):
            if prefetch and gathers[k - prefetch] is not None:
                assert pos[gathers[k].issue] < first_use(gathers[k - prefetch], pos)
        # ... and, to stay within the bound, after gather k - prefetch - 1 is dead.
        for k in range(prefetch + 1, len(gathers)):
            assert pos[gathers[k].issue] > lifetimes[k - prefetch - 1][1]
    if prefetch:
        assert most_alive(lifetimes) == prefetch + 1  # the bound is used


@pytest.mark.parametrize("fake_rank", [1], indirect=True)
def test_forward_gathers_issued_in_the_order_they_are_used(fake_rank):
    """Collectives on one group run in the order they are issued (NCCL's
    stream; on gloo the runtime chains a group's gathers,
    `zppc.runtime.collectives._chain_hops`), so a gather issued ahead of one
    used before it delays that one: the tied embedding's, issued after the
    first prefetches, held the first layer behind all of them. Gathers over a
    plain gloo group (the world group here, gather_hops off; on one rank per
    node it is the layout) are placed as on NCCL: `prefetch` ahead, each
    before the previous one's wait, compute under each. (Before they were
    chained, the plan waited each gather before issuing the next.)"""
    from zppc.passes import planning

    def forward_gathers(backend):
        with planning("torch", backend):
            forward, _ = final_graphs(disable_passes=("gather_hops", "lanes"))
        pos = positions(forward)
        gathers = [m for m in find_collectives(forward.graph) if m.wait.meta.get(PARAM_GATHER)]
        return forward, pos, sorted(gathers, key=lambda m: pos[m.issue])

    forward, pos, gathers = forward_gathers("gloo")
    assert len(gathers) >= 4
    uses = [first_use(m, pos) for m in gathers]
    assert uses == sorted(uses)
    matmuls = matmul_positions(forward, pos)
    for before, m in zip(gathers[:-1], gathers[1:], strict=True):
        assert pos[m.issue] < pos[before.wait]
        assert any(pos[m.issue] < p < pos[m.wait] for p in matmuls), "nothing runs under it"
    _, nccl_pos, nccl_gathers = forward_gathers("nccl")
    assert [(pos[m.issue], pos[m.wait]) for m in gathers] == [
        (nccl_pos[m.issue], nccl_pos[m.wait]) for m in nccl_gathers
    ]


@pytest.mark.parametrize("fake_rank", [1], indirect=True)
def test_two_hop_gathers_keep_the_prefetch_depth_on_gloo(fake_rank):
    """On 2 x 2 gloo gathers run in two hops, whose runtime keeps each hop
    group to one hop at a time (`zppc.runtime.collectives._chain_hops`):
    the plan issues them as NCCL's does, `prefetch` ahead, each before the
    previous one's wait (as gathers over a plain gloo group, chained in one
    hop, are)."""
    from zppc.passes import planning
    from zppc.runtime.topology import two_hop_gather_over

    def gathers_of(backend):
        with planning("torch", backend):
            forward, _ = final_graphs()
        pos = positions(forward)
        gathers = [m for m in find_collectives(forward.graph) if m.wait.meta.get(PARAM_GATHER)]
        return sorted((pos[m.issue], pos[m.wait], m.group_name) for m in gathers)

    on_gloo, on_nccl = gathers_of("gloo"), gathers_of("nccl")
    assert [g[:2] for g in on_gloo] == [g[:2] for g in on_nccl]
    (hop_world,) = {g[2] for g in on_gloo}
    assert two_hop_gather_over(hop_world) is not None
    issued_before_the_previous_wait = [
        later
        for earlier, later in zip(on_gloo[:-1], on_gloo[1:], strict=True)
        if later[0] < earlier[1]
    ]
    assert len(issued_before_the_previous_wait) == len(on_gloo) - 1


@pytest.mark.parametrize("fake_rank", [1], indirect=True)
@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_plain_gloo_groups_keep_the_prefetch_depth(fake_rank, prefetch):
    """On a plain gloo group (the world group here: gather_hops off; on one
    rank per node or one node it is the layout) gathers stay on their group,
    chained by the runtime in the order they are issued, each issued before
    the previous one is waited. The `lanes` pass spreads the other
    collectives (the reductions, on the group's twin) over `prefetch + 1`
    groups over the same ranks in turn: each lane carries one collective at a
    time, `prefetch + 1` reductions in flight, where one lane waited each
    before the next. Lanes stop at `MAX_LANES` (4): prefetch 4 keeps 4
    reductions in flight, not 5."""
    from zppc.passes import planning
    from zppc.runtime.topology import MAX_LANES, group_lanes, reduction_twin

    lanes = min(prefetch + 1, MAX_LANES)

    def plan(backend, disable=("gather_hops",)):
        with planning("torch", backend):
            graphs = final_graphs(
                disable_passes=disable, prefetch=prefetch, reduce_scatter="all_to_all"
            )
        return [
            [(positions(gm)[m.issue], positions(gm)[m.wait], m) for m in find_collectives(gm.graph)]
            for gm in graphs
        ]

    on_lanes, one_lane = plan("gloo"), plan("gloo", disable=("gather_hops", "lanes"))
    for graph, one_lane_graph in zip(on_lanes, one_lane, strict=True):
        gathers = sorted(c for c in graph if c[2].wait.meta.get(PARAM_GATHER))
        reductions = sorted(c for c in graph if not c[2].wait.meta.get(PARAM_GATHER))
        world = gathers[0][2].group_name
        assert {c[2].group_name for c in gathers} == {world} and group_lanes(world)[0] == world
        # Each gather goes out before the previous one is waited, lanes or not.
        assert all(
            later[0] < earlier[1] for earlier, later in zip(gathers[:-1], gathers[1:], strict=True)
        )
        # `prefetch` ahead, and the tied embedding's gather (waited at the head) beside them.
        assert 1 < most_alive([c[:2] for c in gathers]) <= prefetch + 2
        one_lane_gathers = sorted(c for c in one_lane_graph if c[2].wait.meta.get(PARAM_GATHER))
        assert {c[2].group_name for c in one_lane_gathers} == {world}
        assert all(
            later[0] < earlier[1]
            for earlier, later in zip(one_lane_gathers[:-1], one_lane_gathers[1:], strict=True)
        )
        if reductions:
            twin_lanes = group_lanes(reduction_twin(world))[:lanes]
            assert {c[2].group_name for c in reductions} == set(twin_lanes)
            assert most_alive([c[:2] for c in reductions]) == lanes
            for lane in twin_lanes:
                assert most_alive([c[:2] for c in reductions if c[2].group_name == lane]) == 1
            # On one lane, one reduction at a time.
            one_lane_reductions = [
                c for c in one_lane_graph if not c[2].wait.meta.get(PARAM_GATHER)
            ]
            assert most_alive([c[:2] for c in one_lane_reductions]) == 1


@pytest.mark.parametrize("fake_rank", [1], indirect=True)
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_original_gloo_groups_carry_parameter_gathers_alone(fake_rank, backend):
    """On gloo the forward's buffer broadcasts take the world group's twin, as
    the backward's reductions do, so the original groups carry parameter
    gathers alone (chained by the runtime) and need no lanes: `distribute`
    gives lanes to the twins only. NCCL keeps the broadcast on the world
    group."""
    from models import BatchNormNet
    from zppc.passes import planning
    from zppc.runtime.topology import group_lanes, lane_count, reduction_twin

    torch.manual_seed(0)
    prefetch = 2
    with planning("torch", backend):
        config = zppc.Config(node_size=NODE, lowering="eager", prefetch=prefetch)
        model = zppc.distribute(BatchNormNet(), config)
        step = torch.compile(model, backend="zppc")
        x, y = BatchNormNet.batch(0)
        step(x.chunk(WORLD)[fake_rank], y.chunk(WORLD)[fake_rank]).backward()
        (record,) = zppc.inspect(step).compiles
    groups = model._zppc_state.groups
    forward = record.final["forward"]
    matches = find_collectives(forward.graph)
    broadcasts = [m for m in matches if m.kind == "broadcast"]
    gathers = [m for m in matches if m.wait.meta.get(PARAM_GATHER)]
    # One broadcast per dtype: the float statistics and the int64 counters.
    assert len(broadcasts) == 2 and gathers
    assert len(broadcasts) + len(gathers) == len(matches)
    twin = reduction_twin(groups.world)
    expected = groups.world if backend == "nccl" else twin
    assert {m.group_name for m in broadcasts} <= set(group_lanes(expected))
    if backend == "gloo":
        # In turn on the twin's lanes, one each.
        assert {m.group_name for m in broadcasts} == set(group_lanes(twin)[: len(broadcasts)])
    for original in (groups.world, groups.intra_node, groups.cross_node):
        assert group_lanes(original) == (original,)
        assert len(group_lanes(reduction_twin(original))) == lane_count(prefetch)


@pytest.mark.parametrize("fake_rank", [1], indirect=True)
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_gloo_reductions_run_on_a_group_of_their_own(fake_rank, backend):
    """On gloo a group runs one collective in flight, so the backward's next
    gather waited for the reduction before it: reductions take the group's
    twin there, and a gather goes out while a reduction is still in flight
    (the gathers, chained by the runtime, keep their own depth).
    NCCL keeps one group. (Gathers stay on the world group here: the
    gather_hops pass, off, would move them to a group of their own; the
    reductions run as all-to-alls: in two hops they take hop groups of their
    own, `test_reduce_scatter.py`.)"""
    from zppc.passes import planning
    from zppc.runtime.topology import reduction_twin

    with planning("torch", backend):
        _, backward = final_graphs(
            disable_passes=("gather_hops", "lanes"),
            reduce_scatter="all_to_all" if backend == "gloo" else "auto",
        )
    pos = positions(backward)
    matches = find_collectives(backward.graph)
    gathers = [m for m in matches if m.wait.meta.get(PARAM_GATHER)]
    reductions = [m for m in matches if not m.wait.meta.get(PARAM_GATHER)]
    assert len(gathers) >= 3 and len(reductions) >= 3
    (gather_group,) = {m.group_name for m in gathers}
    reduction_groups = {m.group_name for m in reductions}
    under_a_reduction = [
        g for g in gathers for r in reductions if pos[r.issue] < pos[g.issue] < pos[r.wait]
    ]
    if backend == "nccl":
        assert reduction_groups == {gather_group}
        return
    assert reduction_groups == {reduction_twin(gather_group)} != {gather_group}
    assert under_a_reduction, backward.code
    # Still one reduction in flight on its group; the gathers, chained by the
    # runtime on theirs, `prefetch` ahead.
    assert most_alive(sorted((pos[m.issue], pos[m.wait]) for m in reductions)) == 1
    assert most_alive(sorted((pos[m.issue], pos[m.wait]) for m in gathers)) == 2


@pytest.mark.parametrize("fake_rank", [1], indirect=True)
def test_waits_at_first_use_and_reductions_issued_at_once(fake_rank):
    forward, backward = final_graphs(prefetch=1)
    for gm in (forward, backward):
        pos = positions(gm)
        nodes = list(gm.graph.nodes)
        for m in find_collectives(gm.graph):
            between = nodes[pos[m.wait] + 1 : first_use(m, pos)]
            assert all(n.target == WAIT for n in between), (m.wait, between)
    pos = positions(backward)
    matmuls = matmul_positions(backward, pos)
    reductions = [m for m in find_collectives(backward.graph) if m.kind == "reduce_scatter"]
    assert len(reductions) >= 4
    for m in reductions:
        # Issued before the next matrix product after its last gradient...
        ancestors, stack = set(), [m.issue]
        while stack:
            for inp in stack.pop().all_input_nodes:
                if inp not in ancestors:
                    ancestors.add(inp)
                    stack.append(inp)
        ready = max(pos[n] for n in ancestors if n.target in MATMULS)
        assert not [p for p in matmuls if ready < p < pos[m.issue]]
    # In flight across later compute, with at most prefetch + 1 in flight at once.
    spans = sorted((pos[m.issue], pos[m.wait]) for m in reductions)
    assert most_alive(spans) == 2
    assert all([p for p in matmuls if a < p < b] for a, b in spans[:-2])
    assert spans[-1][1] > matmuls[-1]


def schedule_code_on_rank(rank: int, **overrides) -> str:
    """The final graphs' code as `rank` builds them. Group names are
    process-local counters (and each rank's node group has other members), so
    groups are named by order of first use instead."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    torch._dynamo.reset()
    try:
        forward, backward = final_graphs(**{"prefetch": 1, "qwz": "int8", "hpz": True, **overrides})
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()
    return normalized_code(forward, backward)


def normalized_code(*graphs) -> str:
    names: dict[str, str] = {}
    return re.sub(
        r"'(\d+)'",
        lambda g: names.setdefault(g.group(1), f"'group{len(names)}'"),
        "".join(gm.code for gm in graphs),
    )


# A CPU's rates: 10 GFLOP/s, 10 GB/s of memory, and links fast or slow
# against them (bytes/s).
CPU = Compute(10e9, 10e9)
FAST_LINKS = CostModel(Links(100e9, 100e9), CPU)
SLOW_LINKS = CostModel(Links(1e6, 1e6), CPU)


@pytest.mark.parametrize("cost_model", [None, FAST_LINKS], ids=["earliest", "cost model"])
def test_every_rank_builds_the_same_schedule(cost_model):
    # Rank 3 is on the other node from rank 0 and last in its own: every
    # rank-dependent branch a pass could take differs between the two.
    assert schedule_code_on_rank(0, cost_model=cost_model) == schedule_code_on_rank(
        3, cost_model=cost_model
    )


def streamed_gathers(gm):
    """Parameter gathers in issue order with their gathered lifetimes, the
    resident (tied embedding) one left out."""
    pos = positions(gm)
    gathers = [m for m in find_collectives(gm.graph) if m.wait.meta.get(PARAM_GATHER)]
    gathers.sort(key=lambda m: pos[m.issue])
    lifetimes = [gathered_lifetime(m, pos) for m in gathers]
    return [
        (m, life)
        for k, (m, life) in enumerate(zip(gathers, lifetimes, strict=True))
        if k + 1 == len(gathers) or life[1] < lifetimes[k + 1][1]
    ]


@pytest.mark.parametrize("fake_rank", [1], indirect=True)
def test_cost_model_issues_each_gather_as_late_as_still_hides_it(fake_rank):
    """With links fast against compute, a gather is issued after the compute
    that hides it, not `prefetch` buckets ahead: the gathered buckets live
    shorter, the bound still holds, and the estimated step is no slower.
    With links slower than any compute, nothing hides a gather: the schedule
    is the one without a cost model."""
    from zppc.cost import simulate
    from zppc.schedule import graph_schedule

    prefetch = 2
    graphs = {}
    for name, cost in (("earliest", None), ("cost", FAST_LINKS), ("slow", SLOW_LINKS)):
        torch._dynamo.reset()
        graphs[name] = final_graphs(prefetch=prefetch, cost_model=cost)
    for earliest, late in zip(graphs["earliest"], graphs["cost"], strict=True):
        before, after = streamed_gathers(earliest), streamed_gathers(late)
        assert len(before) == len(after) >= 4
        pos = positions(late)
        assert most_alive([life for _, life in after]) <= prefetch + 1
        for m, (issue, _) in after:
            assert issue < first_use(m, pos)
            matmuls = [p for p in matmul_positions(late, pos) if issue < p < first_use(m, pos)]
            assert len(matmuls) <= 1, "issued earlier than the compute that hides it"
        assert sum(b - a for _, (a, b) in after) < sum(b - a for _, (a, b) in before)
    # Estimated step at the same rates: no slower for issuing later.
    steps = {
        name: simulate(
            [
                (kind, gm, graph_schedule(gm, kind, 1))
                for kind, gm in zip(("forward", "backward"), pair, strict=True)
            ],
            FAST_LINKS.links,
            FAST_LINKS.compute,
        ).step_seconds
        for name, pair in graphs.items()
        if name != "slow"
    }
    # Within 0.1%: the earliest schedule issues the tied embedding's gather
    # first, which the simulated FIFO link rewards by 0.03% at these rates.
    assert steps["cost"] <= steps["earliest"] * 1.001, steps
    assert normalized_code(*graphs["slow"]) == normalized_code(*graphs["earliest"])


@pytest.mark.parametrize("fake_rank", [1], indirect=True)
def test_inspect_estimates_with_the_cost_model_the_pass_planned_with(fake_rank):
    from zppc.cost import simulate
    from zppc.schedule import graph_schedule

    inspection = one_step("gpt-tiny", cost_model=FAST_LINKS)
    (record,) = inspection.compiles
    graphs = [(k, record.final[k], graph_schedule(record.final[k], k, 1)) for k in record.final]
    planned = simulate(graphs, FAST_LINKS.links, FAST_LINKS.compute)
    assert inspection.estimate().step_seconds == planned.step_seconds
    assert inspection.estimate(flops_per_second=1e9).step_seconds != planned.step_seconds


def test_cost_model_is_checked():
    with pytest.raises(ValueError, match="cost_model must be a zppc.cost.CostModel"):
        zppc.Config(cost_model=Links(1e9, 1e9))
    with pytest.raises(ValueError, match="takes a zppc.cost.Links and a zppc.cost.Compute"):
        CostModel(Links(1e9, 1e9), 1e12)


@pytest.mark.slow
@pytest.mark.parametrize("fake_rank", [1], indirect=True)
def test_inductor_keeps_the_overlap_order(fake_rank):
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    config = zppc.Config(node_size=NODE, bucket_bytes=30_000)
    model = zppc.distribute(GPT(PRESETS["gpt-tiny"]), config)
    step = torch.compile(model, backend="zppc")
    tokens = torch.randint(0, 256, (2, 17))
    _, (forward, backward) = run_and_get_code(
        lambda: step(tokens[:, :-1], tokens[:, 1:]).backward()
    )

    def events(code):
        """(op, buffer) in the order the generated `call` runs them; a buffer
        renamed (`buf3 = buf2`, how Inductor takes over a custom op's
        output) keeps its first name."""
        pattern = r"(\w+) = torch\.ops\.(?:_c10d_functional|zppc)\.(\w+)\.default|wait_tensor\.default\((\w+)\)|extern_kernels\.(mm|addmm)\("
        found, first_name = [], {}
        for line in code[code.index("def call(") :].splitlines():
            if renamed := re.fullmatch(r"\s*(buf\d+) = (buf\d+)", line):
                first_name[renamed[1]] = first_name.get(renamed[2], renamed[2])
            for issued, kind, waited, _matmul in re.findall(pattern, line):
                if issued:
                    found.append((kind, issued))
                elif waited:
                    found.append(("wait", first_name.get(waited, waited)))
                else:
                    found.append(("mm", None))
        return found

    def compute_between_issue_and_wait(found, kind):
        issued = {buf: i for i, (k, buf) in enumerate(found) if k == kind}
        waited = {buf: i for i, (k, buf) in enumerate(found) if k == "wait"}
        return [any(k == "mm" for k, _ in found[issued[b] + 1 : waited[b]]) for b in issued]

    fw, bw = events(forward), events(backward)
    # Forward: gathers prefetched across compute (not issue-then-wait).
    assert sum(compute_between_issue_and_wait(fw, "all_gather_in_place")) >= 3, fw
    # Inductor frees each gathered bucket before the gather that replaces it
    # (prefetch 1: two alive at most; the forward also keeps the tied
    # embedding's bucket across its whole length).
    assert gathered_buffers_alive(forward) <= 3
    assert gathered_buffers_alive(backward) <= 2
    # Backward: reductions in flight across later compute, two at most.
    scatters = compute_between_issue_and_wait(bw, "reduce_scatter_tensor")
    assert len(scatters) >= 4 and sum(scatters) >= len(scatters) - 2, bw
    issued = {b: i for i, (k, b) in enumerate(bw) if k == "reduce_scatter_tensor"}
    waited = {b: i for i, (k, b) in enumerate(bw) if k == "wait" and b in issued}
    assert most_alive([(issued[b], waited[b]) for b in issued]) <= 2


def gathered_buffers_alive(code: str) -> int:
    """The most gathered buckets Inductor's generated `call` holds at once:
    from each all-gather's output to the `del` of the last name holding its
    memory (`bufB = bufA; del bufA` hands it over)."""
    body = code[code.index("def call(") :]
    bucket_of: dict[str, str] = {}  # a name holding gathered memory -> its gather's name
    peak = 0
    for line in body.splitlines():
        if issued := re.match(r"\s*(buf\d+) = torch\.ops\.zppc\.all_gather_in_place", line):
            bucket_of[issued[1]] = issued[1]
        elif taken := re.match(r"\s*(buf\d+) = (?:reinterpret_tensor\()?(buf\d+)\b", line):
            if taken[2] in bucket_of:
                bucket_of[taken[1]] = bucket_of[taken[2]]
        for name in re.findall(r"\bdel (buf\d+)", line):
            bucket_of.pop(name, None)
        peak = max(peak, len(set(bucket_of.values())))
    return peak


def backward_gathers(record):
    backward = record.final["backward"]
    return [m for m in find_collectives(backward.graph) if m.kind == "all_gather"]


def gathered_elements(gathers):
    return sum(m.wait.meta["val"].numel() for m in gathers)


def assert_kept_is_not_regathered(record, regathered: int):
    """What is kept is exactly what the backward no longer gathers (padding aside)."""
    kept = record.kept_gathered
    fewer = gathered_elements(backward_gathers(record))
    kept_elements = sum(size for _, size in kept) // 4
    assert regathered - fewer >= kept_elements
    assert regathered - fewer < kept_elements + WORLD * len(kept)


@pytest.mark.parametrize("fake_rank", [1], indirect=True)
def test_keep_gathered_saves_the_last_read_weights_instead_of_regathering(fake_rank):
    torch._dynamo.reset()
    (everything,) = one_step("gpt-small", keep_last_block=False).compiles
    assert not everything.kept_gathered
    forward = everything.final["forward"]
    saved = [n.meta["val"] for n in forward.graph.find_nodes(op="output")[0].args[0][1:]]
    assert not [v for v in saved if v.dim() == 2 and v.shape[1] == 256 and v.shape[0] >= 256]
    regathered = gathered_elements(backward_gathers(everything))

    budget = 2 * 2**20
    torch._dynamo.reset()
    inspection = one_step("gpt-small", keep_gathered_bytes=budget, keep_last_block=False)
    (record,) = inspection.compiles
    kept = record.kept_gathered
    assert kept and sum(size for _, size in kept) <= budget
    # Last read first: the tied embedding (the output head reads it last,
    # though the forward gathers it first), the final LayerNorm's weight and
    # bias, the last block's MLP projection (its bias: the backward does not
    # read it); its first MLP layer would pass the budget.
    vocab = PRESETS["gpt-small"].vocab_size
    assert [shape for shape, _ in kept] == [(vocab, 256), (256,), (256,), (256, 1024)]
    assert "kept gathered from forward to backward: 4 weights" in str(inspection)
    assert_kept_is_not_regathered(record, regathered)


@pytest.mark.parametrize("fake_rank", [1], indirect=True)
def test_zero3_keeps_the_last_block_gathered_into_the_backward(fake_rank):
    """By default (`keep_last_block`) the weights the forward reads last, one
    block's bytes, are not gathered again: the backward's first gather, with
    nothing computed before it, is gone, and with it its bytes."""
    torch._dynamo.reset()
    (regathering,) = one_step("gpt-small", keep_last_block=False, bucket_bytes=3 * 2**20).compiles
    torch._dynamo.reset()
    (record,) = one_step("gpt-small", bucket_bytes=3 * 2**20).compiles
    kept = record.kept_gathered
    assert sum(size for _, size in kept) <= 3 * 2**20
    assert kept[0][0] == (PRESETS["gpt-small"].vocab_size, 256)  # the tied head's weight
    assert (256, 1024) in {shape for shape, _ in kept}  # and the last block's
    assert_kept_is_not_regathered(record, gathered_elements(backward_gathers(regathering)))
    assert len(backward_gathers(record)) == len(backward_gathers(regathering)) - 1
    # The backward starts on its first op, not on a gather's wait.
    first_wait = next(n for n in record.final["backward"].graph.nodes if "wait" in str(n.target))
    computed_before = [
        n
        for n in record.final["backward"].graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.mm.default
    ]
    order = positions(record.final["backward"])
    assert computed_before and order[computed_before[0]] < order[first_wait]


def gathered_bytes_alive(gm) -> int:
    """The most gathered bytes a graph holds at once: each kept weight from
    the start to its last read, each streamed gather's bucket from its issue
    to its weights' last read (a resident one, the tied embedding across the
    forward, left out as the bound leaves it out)."""
    pos = positions(gm)
    kept = [n for n in gm.graph.find_nodes(op="placeholder") if n.meta.get(KEPT_GATHERED)]
    gathers = sorted(
        (m for m in find_collectives(gm.graph) if m.wait.meta.get(PARAM_GATHER)),
        key=lambda m: pos[m.issue],
    )
    lifetimes = [gathered_lifetime(m, pos) for m in gathers]
    spans = [
        (*lifetimes[k], gathers[k].wait.meta["val"])
        for k in range(len(gathers))
        if k + 1 == len(gathers) or lifetimes[k][1] <= lifetimes[k + 1][1]
    ]
    spans += [(0, last_read([w], pos), w.meta["val"]) for w in kept]
    return most_alive(
        [(a, b) for a, b, _ in spans], [v.numel() * v.element_size() for *_, v in spans]
    )


@pytest.mark.parametrize("fake_rank", [1], indirect=True)
def test_half_block_buckets_keep_the_whole_last_block_within_the_memory_bound(fake_rank):
    """At prefetch 1 the backward's start holds two buckets re-gathering; so
    half-block buckets keep what block-sized ones keep (no bytes re-gathered
    for the smaller cap), and the kept weights count as the buckets they
    replace: gathered bytes alive stay within (prefetch + 1) x the cap."""
    with torch.device("meta"):
        half = block_bucket_bytes(GPT(PRESETS["gpt-small"])) // 2
    torch._dynamo.reset()
    (block_sized,) = one_step("gpt-small").compiles
    torch._dynamo.reset()
    (halves,) = one_step("gpt-small", bucket_bytes=half).compiles
    torch._dynamo.reset()
    (one_half_kept,) = one_step("gpt-small", bucket_bytes=half, prefetch=0).compiles
    assert halves.kept_gathered == block_sized.kept_gathered
    assert sum(size for _, size in halves.kept_gathered) > half  # more than one bucket kept
    assert gathered_elements(backward_gathers(halves)) == gathered_elements(
        backward_gathers(block_sized)
    )
    assert sum(size for _, size in one_half_kept.kept_gathered) <= half
    for record, prefetch in ((halves, 1), (one_half_kept, 0)):
        for gm in record.final.values():
            assert gathered_bytes_alive(gm) <= (prefetch + 1) * half
    # The bound is used: the kept weights and the first gather overlap.
    assert gathered_bytes_alive(halves.final["backward"]) > half


@pytest.mark.parametrize("fake_rank", [1], indirect=True)
def test_a_kept_set_of_many_buckets_streams_and_pins_under_inductor(fake_rank):
    """A `keep_gathered_bytes` budget of several buckets is that many kept
    buckets: the backward's first gather waits for the kept weights
    `prefetch + 1` buckets back to die, and `pin_gather_issues` (Inductor's
    form of the bound) pins it on their readers, skipping the kept ones."""
    cap = 2**19
    torch._dynamo.reset()
    (record,) = one_step("gpt-small", bucket_bytes=cap, keep_gathered_bytes=6 * cap).compiles
    backward = record.final["backward"]
    kept = [n for n in backward.graph.find_nodes(op="placeholder") if n.meta.get(KEPT_GATHERED)]
    assert sum(n.meta["val"].numel() * 4 for n in kept) > 2 * cap  # at least three buckets
    pos = positions(backward)
    first_gather = min(
        (m for m in find_collectives(backward.graph) if m.wait.meta.get(PARAM_GATHER)),
        key=lambda m: pos[m.issue],
    )
    # At prefetch 1 it is issued once at most one bucket of kept weights is
    # alive (a weight larger than the cap is a bucket alone).
    alive = [w for w in kept if last_read([w], pos) > pos[first_gather.issue]]
    assert len(alive) == 1 or 0 < sum(w.meta["val"].numel() * 4 for w in alive) <= cap
    pinned = fx.GraphModule(backward, copy.deepcopy(backward.graph))
    pin_gather_issues(pinned, prefetch=1, bucket_bytes=cap)
    deps = [n for n in pinned.graph.nodes if n.target is torch.ops.higher_order.control_deps]
    assert deps


def test_keep_gathered_is_checked():
    with pytest.raises(ValueError, match="keep_gathered_bytes applies to strategy='zero3'"):
        zppc.Config(strategy="zero2", keep_gathered_bytes=1)
    with pytest.raises(ValueError, match="keep_gathered_bytes must be an int >= 0"):
        zppc.Config(keep_gathered_bytes=-1)
    with pytest.raises(ValueError, match="keep_last_block must be True or False, got 1"):
        zppc.Config(keep_last_block=1)
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        zppc.Config(prefetch=-1)


@pytest.mark.parametrize("pattern, renumbers", [("cursor", False), ("halving", True)])
def test_positions_stay_ordered_after_many_moves_into_one_gap(pattern, renumbers, monkeypatch):
    """A cursor placing node after node steps up by a fixed amount and never
    runs out of room; moves that halve one gap each time (each node before the
    one moved last) exhaust it, and the order must renumber rather than tie."""
    from torch import fx
    from zppc.passes.overlap import _Order

    graph = fx.Graph()
    x = graph.placeholder("x")
    nodes = [graph.call_function(torch.neg, (x,)) for _ in range(300)]
    graph.output(nodes[-1])
    order = _Order(graph)
    numbered = []
    monkeypatch.setattr(_Order, "_number", lambda self, g: numbered.append(g) or _renumber(self, g))
    cursor = nodes[0]
    for node in reversed(nodes[1:]):
        if pattern == "cursor":  # each lands right after the previous one
            order.move_before(node, cursor.next)
        else:  # each lands right before the previous one
            order.move_before(node, cursor if cursor is not nodes[0] else nodes[0].next)
        cursor = node
    listed = list(graph.nodes)
    assert all(order[a] < order[b] for a, b in zip(listed, listed[1:], strict=False))
    assert bool(numbered) == renumbers


def _renumber(order, graph) -> None:
    order.pos = {n: i * order.SPACING for i, n in enumerate(graph.nodes)}


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_gloo_groups_have_one_collective_in_flight():
    """One collective in flight per gloo group in the final graphs, except
    where the runtime chains them, so that gloo still carries one at a time:
    over the hop worlds (2 x 2 gathers and reduces in two hops) the backward
    keeps `prefetch + 1` reductions in flight, and the forward gathers
    `prefetch` ahead as on NCCL (the tied embedding's gather, alive to the
    head, beside them); over a plain group (hpZ's backward gathers inside
    the node) the gathers keep that depth too, and any other collective on
    their group waits for them. As the step runs, each gloo group zppc's
    runtime issues on carries one collective at a time."""
    from spawn import run_ranks
    from workers import in_flight_per_group

    results = run_ranks(in_flight_per_group, 4, timeout=540)
    for most, unchained, hop_worlds, beside_a_reduction, on_gloo in results:
        two_hop = hop_worlds["gather"] | hop_worlds["reduce"]
        plain = {key: n for key, n in unchained.items() if key[1] not in two_hop}
        assert plain and max(plain.values()) == 1, unchained
        reductions_in_two_hops = [n for key, n in most.items() if key[1] in hop_worlds["reduce"]]
        assert reductions_in_two_hops == [2], most  # Config.prefetch 1
        # hpZ gathers the backward inside the node: only the forward's are two-hop.
        gathers_in_two_hops = {k: n for k, n in most.items() if k[1] in hop_worlds["gather"]}
        assert list(gathers_in_two_hops) == [("forward", *hop_worlds["gather"])], most
        assert list(gathers_in_two_hops.values()) == [3], most
        # hpZ's gathers inside the node, chained: `prefetch` ahead.
        backward_plain = [n for key, n in most.items() if key[0] == "backward" and key in plain]
        assert max(backward_plain) == 2, most
        # Reductions on their groups' twins: the backward's gathers go out beside them.
        assert beside_a_reduction >= 2
        assert on_gloo and set(on_gloo.values()) == {1}, on_gloo


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_two_hop_gathers_equal_gloo_all_gather():
    """The hop world's all-gather (across the nodes, then inside them) returns
    what gloo's ring returns, for odd sizes and every dtype, with several in
    flight, each hop group carrying one hop at a time; two shards enter each
    node per shard gathered, not three."""
    from spawn import run_ranks
    from workers import two_hop_gathers

    for differ, link_shards, most in run_ranks(two_hop_gathers, 4, timeout=540):
        assert differ == []
        assert link_shards == 2
        assert list(most.values()) == [1, 1], most


def test_a_two_hop_wait_with_a_timeout_raises_when_it_passes():
    """c10d's `Work.wait(timeout)` on a two-hop collective's work: raises
    `TimeoutError` while the hops are unfinished, returns once they are."""
    from datetime import timedelta

    from zppc.runtime.collectives import _ChainedWork

    done = torch.futures.Future()
    work = _ChainedWork(done)
    with pytest.raises(TimeoutError, match="did not finish within"):
        work.wait(timedelta(seconds=0.05))
    assert not work.is_completed()
    done.set_result(None)
    assert work.wait(timedelta(0))  # c10d's "no timeout", as wait_tensor passes
    assert work.wait(timedelta(seconds=0.05)) and work.wait() and work.is_completed()


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_failed_hop_raises_where_its_collective_is_waited():
    """A hop that fails (here as it is issued, from a completion callback)
    makes the wait on its collective raise that error, on every rank; the
    gather before it is unaffected. (c10d's work made from a future returned
    as if it had succeeded, and the rank went on with an unwritten output.)"""
    from spawn import run_ranks
    from workers import two_hop_failure_on_wait

    for first_right, raised in run_ranks(two_hop_failure_on_wait, 4, timeout=240):
        assert first_right
        assert raised is not None and "injected failure of the second hop" in raised, raised


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_eager_collective_waits_for_the_gathers_chained_on_its_group():
    """zppc's synchronous eager collectives (state dicts, clipping, an eager
    `unshard`) issued while gathers are still chained on the same plain gloo
    group go out only once those are done: one collective in flight on the
    group, every result right (beside them, the ranks' threads could match
    them in different orders)."""
    from spawn import run_ranks
    from workers import eager_collective_after_chained_gathers

    for right, most in run_ranks(eager_collective_after_chained_gathers, 2, timeout=240):
        assert right
        assert most == 1


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_eager_collective_inside_a_chained_hop_raises_instead_of_hanging():
    """An eager collective issued from a chain's hop (on a gloo thread, or on
    the issuing thread where the chain had nothing to wait for) would wait
    for the chain it runs in: the rank hung there. Now it raises, the chained
    collective's wait raises it on every rank, and nothing is left waiting."""
    from spawn import run_ranks
    from workers import eager_collective_inside_a_chain

    for raised in run_ranks(eager_collective_inside_a_chain, 2, timeout=120):
        assert raised is not None and "inside a chained collective's hop" in raised, raised
        assert "an eager all-gather over ranks [0, 1]" in raised, raised


@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "rounds, seeds",
    [(10, (0,)), pytest.param(60, (1, 2, 3, 4, 5), marks=pytest.mark.slow)],
)
def test_two_hop_chains_under_many_collectives_in_flight(rounds, seeds):
    """Forty two-hop gathers (of shards that require grad, as parameters do),
    reductions and gathers over a plain gloo group a round, issued back to back with compute between some,
    a few waited at once and the rest in a shuffled order, so that most hops
    are issued from a completion callback behind an unfinished predecessor:
    every result is the one its own collective should give, no rank hangs,
    and each hop group still carries one hop at a time (gathers and
    reductions each on their own). Before hops ran with autograd off, a
    first hop issued from a callback recorded the shard's copy, failed, and
    the wait returned an unwritten output."""
    from spawn import run_ranks
    from workers import two_hop_chain_stress

    for seed in seeds:
        results = run_ranks(two_hop_chain_stress, 4, rounds, 40, seed, timeout=540)
        for differ, most in results:
            assert differ == [], (seed, differ[:10])
            # Cross- and intra-node groups, for gathers and for reductions,
            # and the world group the plain gathers are chained on.
            assert sorted(most.values()) == [1, 1, 1, 1, 1], most
