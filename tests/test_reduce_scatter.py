"""The `reduce_scatter` pass: which algorithm each backend and topology gets,
and what the all-to-all form puts in the graph. Numerics on gloo ranks are the
differential matrix's (`zero3` runs the all-to-all there, `zero3-native-rs`
gloo's own reduce-scatter, both against one process)."""

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from zppc.passes import planning
from zppc.passes.reduce_scatter import algorithm_for
from zppc.passes.zero import find_collectives

import zppc
from zppc.models import GPT, PRESETS


@pytest.fixture
def fake_world(request):
    world, node_size = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=world - 1, world_size=world)
    torch._dynamo.reset()
    yield world, node_size
    torch._dynamo.reset()
    dist.destroy_process_group()


def world_group_name(world: int, node_size: int) -> str:
    torch.manual_seed(0)
    model = zppc.distribute(GPT(PRESETS["gpt-tiny"]), zppc.Config(node_size=node_size))
    return model._zppc_state.groups.world


@pytest.mark.parametrize(
    "fake_world, gloo_picks",
    [
        (
            (4, 2),
            "two_hop",
        ),  # into each node: 2 chunks in two hops, 4 direct, 6 through gloo's ring
        ((8, 2), "two_hop"),  # 6 against 12 and 14
        ((8, 4), "two_hop"),  # 4 against 16 and 14
        ((4, 4), "all_to_all"),  # one node: nothing crosses; the all-to-all moves half in all
        ((6, 1), "all_to_all"),  # a rank per node (no hops inside a node): 5 against 10
        ((6, 4), "all_to_all"),  # uneven nodes, no hop groups: 8 direct against 10
    ],
    indirect=["fake_world"],
)
def test_auto_picks_the_algorithm_moving_fewer_bytes_into_a_node(fake_world, gloo_picks):
    group = world_group_name(*fake_world)
    with planning(backend="gloo"):
        assert algorithm_for("auto", group) == gloo_picks
        assert algorithm_for("native", group) == "native"
        assert algorithm_for("all_to_all", group) == "all_to_all"
    with planning(backend="nccl"):  # a ring reduce-scatter: never worse than direct
        assert algorithm_for("auto", group) == "native"
    assert algorithm_for("auto", group) == "native"  # the fake group's own backend


def backward_collectives(reduce_scatter: str):
    torch.manual_seed(0)
    config = zppc.Config(node_size=2, lowering="eager", reduce_scatter=reduce_scatter)
    model = zppc.distribute(GPT(PRESETS["gpt-tiny"]), config)
    step = torch.compile(model, backend="zppc")
    tokens = torch.randint(0, 256, (2, 17))
    step(tokens[:, :-1], tokens[:, 1:]).backward()
    (record,) = zppc.inspect(step).compiles
    backward = record.final["backward"]
    return backward, find_collectives(backward.graph)


@pytest.mark.parametrize("fake_world", [(4, 2)], indirect=True)
def test_all_to_all_replaces_each_reduce_scatter_in_place_with_its_bytes(fake_world):
    world, _ = fake_world
    _, native = backward_collectives("native")
    torch._dynamo.reset()
    _, direct = backward_collectives("all_to_all")
    assert any(m.kind == "reduce_scatter" for m in native)
    # The same schedule, each reduce-scatter an all-to-all of the same input.
    assert [m.kind for m in direct] == [
        "all_to_all" if m.kind == "reduce_scatter" else m.kind for m in native
    ]
    for a, b in zip(native, direct, strict=True):
        assert a.input.meta["val"].shape == b.input.meta["val"].shape
        assert a.group_name == b.group_name
    for m in direct:
        if m.kind != "all_to_all":
            continue
        slice_numel = m.input.meta["val"].numel() // world
        assert list(m.issue.args[1]) == list(m.issue.args[2]) == [slice_numel] * world
        # ...whose [world, S] slices are summed over the ranks: this rank's shard.
        (rows,) = m.wait.users
        (summed,) = rows.users
        assert rows.target == torch.ops.aten.view.default
        assert list(rows.args[1]) == [world, slice_numel]
        assert summed.target == torch.ops.aten.sum.dim_IntList and list(summed.args[1]) == [0]
        assert summed.meta["val"].shape == (slice_numel,)


