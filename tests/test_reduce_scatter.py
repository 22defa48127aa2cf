"""The `reduce_scatter` pass: which algorithm each backend and topology gets,
and what the all-to-all form puts in the graph. Numerics on gloo ranks are the
differential matrix's (`zero3` runs the all-to-all there, `zero3-native-rs`
gloo's own reduce-scatter, both against one process)."""

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from zppc.passes import planning
from zppc.passes.reduce_scatter import uses_all_to_all
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
    "fake_world, gloo_picks_all_to_all",
    [
        ((4, 2), True),  # into each node: 4 chunks direct, 6 through gloo's all-reduce ring
        ((8, 2), True),  # 12 against 14
        ((8, 4), False),  # 16 against 14: gloo's own is kept
        ((4, 4), True),  # one node: nothing crosses; the all-to-all moves half in all
        ((6, 1), True),  # a rank per node: 5 against 10
    ],
    indirect=["fake_world"],
)
def test_auto_picks_the_algorithm_moving_fewer_bytes_into_a_node(fake_world, gloo_picks_all_to_all):
    group = world_group_name(*fake_world)
    with planning(backend="gloo"):
        assert uses_all_to_all("auto", group) is gloo_picks_all_to_all
        assert uses_all_to_all("native", group) is False
        assert uses_all_to_all("all_to_all", group) is True
    with planning(backend="nccl"):  # a ring reduce-scatter: never worse than direct
        assert uses_all_to_all("auto", group) is False
    assert uses_all_to_all("auto", group) is False  # the fake group's own backend


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
def test_schedule_gloo_plans_all_to_alls_with_the_same_logical_bytes(fake_world, capsys):
    import json

    from zppc.cli import main

    dist.destroy_process_group()  # the CLI makes its own fake group
    args = ["schedule", "gpt-tiny", "--world-size", "4", "--node-size", "2", "--format", "json"]
    plans, osp = {}, {}
    for backend in ("nccl", "gloo"):
        assert main([*args, "--backend", backend]) == 0
        plans[backend] = json.loads(capsys.readouterr().out)
        assert main([*args, "--backend", backend, "--osp", "0.5"]) == 0
        osp[backend] = json.loads(capsys.readouterr().out)["collectives"]
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    # OSP's stage 2 (issued at run time, not by the pass) follows the same rule.
    assert {c["kind"] for c in osp["nccl"] if c["stage"] == 2} == {"reduce_scatter"}
    assert {c["kind"] for c in osp["gloo"] if c["stage"] == 2} == {"all_to_all"}
    kinds = {b: [c["kind"] for c in p["collectives"]] for b, p in plans.items()}
    assert "reduce_scatter" in kinds["nccl"] and "reduce_scatter" not in kinds["gloo"]
    assert kinds["gloo"] == ["all_to_all" if k == "reduce_scatter" else k for k in kinds["nccl"]]
    for key in ("intra_node_bytes", "inter_node_bytes"):  # the ledger's logical bytes
        assert plans["gloo"]["totals"][key] == plans["nccl"]["totals"][key]
    # Into each node: a direct exchange's 4 chunks per reduction instead of a
    # ring's 3 (which gloo's all-reduce sends twice).
    rs = [c for c in plans["nccl"]["collectives"] if c["kind"] == "reduce_scatter"]
    a2a = [c for c in plans["gloo"]["collectives"] if c["kind"] == "all_to_all"]
    for ring, direct in zip(rs, a2a, strict=True):
        assert ring["node_link_bytes"] == 3 * ring["bytes_per_peer"]
        assert direct["node_link_bytes"] == 4 * direct["bytes_per_peer"]
    # Gathers: a ring's 3 shards into each node on NCCL, two hops' 2 on gloo
    # (across the nodes, then inside them), on a group of their own.
    gathers = {
        b: [c for c in p["collectives"] if c["kind"] == "all_gather"] for b, p in plans.items()
    }
    assert len(gathers["gloo"]) == len(gathers["nccl"]) >= 2
    for ring, hops in zip(gathers["nccl"], gathers["gloo"], strict=True):
        assert ring["bytes_per_peer"] == hops["bytes_per_peer"]
        assert ring["node_link_bytes"] == 3 * ring["bytes_per_peer"]
        assert hops["node_link_bytes"] == 2 * hops["bytes_per_peer"]
    assert len({c["group_name"] for c in gathers["gloo"]}) == 1
    assert {c["group_name"] for c in gathers["gloo"]}.isdisjoint(
        c["group_name"] for c in plans["gloo"]["collectives"] if c["kind"] != "all_gather"
    )
