"""RTP (`Config(strategy="rtp")`): rotated weight shards on a ring.

Parity: compiled RTP training equals one process on the whole batch (the
tolerances of test_parity: float32 summation order only). The plan: which
parameters rotate, that no gather or reduce-scatter of a rotated weight is
left, the ring's bytes per rank and per link (exact, derived from the shapes
and the hop counts), and that no full weight is saved for backward.
"""

import math

import pytest
from rtp_workers import rtp_step, step_memory, uneven_batches
from spawn import run_ranks
from test_parity import check, run_matrix
from zppc.kernels.quant import PayloadLayout

pytestmark = pytest.mark.multiproc

CASES = [(m, o) for m in ("mlp", "gpt", "frozen", "attention") for o in ("sgd", "adamw")]
CASES.append(("cross_attention", "adamw"))


def check_matrix(per_rank, cases):
    for case in cases:
        results = [r[case] for r in per_rank]
        for result in results:
            assert result["graphs"] >= 1, "nothing was compiled"
            assert result["comm"]["by_kind"].get("send_recv", 0) > 0, "the ring never ran"
            check(result)
        assert all(r["gaps"] == results[0]["gaps"] for r in results), "ranks disagree"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_rtp_trains_like_one_process(world):
    per_rank = run_ranks(run_matrix, world, "rtp", 2, "eager", CASES, timeout=540)
    check_matrix(per_rank, CASES)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_rtp_on_eight_ranks_trains_like_one_process():
    """N = 8 as 4 nodes of 2: every rank sees every shard once per ring (the
    reference code's rotation order fails beyond 2)."""
    cases = [("mlp", "sgd"), ("gpt", "adamw")]
    per_rank = run_ranks(run_matrix, 8, "rtp", 2, "eager", cases, timeout=1140)
    check_matrix(per_rank, cases)


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.timeout(1500)
def test_rtp_trains_like_one_process_under_inductor():
    cases = [("mlp", "adamw"), ("gpt", "sgd"), ("attention", "adamw")]
    per_rank = run_ranks(run_matrix, 4, "rtp", 2, "inductor", cases, timeout=1440)
    check_matrix(per_rank, cases)


CHAIN = [(30, 10), (21, 30), (7, 21)]  # tests/models.py Chain: bias-free linears (out, in)


def expected_ring_bytes(world: int, weight_hop=lambda numel: 4 * numel) -> tuple[int, int]:
    """(bytes, transfers) each rank receives in one Chain step: per layer of R
    rows per rank, a float32 shard of R x in; the forward applies the N-1
    shards of the others, the backward re-rotates them (N-1 hops) unless the
    input needs no gradient (the first layer), and reduces the weight
    gradient with N partial-sum hops (`weight_hop(numel)`: the bytes of one
    weight hop, float32 unless quantized)."""
    total = calls = 0
    for layer, (out, inp) in enumerate(CHAIN):
        numel = math.ceil(out / world) * inp
        weight_hops = (world - 1) + (0 if layer == 0 else world - 1)
        total += weight_hops * weight_hop(numel) + world * 4 * numel
        calls += weight_hops + world
    return total, calls


@pytest.mark.timeout(300)
def test_rtp_plan_ring_bytes_and_saved_tensors():
    world = 4
    per_rank = run_ranks(rtp_step, world, timeout=240)
    total, calls = expected_ring_bytes(world)
    for rank, r in enumerate(per_rank):
        assert r["modes"] == {"l1.weight": "rtp", "l2.weight": "rtp", "l3.weight": "rtp"}
        assert r["rotated"] == ["l1.weight", "l2.weight", "l3.weight"]
        assert r["forward"].count("zppc.rtp_linear.default") == 3
        assert r["backward"].count("zppc.rtp_linear_backward.default") == 3
        gathers = [op for op in r["forward"] + r["backward"] if "all_gather" in op]
        assert not gathers and not [op for op in r["backward"] if "reduce_scatter" in op]
        assert r["stats"]["by_kind"] == {"send_recv": total}
        assert r["stats"]["calls"]["send_recv"] == calls
        # Ranks 0 and 2 receive from their node's other rank, 1 and 3 across nodes.
        crosses_node = rank % 2 == 1
        assert r["stats"]["inter_node_bytes"] == (total if crosses_node else 0)
        assert r["stats"]["intra_node_bytes"] == (0 if crosses_node else total)
        # The compiled plan states the same bytes as the run.
        assert r["planned"] == r["planned_unquantized"] == total
        assert not set(r["saved"]) & set(CHAIN), f"a full weight was saved: {r['saved']}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("qwz,bits", [("int8", 8), ("int4", 4)])