@pytest.mark.parametrize("fake_world", [(4, 2)], indirect=True)
def test_two_hop_replaces_each_reduce_scatter_with_one_over_the_reduction_hop_world(fake_world):
    from zppc.runtime.topology import gather_hops, reduction_hops

    world, _ = fake_world
    _, native = backward_collectives("native")
    native_group = next(m.group_name for m in native if m.kind == "reduce_scatter")
    torch._dynamo.reset()
    backward, hops = backward_collectives("two_hop")
    assert [m.kind for m in hops] == [m.kind for m in native]
    reductions = [m for m in hops if m.kind == "reduce_scatter"]
    assert reductions and len(reductions) == sum(m.kind == "reduce_scatter" for m in native)
    for a, b in zip(native, hops, strict=True):
        assert a.input.meta["val"].shape == b.input.meta["val"].shape
    for m in reductions:
        # One op over the reduction hop world (its second hop is issued at run
        # time), whose result is this rank's slice: nothing else in the graph.
        assert m.issue.target == torch.ops.zppc.reduce_scatter_in_two_hops.default
        hop_world = m.group_name
        assert reduction_hops(hop_world).world == hop_world
        assert gather_hops(hop_world) is None and hop_world != native_group
        assert m.wait.meta["val"].shape == (m.input.meta["val"].numel() // world,)
    with pytest.raises(ValueError, match="reduce_scatter='two_hop' needs gloo and several"):
        torch._dynamo.reset()
        zppc.distribute(
            GPT(PRESETS["gpt-tiny"]), zppc.Config(node_size=4, reduce_scatter="two_hop")
        )


@pytest.mark.parametrize("fake_world", [(4, 2)], indirect=True)
def test_schedule_gloo_plans_each_algorithm_with_the_same_logical_bytes(fake_world, capsys):
    import json

    from zppc.cli import main

    dist.destroy_process_group()  # the CLI makes its own fake group
    args = ["schedule", "gpt-tiny", "--world-size", "4", "--node-size", "2", "--format", "json"]
    runs = {
        "nccl": ["--backend", "nccl"],
        "gloo": ["--backend", "gloo"],  # auto: two hops on 2 x 2
        "gloo direct": ["--backend", "gloo", "--reduce-scatter", "all_to_all"],
    }
    plans, osp = {}, {}
    for name, flags in runs.items():
        assert main([*args, *flags]) == 0
        plans[name] = json.loads(capsys.readouterr().out)
        assert main([*args, *flags, "--osp", "0.5"]) == 0
        osp[name] = json.loads(capsys.readouterr().out)["collectives"]
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    # OSP's stage 2 (issued at run time, not by the pass, on side groups)
    # follows stage 1: on gloo "auto" takes two hops, all-to-alls inside the
    # node and across on groups of its own; "all_to_all" exchanges directly.
    stage2 = {
        name: [(c["kind"], c["group_size"]) for c in rows if c["stage"] == 2]
        for name, rows in osp.items()
    }
    assert set(stage2["nccl"]) == {("reduce_scatter", 4)}
    assert set(stage2["gloo"]) == {("all_to_all", 2)} and len(stage2["gloo"]) % 2 == 0
    assert set(stage2["gloo direct"]) == {("all_to_all", 4)}
    kinds = {name: [c["kind"] for c in p["collectives"]] for name, p in plans.items()}
    assert "reduce_scatter" in kinds["nccl"] and kinds["gloo"] == kinds["nccl"]
    assert kinds["gloo direct"] == [
        "all_to_all" if k == "reduce_scatter" else k for k in kinds["nccl"]
    ]
    for name in plans:  # the ledger's logical bytes
        for key in ("intra_node_bytes", "inter_node_bytes"):
            assert plans[name]["totals"][key] == plans["nccl"]["totals"][key]
    # Into each node per reduction: a ring's 3 chunks (which gloo's all-reduce
    # sends twice), a direct exchange's 4, two hops' 2 (the node's partial sums).
    reductions = {
        name: [c for c in p["collectives"] if c["kind"] in ("reduce_scatter", "all_to_all")]
        for name, p in plans.items()
    }
    for ring, hops, direct in zip(*reductions.values(), strict=True):
        assert ring["node_link_bytes"] == 3 * ring["bytes_per_peer"] and not ring["two_hops"]
        assert hops["node_link_bytes"] == 2 * hops["bytes_per_peer"] and hops["two_hops"]
        assert direct["node_link_bytes"] == 4 * direct["bytes_per_peer"]
        assert ring["bytes_per_peer"] == hops["bytes_per_peer"] == direct["bytes_per_peer"]
    # Gathers: a ring's 3 shards into each node on NCCL, two hops' 2 on gloo
    # (across the nodes, then inside them), on a group of their own; the
    # two-hop reductions on another.
    gathers = {
        b: [c for c in p["collectives"] if c["kind"] == "all_gather"] for b, p in plans.items()
    }
    assert len(gathers["gloo"]) == len(gathers["nccl"]) >= 2
    for ring, hops in zip(gathers["nccl"], gathers["gloo"], strict=True):
        assert ring["bytes_per_peer"] == hops["bytes_per_peer"]
        assert ring["node_link_bytes"] == 3 * ring["bytes_per_peer"]
        assert hops["node_link_bytes"] == 2 * hops["bytes_per_peer"] and hops["two_hops"]
    gather_groups = {c["group_name"] for c in gathers["gloo"]}
    reduction_groups = {c["group_name"] for c in reductions["gloo"]}
    assert len(gather_groups) == len(reduction_groups) == 1
    assert gather_groups != reduction_groups
    assert (
        plans["gloo"]["totals"]["node_link_bytes"]
        < plans["gloo direct"]["totals"]["node_link_bytes"]
    )


@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "world, node_size, link_slices",
    [
        (4, 2, (2, 4)),  # 2 nodes x 2: half the direct exchange's slices into each node
        (6, 2, (4, 8)),  # 3 x 2
        (6, 3, (3, 9)),  # 2 x 3: a third
    ],
)
def test_two_hop_reduce_scatter_sums_every_rank_slice(world, node_size, link_slices):
    """The reduction hop world's reduce-scatter (inside the nodes, then across)
    returns this rank's slice of the sum over the ranks, for odd sizes and
    every dtype, with several in flight, on layouts with as many, more and
    fewer nodes than ranks per node; D (N - 1) slices enter each node. However
    many are in flight, each hop group carries one hop at a time (gloo), and
    both hop groups are used."""
    from spawn import run_ranks
    from workers import two_hop_reduce_scatters

    tolerance = {"float32": 1e-6, "bfloat16": 2e-2, "float16": 2e-3}
    for errors, slices, most in run_ranks(two_hop_reduce_scatters, world, node_size, timeout=540):
        for (n, dtype), error in errors.items():
            assert error <= tolerance[dtype], (n, dtype, error)
        assert slices == link_slices
        assert list(most.values()) == [1, 1], most
