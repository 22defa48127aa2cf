"""zppc's scoped Inductor workarounds: each fixes the miscompile it names and
leaves the optimization on where it is sound."""

import threading
import time

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.codegen.cpp import CppScheduling

import zppc
from zppc.inductor_fixes import (
    _CALL_WITHOUT_THE_GIL,
    cpu_kernels_release_the_gil,
    cpu_loop_split_keeps_tails,
)


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


def python_ticks_during_one_call(fn, x) -> tuple[int, float]:
    """How often another Python thread ran while one call of `fn(x)` ran,
    and the call's seconds: a thread can only run while the GIL is free."""
    ticks: list[float] = []
    stop, started = threading.Event(), threading.Event()

    def spin():
        started.set()
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    thread = threading.Thread(target=spin)
    thread.start()
    started.wait()
    start = time.perf_counter()
    fn(x)
    end = time.perf_counter()
    stop.set()
    thread.join()
    return sum(start < t < end for t in ticks), end - start


def fused_elementwise(t):
    return torch.nn.functional.gelu(t * 1.7 + 0.3).tanh() * t


def test_compiled_cpu_kernels_release_the_gil():
    """One fused kernel over 32M values (150-300 ms here): with the fix
    another Python thread (gloo's callbacks, in zppc's two-hop collectives)
    runs throughout it (about 140 times a call here); without, it waits for
    the kernel to return (about 10: the call's Python around the kernel).
    torch 2.13 still holds the GIL: if the last assertion starts failing,
    torch releases it itself and the fix can go."""
    x = torch.randn(32 * 2**20)
    held = torch.compile(fused_elementwise, backend="inductor", fullgraph=True)
    held(x)
    ticks_held, _ = python_ticks_during_one_call(held, x)
    torch._dynamo.reset()  # the next call compiles again, now inside the fix
    released = torch.compile(fused_elementwise, backend="inductor", fullgraph=True)
    with cpu_kernels_release_the_gil():
        torch.testing.assert_close(released(x), fused_elementwise(x))
    ticks_released, seconds = python_ticks_during_one_call(released, x)
    assert ticks_released >= 20, (ticks_released, seconds)
    assert ticks_held <= ticks_released / 5, (ticks_held, ticks_released)


@pytest.mark.parametrize("fake_rank", [0], indirect=True)
def test_zppc_compiles_its_cpu_kernels_without_the_gil(fake_rank, monkeypatch):
    """zppc's Inductor lowering generates every CPU kernel binding inside the
    fix, the backward's (compiled at the first backward) included."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    calls = []
    original = CppPythonBindingsCodeCache.load_pybinding_async.__func__

    def spy(cls, *args, **kwargs):
        calls.append(cls.call_entry_function)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(CppPythonBindingsCodeCache, "load_pybinding_async", classmethod(spy))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.GELU(), torch.nn.Linear(7, 5))
    config = zppc.Config(strategy="zero3", lowering="inductor", node_size=2)
    step = torch.compile(zppc.distribute(model, config), backend="zppc")
    step(torch.randn(3, 13)).square().sum().backward()
    assert calls and set(calls) == {_CALL_WITHOUT_THE_GIL}, calls