def test_rtp_qwz_hops_carry_quantized_payloads(qwz, bits):
    """With qwZ every weight hop is one payload (a bf16 scale per block of
    64, then the values); partial sums stay float32. Run, plan and the
    unquantized size all agree with the shapes."""
    world = 4
    extra = {"qwz": qwz, "qwz_block": 64}
    per_rank = run_ranks(rtp_step, world, "chain", "eager", extra, timeout=240)
    payload = lambda numel: PayloadLayout(numel, 64, bits).nbytes  # noqa: E731
    total, calls = expected_ring_bytes(world, payload)
    unquantized, _ = expected_ring_bytes(world)
    assert total < unquantized
    for r in per_rank:
        assert r["stats"]["by_kind"] == {"send_recv": total}
        assert r["stats"]["calls"]["send_recv"] == calls
        assert (r["planned"], r["planned_unquantized"]) == (total, unquantized)
        assert not [op for op in r["forward"] + r["backward"] if "all_gather" in op]


@pytest.mark.timeout(600)
def test_rtp_qwz_applies_the_weights_zero3_qwz_gathers():
    """Every rank, the owner too, applies the dequantized payload, the same
    weights ZeRO++'s quantized all-gather hands zero3: on a model whose every
    parameter rotates, rtp+qwz trains like zero3+qwz to float32 noise (only
    the gradient reduction order differs). Against unquantized training, both
    the chain and the GPT (whose norms and biases rtp replicates exactly) stay
    within the quantization error."""
    equal = [("chain", "sgd"), ("chain", "adamw")]
    qwz = {"qwz": "int8", "qwz_block": 64}
    rtp = run_ranks(run_matrix, 4, "rtp", 2, "eager", [*equal, ("gpt", "adamw")], qwz, timeout=540)
    zero3 = run_ranks(run_matrix, 4, "zero3", 2, "eager", equal, qwz, timeout=540)
    for r, z in zip(rtp, zero3, strict=True):
        for case in equal:
            assert r[case]["losses"] == pytest.approx(z[case]["losses"], rel=1e-5), case
        for case, got in r.items():
            assert got["comm"]["by_kind"].get("send_recv", 0) > 0, "the ring never ran"
            pairs = zip(got["losses"], got["ref_losses"], strict=True)
            quantization = max(abs(a - b) / abs(b) for a, b in pairs)
            assert 0 < quantization <= 1e-2, (case, quantization)
            assert got["losses"][-1] < got["losses"][0], case


@pytest.mark.timeout(300)
def test_rtp_rotates_attention_and_replicates_the_rest():
    """nn.MultiheadAttention's packed input projection and its output
    projection rotate (no gather of either is left); every bias is replicated
    (all-reduced gradients)."""
    r = run_ranks(rtp_step, 2, "attention", timeout=240)[0]
    assert r["modes"]["inp.bias"] == r["modes"]["out.bias"] == "ddp"
    assert set(r["rotated"]) == {
        "inp.weight",
        "attn.in_proj_weight",
        "attn.out_proj.weight",
        "out.weight",
    }
    assert r["forward"].count("zppc.rtp_linear.default") == 4
    assert not [op for op in r["forward"] + r["backward"] if "all_gather" in op]
    assert r["stats"]["by_kind"]["all_reduce"] > 0


