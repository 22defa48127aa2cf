"""At scale, in one process: the fake process group traces real graphs for
hundreds of ranks, so the schedule and bytes can be checked without a cluster."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import zppc
from zppc.models import GPT, PRESETS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_world(request):
    world, rank = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    torch._dynamo.reset()
    yield world, rank
    torch._dynamo.reset()
    dist.destroy_process_group()


def compile_one_step(config: zppc.Config):
    torch.manual_seed(0)
    model = zppc.distribute(GPT(PRESETS["gpt-tiny"]), config)
    step = torch.compile(model, backend="zppc")
    tokens = torch.randint(0, 256, (2, 33))
    step(tokens[:, :-1], tokens[:, 1:]).backward()
    return model, zppc.inspect(step)


@pytest.mark.parametrize("fake_world", [(8, 3), (384, 17)], indirect=True)
def test_zero3_schedule_at_scale(fake_world):
    world, rank = fake_world
    node_size = 16 if world > 16 else 4
    config = zppc.Config(node_size=node_size, lowering="eager", disable_passes=("bucket",))
    model, inspection = compile_one_step(config)
    state = model._zppc_state
    shard_bytes = {fqn: spec.shard_numel * 4 for fqn, spec in state.specs.items()}
    # Tied embedding: one logical parameter, gathered once per graph.
    assert "lm_head.weight" not in state.specs and "wte.weight" in state.specs

    schedule = inspection.schedule
    forward = [c for c in schedule if c.graph == "forward"]
    backward = [c for c in schedule if c.graph == "backward"]
    assert [c.kind for c in forward] == ["all_gather"] * len(shard_bytes)
    scatters = [c for c in backward if c.kind == "reduce_scatter"]
    assert len(scatters) == len(shard_bytes)
    assert sorted(c.bytes_per_peer for c in scatters) == sorted(shard_bytes.values())
    for c in schedule:
        assert c.group_size == world
        assert c.intra_node_bytes == (node_size - 1) * c.bytes_per_peer
        assert c.inter_node_bytes == (world - node_size) * c.bytes_per_peer
    # The model's bytes cross the network three times (minus what backward need
    # not re-gather): ZeRO-3's 3M.
    model_bytes = sum(shard_bytes.values()) * world
    total = sum(c.bytes_per_peer for c in schedule) * world
    assert 2 * model_bytes < total <= 3 * model_bytes


@pytest.mark.parametrize("fake_world", [(64, 5)], indirect=True)
def test_padding_for_sizes_smaller_than_the_world(fake_world):
    world, _ = fake_world
    model, _ = compile_one_step(zppc.Config(lowering="eager", node_size=8))
    state = model._zppc_state
    for fqn, spec in state.specs.items():
        # Dim 0 is split as Shard(0) splits it (whole rows, padded per rank).
        rows = math.ceil(spec.shape[0] / world)
        assert spec.shard_numel == rows * spec.numel // spec.shape[0]
        assert state.shard(fqn).numel() == spec.shard_numel
        param = state.parameter(fqn)
        assert param.shape == spec.shape and param.placements == spec.placements
        # Every rank's piece of the DTensor is a view of its flat shard.
        local = param.to_local()
        assert local.shape == spec.local_shape(dist.get_rank())
        assert local.untyped_storage().data_ptr() == state.shard(fqn).untyped_storage().data_ptr()


@pytest.mark.parametrize("fake_world", [(384, 0)], indirect=True)
def test_buckets_respect_the_size_limit(fake_world):
    """The cap holds for the gathered bucket: at 384 ranks a bucket of shards
    that fits per rank would gather 384 times the cap."""
    world, _ = fake_world
    limit = 64 * 4 * world  # gathered bytes: a few of the tiny GPT's padded weights
    model, inspection = compile_one_step(
        zppc.Config(node_size=16, lowering="eager", bucket_bytes=limit)
    )
    shard_bytes = [spec.shard_numel * 4 for spec in model._zppc_state.specs.values()]
    forward = [c for c in inspection.schedule if c.graph == "forward"]
    # Every parameter is gathered exactly once, in fewer, bounded collectives.
    assert sum(c.bytes_per_peer for c in forward) == sum(shard_bytes)
    assert len(forward) < len(shard_bytes)
    for c in forward:
        gathered = c.bytes_per_peer * c.group_size
        assert gathered <= max(limit, max(shard_bytes) * world)


@pytest.mark.parametrize("fake_world", [(384, 40)], indirect=True)
def test_hpz_keeps_backward_gathers_inside_the_node(fake_world):
    config = zppc.Config(node_size=16, hpz=True, lowering="eager")
    _, inspection = compile_one_step(config)
    backward_gathers = [
        c for c in inspection.schedule if c.graph == "backward" and c.kind == "all_gather"
    ]
    assert backward_gathers
    for c in backward_gathers:
        assert c.group_size == 16 and c.inter_node_bytes == 0
    plain = compile_one_step(zppc.Config(node_size=16, lowering="eager"))[1].schedule
    inter = lambda sched: sum(c.inter_node_bytes for c in sched)  # noqa: E731
    # ZeRO++: hpZ removes the backward's share of the cross-node bytes.
    assert inter(inspection.schedule) < inter(plain)


@pytest.mark.parametrize("fake_world", [(16, 1)], indirect=True)
def test_ledger_never_reads_a_collective_result(fake_world):
    """Counting stays off the data path: a hook on a result would keep every
    gathered weight alive until the hook runs (Inductor schedules a consumer of
    nothing last). Each hook reads the collective's input, right before it."""
    record = torch.ops.zppc.record_comm.default
    wait = torch.ops._c10d_functional.wait_tensor.default
    config = zppc.Config(node_size=4, lowering="eager", qwz="int8", hpz=True)
    _, inspection = compile_one_step(config)
    for compiled in inspection.compiles:
        for kind, gm in compiled.final.items():
            hooks = gm.graph.find_nodes(op="call_function", target=record)
            assert hooks, f"{kind}: no ledger hook"
            for node in gm.graph.find_nodes(op="call_function", target=wait):
                assert record not in {u.target for u in node.users}, f"{kind}: {node.name}"
            for hook in hooks:
                issue = hook.next
                assert issue.args[0] is hook.args[0], f"{kind}: {hook.name} is not at its issue"


