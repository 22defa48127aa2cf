"""qwZ on gloo ranks: bytes measured by the ledger, exactness, accuracy."""

import pytest
import torch
from spawn import run_ranks
from workers import lossless_qwz_step, qwz_lowerings, qwz_step_bytes, qwz_training

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]
WORLD = 4


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_int8_gathers_move_a_quarter_of_fp32(dtype):
    for result in run_ranks(qwz_step_bytes, WORLD, dtype):
        p, q = result[None], result["int8"]
        # The quantized gathers are exactly the payloads (values + one scale per
        # block + alignment) the schedule predicts, measured as they ran...
        assert sum(q["gather_peer_bytes"]) * (WORLD - 1) == q["stats"]["by_kind"]["all_gather"]
        # ...and about 1/4 of fp32 (1/2 of bf16), plus the scales.
        ratio = q["stats"]["by_kind"]["all_gather"] / p["stats"]["by_kind"]["all_gather"]
        expected = 0.25 if dtype == "float32" else 0.5
        print(f"{dtype}: int8 gathers move {ratio:.4f} of the unquantized bytes")
        assert expected <= ratio <= expected * 1.05
        # Gradients are untouched by qwZ.
        # (gloo, 2 x 2: reduce-scatters in two hops, Config.reduce_scatter="auto").
        assert q["stats"]["by_kind"]["reduce_scatter"] == p["stats"]["by_kind"]["reduce_scatter"]
        assert q["stats"]["inter_node_bytes"] < p["stats"]["inter_node_bytes"]


def test_lossless_blocks_reproduce_unquantized_results_exactly():
    for result in run_ranks(lossless_qwz_step, 2):
        plain, quant = result[None], result["int8"]
        assert torch.equal(plain["loss"], quant["loss"])
        for a, b in zip(plain["grads"], quant["grads"], strict=True):
            assert torch.equal(a, b)


def test_training_accuracy_int8_and_int4():
    # Held-out loss after 80 steps on real text, the same batches for all three.
    result = run_ranks(qwz_training, 2, 80)[0]
    base, int8, int4 = (result[q]["held_out"] for q in (None, "int8", "int4"))
    print(f"held-out loss: zero3 {base:.4f}, qwz int8 {int8:.4f}, int4 {int4:.4f}")
    assert abs(int8 - base) <= 0.01 * base
    assert abs(int4 - base) <= 0.03 * base
    assert result[None]["losses"][-1] < result[None]["losses"][0] - 1.0


@pytest.mark.inductor
@pytest.mark.timeout(900)
def test_inductor_lowering_matches_eager():
    # Inductor generates the (inlined) quantization arithmetic itself: the
    # integers and scales must come out the same, so the losses agree to
    # float32 noise from fused compute, far below one quantization step.
    result = run_ranks(qwz_lowerings, 2, timeout=840)[0]
    for a, b in zip(result["eager"], result["inductor"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), result