@pytest.mark.timeout(300)
def test_rtp_cross_attention_rotates_what_one_linear_applies():
    """Separate query/key/value weights and the output projections rotate; a
    packed weight that attention slices (query != key) keeps its gather, the
    only gather left (forward, and again in backward as zero3 does)."""
    r = run_ranks(rtp_step, 2, "cross_attention", timeout=240)[0]
    assert r["modes"]["packed.in_proj_weight"] == "rtp"
    # inp, out, separate: q, k, v and output projection, packed: output projection
    assert r["forward"].count("zppc.rtp_linear.default") == 7
    assert [op for op in r["forward"] if "all_gather" in op] == [
        "_c10d_functional.all_gather_into_tensor.default"
    ]
    assert [op for op in r["backward"] if "all_gather" in op] == [
        "_c10d_functional.all_gather_into_tensor.default"
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rtp_hugging_face_llama_trains_like_one_process():
    pytest.importorskip("transformers", reason="needs `pip install -e .[hf]`")
    from hf_workers import train_hf

    r = run_ranks(train_hf, 4, "llama", {"strategy": "rtp"}, False, timeout=840)[0]
    for loss, ref in zip(r["losses"], r["ref_losses"], strict=True):
        assert loss == pytest.approx(ref, rel=1e-5)
    assert r["gap"] <= 1e-5


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_rtp_hugging_face_gpt2_rotates_conv1d_and_trains_like_one_process(world):
    """GPT-2's Conv1D layers (W stored [in, out], applied by addmm) rotate by
    input features; with the tied embedding and head, every 2-D weight rotates
    and no gather is left."""
    pytest.importorskip("transformers", reason="needs `pip install -e .[hf]`")
    from hf_workers import train_hf

    r = run_ranks(train_hf, world, "gpt2", {"strategy": "rtp"}, False, timeout=840)[0]
    conv = [
        fqn for fqn in r["modes"] if fqn.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
    ]
    assert conv and all(r["modes"][fqn] == "rtp" for fqn in conv)
    assert r["ops"].count("zppc.rtp_addmm.default") == len(conv)
    assert not [op for op in r["ops"] if "all_gather" in op]
    for loss, ref in zip(r["losses"], r["ref_losses"], strict=True):
        assert loss == pytest.approx(ref, rel=1e-5)
    assert r["gap"] <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rtp_step_memory_stays_near_a_shard_of_each_layer():
    """Measured, not computed: the resident set's peak during one step, above
    what the rank held before, for 4 layers of 16 MiB at 4 ranks (4 MiB
    shards). RTP adds this rank's gradient shards (1/N of the model) and at
    most three shards in flight (the weight computing and the one arriving;
    in backward also the partial sum arriving while this rank's is computed);
    zero3 gathers whole layers."""
    world, layers = 4, 4
    rtp = run_ranks(step_memory, world, "rtp", timeout=540)
    zero3 = run_ranks(step_memory, world, "zero3", timeout=540)
    layer = rtp[0]["layer"]
    shard, grads = layer // world, layers * layer // world
    slack = 2 * 2**20  # activations, the ledger, Python objects
    for r, z in zip(rtp, zero3, strict=True):
        assert r["added"] <= grads + 3 * shard + slack, (r["added"], grads, shard)
        assert z["added"] >= grads + layer, z["added"]  # the measure sees a gathered layer
        assert r["added"] < z["added"] - layer


@pytest.mark.timeout(300)
def test_rtp_micro_batches_of_any_size():
    """Micro-batches of 1, 3, 5 and 7 rows on 4 ranks: each rank's ring runs
    on its own batch size; the gradients are the mean of the ranks' gradients."""
    for rank, gaps in enumerate(run_ranks(uneven_batches, 4, timeout=240)):
        assert max(gaps.values()) <= 1e-6, (rank, gaps)


@pytest.mark.timeout(300)
def test_rtp_on_one_rank_trains_like_one_process_and_sends_nothing():
    (result,) = run_ranks(run_matrix, 1, "rtp", 1, "eager", [("gpt", "adamw")], timeout=240)
    result = result[("gpt", "adamw")]
    check(result)
    assert not result["comm"]["by_kind"].get("send_recv")