@pytest.mark.parametrize("fake_world", [(4, 1)], indirect=True)
@pytest.mark.parametrize(
    "compiled, lowering",
    [(False, "eager"), (True, "eager"), (True, "inductor")],
    ids=["uncompiled", "compiled-eager", "compiled-inductor"],
)
def test_zero_grad_frees_the_shard_gradients_before_the_next_forward(
    fake_world, compiled, lowering
):
    """`zero_grad()` drops the DTensor `.grad`; the flat shard's gradient under
    it is freed as the next forward starts, not kept through that forward and
    backward (a shard of the whole model, alive where activations peak).
    Without `zero_grad` the gradient is kept and accumulated into."""
    torch.manual_seed(0)
    model = zppc.distribute(GPT(PRESETS["gpt-tiny"]), zppc.Config(node_size=2, lowering=lowering))
    step = torch.compile(model, backend="zppc") if compiled else model
    flats = model._zppc_state.flat_shards.values()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (2, 33))

    def forward():
        return step(tokens[:, :-1], tokens[:, 1:])

    forward().backward()
    held = [f.grad for f in flats]
    assert all(g is not None for g in held)
    loss = forward()  # accumulating: the gradients stay
    assert all(f.grad is g for f, g in zip(flats, held, strict=True))
    loss.backward()
    assert all(f.grad is g for f, g in zip(flats, held, strict=True))
    opt.step()
    opt.zero_grad()
    loss = forward()
    assert all(f.grad is None for f in flats)
    loss.backward()
    assert all(f.grad is not None for f in flats)
    assert all(p.grad is not None for p in model.parameters())


def live_tensor_peak(
    config: str, world: int, bucket: str = "0", lowering: str = "eager", accumulate: int = 1
) -> int:
    """`benchmarks/memory.py`'s peak of live tensor bytes for one row (gpt-medium,
    batch 4, AdamW), in a process of its own: what an earlier test or row left
    in this process cannot shift the count."""
    from memory import run_row

    row = run_row(config, world, bucket, "live", lowering=lowering, accumulate=accumulate)
    return row["live_peak_bytes"]


