"""Bad input fails fast and identically on every rank; nothing hangs."""

import pytest
from spawn import run_ranks
from workers import expect_error

import zppc

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


@pytest.mark.parametrize(
    "what, words",
    [
        ("node_size", ["ValueError", "node_size (5)", "world_size (4)"]),
        ("lstm", ["ValueError", "LSTM"]),
        ("twice", ["ValueError", "already"]),
        ("options", ["ValueError", "strategy"]),
    ],
)
def test_error_on_every_rank(what, words):
    results = run_ranks(expect_error, 4, what, timeout=120)
    for result in results:
        assert result["error"] is not None, f"{what}: no error raised"
        for word in words:
            assert word in result["error"]
        assert result["seconds"] < 30
    assert len({r["error"] for r in results}) == 1


def test_distribute_without_process_group_is_a_clear_error():
    import torch

    with pytest.raises(ValueError, match="process group"):
        zppc.distribute(torch.nn.Linear(2, 2), zppc.Config())
