"""Inductor's FX graph cache serves zppc's compiles, under a key of zppc's own.

A restarted job, or a second model of the same shapes, loads the code Inductor
generated before instead of generating it again (on this machine most of a
compile). The key is the graph zppc's passes produced plus a digest of zppc's
sources: code compiled by another version of zppc, or by a compile without
zppc's codegen fixes, is never reused.
"""

import pytest
import torch
import torch.distributed as dist
from models import OddMLP
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch.testing._internal.distributed.fake_pg import FakeStore

import zppc
import zppc.backend

pytestmark = pytest.mark.inductor


@pytest.fixture
def fake_world(tmp_path, monkeypatch):
    """A fresh cache directory."""
    if not inductor_config.fx_graph_cache:
        pytest.skip("TORCHINDUCTOR_FX_GRAPH_CACHE=0 turns the cache off in this environment")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    dist.destroy_process_group()


def compiled_step() -> tuple[dict[str, int], torch.Tensor, dict[str, torch.Tensor]]:
    """One compiled zero3 step of a padded MLP: (cache counters, loss, grads)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = zppc.distribute(OddMLP(), zppc.Config(strategy="zero3", lowering="inductor"))
    loss = torch.compile(model, backend="zppc")(*OddMLP.batch(0))
    loss.backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    cache = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    return cache, loss.detach(), grads


def test_a_second_compile_loads_the_first_ones_code(fake_world):
    first, loss, grads = compiled_step()
    assert first == {"fxgraph_cache_miss": 2}, first  # forward and backward
    again, loss_again, grads_again = compiled_step()
    assert again == {"fxgraph_cache_hit": 2}, again
    assert torch.equal(loss_again, loss)
    for name, grad in grads.items():
        assert torch.equal(grads_again[name], grad), name


def test_other_zppc_sources_never_reuse_the_code(fake_world, monkeypatch):
    compiled_step()
    monkeypatch.setattr(zppc.backend, "zppc_source_digest", lambda: "another zppc")
    after_a_change, _, _ = compiled_step()
    assert after_a_change == {"fxgraph_cache_miss": 2}, after_a_change
