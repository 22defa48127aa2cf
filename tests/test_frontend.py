"""distribute() and the backend entry: fallback, dtypes, meta-device models."""

import pytest
import torch
from spawn import run_ranks
from workers import dtype_training, meta_init, undistributed_ddp_fallback

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]


def test_undistributed_model_falls_back_to_ddp():
    results = run_ranks(undistributed_ddp_fallback, 2)
    for result in results:
        assert result["records"] == 1
        # Same ops, same order: only the all-reduce's summation differs.
        assert max(result["gaps"].values()) < 1e-6, result["gaps"]
    for name, w in results[0]["weights"].items():
        assert torch.equal(w, results[1]["weights"][name]), f"{name} not broadcast"


@pytest.mark.parametrize(
    "dtype, param_dtype, tol",
    [("bfloat16", None, 3e-2), ("float16", None, 5e-3), ("float32", "bfloat16", 3e-2)],
)
@pytest.mark.parametrize("strategy", ["zero3", pytest.param("rtp", marks=pytest.mark.slow)])
def test_low_precision_training(dtype, param_dtype, tol, strategy):
    result = run_ranks(dtype_training, 2, dtype, param_dtype, strategy)[0]
    compiled, eager, reference = result["compiled"], result["eager"], result["reference"]
    assert compiled["dtypes"] == [f"torch.{dtype}"], "shards must keep the model's dtype"
    # The compiled graph runs the eager IR's arithmetic op for op (rtp: the same
    # products, a shard's block of output columns at a time).
    for a, b in zip(compiled["losses"], eager["losses"], strict=True):
        assert abs(a - b) <= tol * abs(b) / 4, (compiled["losses"], eager["losses"])
    # And low precision tracks the float32 single-process run.
    for a, b in zip(compiled["losses"], reference["losses"], strict=True):
        assert abs(a - b) <= tol * abs(b), (compiled["losses"], reference["losses"])
    assert compiled["losses"][-1] < compiled["losses"][0]


def test_meta_device_model():
    results = run_ranks(meta_init, 2)
    assert all(r["finite"] and not r["meta"] for r in results)
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name]), name
