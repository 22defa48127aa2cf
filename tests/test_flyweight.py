"""Flyweight initialization: a meta-device model materialized shard by shard.

Every rank's shards equal the slices of what one process seeded like rank 0
builds on CPU, bit for bit, whatever each rank's own generator holds; the
model trains; rank 0's generator continues as that process's would. Memory:
distributing a meta model adds about 1/N of the model per rank (measured).
"""

import pytest
import torch
from flyweight_workers import distribute_peak, meta_equals_one_process
from spawn import run_ranks

from zppc import flyweight

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,chunk", [("zero3", 32), ("rtp", 48), ("ddp", flyweight.CHUNK)])
def test_meta_model_equals_one_process_built_on_cpu(strategy, chunk):
    per_rank = run_ranks(meta_equals_one_process, 4, "init_zoo", strategy, chunk, timeout=240)
    for rank, r in enumerate(per_rank):
        assert r["params"].keys() == r["reference"].keys()
        for name, value in r["params"].items():
            assert torch.equal(value, r["reference"][name]), f"rank {rank} {name}"
        for name, value in r["buffers"].items():
            assert torch.equal(value, r["reference_buffers"][name]), f"rank {rank} {name}"
        assert r["rng_continues"]
        assert r["losses"][-1] < r["losses"][0]
    assert per_rank[0]["params"]["emb.weight"][5].eq(0).all()  # the padding row


def test_chunks_keep_normal_blocks_whole():
    flyweight_chunks = flyweight._chunks
    for numel in (1, 15, 16, 17, 100, 1000, 2**20 + 3, 2**21 + 40):
        pieces = flyweight_chunks(numel)
        assert pieces[0][0] == 0 and pieces[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
        assert all((b - a) % 16 == 0 for a, b in pieces[:-1])
        assert len(pieces) == 1 or pieces[-1][1] - pieces[-1][0] >= 16


@pytest.mark.timeout(300)
def test_distributing_a_meta_model_adds_a_shard_not_a_layer():
    """Four 16 MiB layers at 4 ranks: flyweight adds the 16 MiB of shards and
    one chunk of draws (4 MiB); materializing layer by layer (the fallback)
    holds a whole layer besides."""
    width, layers, world = 2048, 4, 4
    flyweight_run = run_ranks(distribute_peak, world, width, layers, False, timeout=240)
    whole_run = run_ranks(distribute_peak, world, width, layers, True, timeout=240)
    layer = flyweight_run[0]["layer"]
    shards = layers * layer // world
    chunk = flyweight.CHUNK * 4
    slack = 2 * 2**20
    for f, w in zip(flyweight_run, whole_run, strict=True):
        assert f["added"] <= shards + chunk + slack, (f["added"], shards)
        assert w["added"] >= shards + layer, w["added"]
