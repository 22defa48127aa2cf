"""Bad input fails fast and identically on every rank; nothing hangs."""

import pytest
from spawn import run_ranks
from workers import expect_error, mismatched_setup

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


@pytest.mark.parametrize(
    "kind, words",
    [
        ("strategy", ["Config.strategy", "'zero3' on ranks [0, 1]", "'ddp' on ranks [2, 3]"]),
        ("node_size", ["Config.node_size", "4 on ranks [0]", "2 on ranks [1, 2, 3]"]),
        ("qwz", ["Config.qwz", "'int8' on ranks [0, 1]", "None on ranks [2, 3]"]),
        ("model", ["model structure", "on ranks [0, 1, 2]", "on ranks [3]"]),
    ],
)
def test_ranks_that_disagree_are_named_on_every_rank(kind, words):
    """Without the check these hang (strategy, node_size) or abort inside gloo."""
    results = run_ranks(mismatched_setup, 4, kind, timeout=120)
    for result in results:
        assert result["error"] is not None, f"{kind}: no error raised"
        assert "ranks disagree" in result["error"]
        for word in words:
            assert word in result["error"], result["error"]
        assert result["seconds"] < 30
    assert len({r["error"] for r in results}) == 1