@pytest.mark.parametrize("lowering", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_zero3_holds_no_more_tensor_memory_than_fsdp2(lowering):
    """gpt-medium at world 2, zero3 with the default Config against FSDP2
    wrapping each block: the step's peak of live tensors, shards, gradients
    and optimizer state included, is no higher than FSDP2's. It was 49 MiB
    higher while the eager lowering kept the backward's inputs (the saved
    activations) alive to its last op, 8% higher with 25 MiB buckets as the
    default, where the bucket cap now follows the repeated block; and 2.9%
    higher under Inductor, which moved reads of a bucket past the next
    gather, held dead buffers for reuse and kept each in-flight gather's
    input to its wait (`zppc::all_gather_in_place` copies it into the
    output)."""
    zppc_peak = live_tensor_peak("zppc-zero3", 2, "auto", lowering)
    fsdp2_peak = live_tensor_peak("torch-fsdp2", 2)
    assert zppc_peak <= fsdp2_peak, (zppc_peak / 2**20, fsdp2_peak / 2**20)


@pytest.mark.parametrize(
    "accumulate, alive_at_peak",
    [
        # Two micro-batches: the first one's gradient shards are alive through the
        # second's forward and backward, so all four copies of the state are.
        (2, 4),
        # One: zero_grad freed the gradients, and the peak comes early in the
        # backward, before this step's exist: parameters and two moments.
        pytest.param(1, 3, marks=pytest.mark.slow),
    ],
)
def test_zero3_peak_falls_with_the_world_size(accumulate, alive_at_peak):
    """The issue's measure: gpt-medium's peak of live tensors per rank falls
    from 2 to 4 ranks by at least 80% of what sharding removes from the state
    alive at that peak (AdamW: parameters, gradients, two moments; 97.2 MiB
    for all four). Measured: 100% in both cases, as FSDP2's."""
    from memory import model_state_bytes

    state_per_copy = model_state_bytes("gpt-medium") / 4
    ideal = alive_at_peak * state_per_copy * (1 / 2 - 1 / 4)
    fall = live_tensor_peak("zppc-zero3", 2, "auto", accumulate=accumulate) - live_tensor_peak(
        "zppc-zero3", 4, "auto", accumulate=accumulate
    )
    assert fall >= 0.8 * ideal, (fall / 2**20, ideal / 2**20)


@pytest.mark.parametrize("fake_world", [(8, 5)], indirect=True)
def test_inspect_exports_json_a_trace_and_a_dump_dir(fake_world, tmp_path, monkeypatch):
    monkeypatch.setenv("ZPPC_DUMP_DIR", str(tmp_path / "dump"))
    config = zppc.Config(node_size=4, lowering="eager", qwz="int8", bucket_bytes=2**16)
    _, inspection = compile_one_step(config)
    document = inspection.to_json()
    (compiled,) = document["compiles"]
    assert compiled["config"]["qwz"] == "int8"
    assert [p["name"] for p in compiled["passes"]["backward"]][-1] == "overlap"
    assert len(compiled["schedule"]) == len(inspection.schedule)
    json.dumps(document)  # plain data
    trace = tmp_path / "step.json"
    inspection.to_chrome_trace(trace)
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events} == {"compute", "communication"}
    assert sum(e["tid"] == "communication" for e in events) == len(inspection.schedule)
    assert all(e["pid"] == 5 for e in events)
    # Every graph after every pass, and the schedule, under rank5/compile0.
    where = tmp_path / "dump" / "rank5" / "compile0"
    names = sorted(p.name for p in where.iterdir())
    assert "schedule.json" in names
    assert "forward_00_input.py" in names and any(
        n.startswith("backward_") and n.endswith("_overlap.py") for n in names
    )
    assert json.loads((where / "schedule.json").read_text())["schedule"] == compiled["schedule"]


@pytest.mark.parametrize("fake_world", [(8, 3)], indirect=True)
def test_default_buckets_gather_at_most_one_block(fake_world):
    """With the default Config, gpt-small at world 8: every forward gather
    materializes at most one transformer block's weights (3.01 MiB), and the
    buckets follow the blocks: the edge bucket (the embeddings and block 0's
    first weights, at most half the cap), the rest of block 0, then each block
    whole in one gather, then the final norm (with `edge_buckets=False` the
    embeddings alone, then block 0 whole). An explicit 25 MiB cap gathers
    the rest of the model at once, after an edge no larger than at the
    default cap (half a block)."""
    world, _ = fake_world

    def forward_gathers(config):
        torch.manual_seed(0)
        model = zppc.distribute(GPT(PRESETS["gpt-small"]), config)
        step = torch.compile(model, backend="zppc")
        tokens = torch.randint(0, 256, (2, 129))
        step(tokens[:, :-1], tokens[:, 1:]).backward()
        schedule = zppc.inspect(step).schedule
        torch._dynamo.reset()
        return model, [c for c in schedule if c.graph == "forward" and c.kind == "all_gather"]

    model, gathers = forward_gathers(zppc.Config(node_size=4, lowering="eager"))
    cap = model._zppc_state.block_bucket_bytes
    assert cap == 4 * (12 * 256**2 + 13 * 256)
    assert all(g.unquantized_bytes_per_peer * world <= cap for g in gathers)
    sizes = [g.unquantized_bytes_per_peer * world for g in gathers]
    blocks = PRESETS["gpt-small"].n_layer
    embeddings, final_norm = 4 * (256 + 128) * 256, 4 * 2 * 256
    edge, rest_of_block_0 = sizes[:2]
    assert embeddings < edge <= cap // 2, sizes
    assert edge + rest_of_block_0 == embeddings + cap, sizes
    assert sorted(sizes[2:]) == sorted([final_norm] + [cap] * (blocks - 1)), sizes
    # Config.edge_buckets=False: the embeddings, then block 0 whole like the rest.
    _, plain = forward_gathers(zppc.Config(node_size=4, lowering="eager", edge_buckets=False))
    plain_sizes = [g.unquantized_bytes_per_peer * world for g in plain]
    assert plain_sizes[:2] == [embeddings, cap], plain_sizes
    assert sorted(plain_sizes) == sorted([embeddings, final_norm] + [cap] * blocks), plain_sizes
    _, whole = forward_gathers(zppc.Config(node_size=4, lowering="eager", bucket_bytes=25 * 2**20))
    whole_sizes = [g.unquantized_bytes_per_peer * world for g in whole]
    assert whole_sizes == [edge, sum(sizes) - edge], whole_sizes
