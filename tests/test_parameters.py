"""FSDP2's parameter model: DTensor parameters under their original names, and
the ordinary code around a training loop, each against a single process that
sees the whole batch (4 gloo ranks as 2 emulated nodes of 2)."""

import pytest
from parameter_workers import SCENARIOS, parameter_model
from spawn import run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

WORLD = 4
FP32 = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def eager_results():
    return run_ranks(parameter_model, WORLD, "eager", list(SCENARIOS), timeout=840)


def assert_trains_like_reference(result, loss_rtol=1e-5, gap=1e-5):
    for loss, ref in zip(result["losses"], result["ref_losses"], strict=True):
        assert loss == pytest.approx(ref, rel=loss_rtol)
    assert max(result["gaps"].values()) <= gap, result["gaps"]


def test_clip_grad_norm_returns_the_global_norm_and_clips_every_rank_alike(eager_results):
    for rank_result in eager_results:
        r = rank_result["clipping"]
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
        assert r["total_norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
        # Clipping was active (the norms are far above max_norm=0.05).
        assert min(r["ref_norms"]) > 0.2
        assert_trains_like_reference(r)


def test_weight_decay_grouped_by_dim_like_nanogpt(eager_results):
    r = eager_results[1]["decay_groups"]
    assert r["names"] == r["ref_names"]
    assert r["decayed"] == r["ref_decayed"] == ["fc1.weight", "fc2.weight", "fc3.weight"]
    assert_trains_like_reference(r, gap=2e-5)


def test_full_state_dict_loads_after_distribute(eager_results):
    r = eager_results[2]["load_full_state_dict"]
    assert r["state_dict_types"] == ["DTensor"]
    assert_trains_like_reference(r)


def test_in_place_init_and_copies_reach_the_shards(eager_results):
    assert_trains_like_reference(eager_results[3]["in_place_init"])


def test_adafactor_refused_at_construction_on_shards_and_exact_on_replicas(eager_results):
    for rank_result in eager_results:
        r = rank_result["adafactor"]
        assert r["error"] and "Adafactor" in r["error"] and "strategy='ddp'" in r["error"]
    assert_trains_like_reference(eager_results[0]["adafactor"])


def test_bf16_param_dtype_runs_on_fp32_inputs(eager_results):
    r = eager_results[0]["bf16_compute"]
    assert r["dtypes"] == ["torch.float32"]  # shards and optimizer stay fp32
    assert_trains_like_reference(r, loss_rtol=3e-2, gap=2e-2)


def test_reading_a_parameter_on_one_rank_runs_no_collective(eager_results):
    seen = eager_results[0]["read_on_one_rank"]["seen"]
    assert seen["type"] == "DTensor" and seen["shape"] == (37, 13)
    for rank_result in eager_results:
        assert rank_result["read_on_one_rank"]["comm"]["calls"] == {}


def test_each_model_keeps_its_own_topology(eager_results):
    for rank_result in eager_results:
        r = rank_result["two_topologies"]
        assert r["two_nodes"]["inter_node_bytes"] > 0 and r["two_nodes"]["intra_node_bytes"] > 0
        assert r["one_node"]["inter_node_bytes"] == 0 and r["one_node"]["intra_node_bytes"] > 0
        assert r["two_nodes_again"] == r["two_nodes"]
        # Built from node_size: a (node, local) DeviceMesh, whose groups zppc uses.
        assert r["meshes"]["two_nodes"]["shape"] == (2, 2)
        assert r["meshes"]["one_node"]["shape"] == (1, 4)
        for mesh in r["meshes"].values():
            assert mesh["names"] == ("node", "local") and mesh["groups_from_mesh"]


def test_user_device_mesh_gives_the_groups(eager_results):
    for rank, rank_result in enumerate(eager_results):
        r = rank_result["user_mesh"]
        assert r["node_size"] == 2
        node = rank // 2
        assert r["groups"] == [[2 * node, 2 * node + 1], [rank % 2, rank % 2 + 2]]
        # int8 weights in the forward: the loss moves by quantization noise only.
        assert_trains_like_reference(r, loss_rtol=2e-3, gap=2e-2)


@pytest.mark.slow
def test_clipping_under_inductor():
    r = run_ranks(parameter_model, WORLD, "inductor", ["clipping"], timeout=840)[0]["clipping"]
    assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
    assert_trains_like_reference(r)
