"""zppc's scoped Inductor workarounds: each fixes the miscompile it names and
leaves the optimization on where it is sound."""

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.codegen.cpp import CppScheduling

from zppc.inductor_fixes import cpu_loop_split_keeps_tails


def scaled_per_block(n: int, block: int):
    """out[i] = q[i] * s[i // block]: qwZ's dequantize in its smallest form."""

    def f(q, s):
        return q.float() * s[torch.arange(n) // block]

    q = torch.randint(-100, 100, (n,), dtype=torch.int8)
    s = torch.rand(-(-n // block))
    return f, q, s


@pytest.fixture(autouse=True)
def fresh_compiles():
    """No cached kernels: the fix acts at code generation, which the FX graph
    cache would skip (zppc's backend keys that cache by its own sources, which
    these plain compiles do not carry)."""
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False):
        yield


def test_loop_split_keeps_the_partial_last_block():
    f, q, s = scaled_per_block(4099, 130)  # 31 whole blocks and 69 values
    with cpu_loop_split_keeps_tails():
        got = torch.compile(f, backend="inductor", fullgraph=True)(q, s)
    assert torch.equal(got, f(q, s))


def test_without_the_fix_inductor_drops_the_tail():
    """The bug is still in this torch: if this starts failing, torch fixed it
    and `cpu_loop_split_keeps_tails` can go."""
    f, q, s = scaled_per_block(4099, 130)
    got = torch.compile(f, backend="inductor", fullgraph=True)(q, s)
    assert not torch.equal(got[4030:], f(q, s)[4030:])


def test_divisible_extents_are_still_split(monkeypatch):
    calls = []
    original = CppScheduling.try_loop_split

    def spy(self, nodes):
        out = original(self, nodes)
        calls.append(any(len(n.group[1][0]) > 1 for n in out))
        return out

    monkeypatch.setattr(CppScheduling, "try_loop_split", spy)
    f, q, s = scaled_per_block(130 * 32, 130)
    with cpu_loop_split_keeps_tails():
        got = torch.compile(f, backend="inductor", fullgraph=True)(q, s)
    assert torch.equal(got, f(q, s))
    assert any(calls), "the split no longer ran on a divisible extent"
