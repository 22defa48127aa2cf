"""Scoped workarounds for Inductor behaviour that zppc's graphs trip on: a
miscompile, and compiled CPU kernels that hold the GIL.

Each one is a context manager entered around zppc's own `compile_fx_inner`
calls only, so other compiles in the process are untouched, and each states
the torch behaviour it corrects, so it can go once torch fixes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import sympy
from torch._inductor.codegen.cpp import CppScheduling
from torch.utils._sympy.functions import FloorDiv

_SPLITS_BELOW = 8
"""try_loop_split only splits on divisors above this (its own threshold)."""


def _split_would_drop_a_tail(nodes) -> bool:
    """True when some `x // d` in the nodes' indexing has an extent of `x` that
    is not a known multiple of `d`: the loop split Inductor would apply there
    replaces the extent N by (N // d) * d and leaves N % d outputs unwritten."""
    for node in nodes:
        _, body, _ = node.node.get_default_sizes_body()
        for expr in body.indexing_exprs.values():
            if not isinstance(expr, sympy.Expr):
                continue
            for div in expr.find(FloorDiv):
                var, divisor = div.args
                if var not in body.var_ranges or not isinstance(divisor, sympy.Integer):
                    continue
                if divisor > _SPLITS_BELOW and sympy.Mod(body.var_ranges[var], divisor) != 0:
                    return True
    return False


@contextlib.contextmanager
def cpu_loop_split_keeps_tails() -> Iterator[None]:
    """Inductor 2.13's CPU loop split (`CppScheduling.try_loop_split`) drops
    the last N % d iterations of a loop whose index holds `x // d` (pytorch
    issue 195582, unfixed in 2.13). zppc meets it wherever a value is scaled
    per block of an odd-sized shard (qwZ's dequantize: the last, partial
    block's outputs were never written). Inside this context the split is
    skipped for exactly those kernels; divisible ones still get it."""
    original = CppScheduling.try_loop_split

    def guarded(self, nodes):
        if _split_would_drop_a_tail(nodes):
            return nodes
        return original(self, nodes)

    with mock.patch.object(CppScheduling, "try_loop_split", guarded):
        yield


# The Python binding's call of a compiled CPU kernel, `kernel(<parsed args>)`,
# as a generic lambda: the arguments are parsed from their Python objects
# with the GIL held, then the kernel runs with it released (and retaken on
# the way out, an exception included), as an aten op's binding does. The
# outer `{}` takes Inductor's parsed arguments; doubled braces are literal.
_CALL_WITHOUT_THE_GIL = (
    "[](auto... parsed) {{ "
    "struct Released {{ PyThreadState* state = PyEval_SaveThread(); "
    "~Released() {{ PyEval_RestoreThread(state); }} }} released; "
    "kernel(parsed...); "
    "}}({}); Py_RETURN_NONE;"
)


@contextlib.contextmanager
def cpu_kernels_release_the_gil() -> Iterator[None]:
    """Inductor 2.13 calls each compiled CPU kernel from Python holding the
    GIL for the kernel's whole run (`CppPythonBindingsCodeCache`'s binding;
    an aten op releases it). zppc's chained collectives (two-hop ones, and
    gathers over a plain gloo group) issue their next hop and finish from
    Python callbacks on gloo's threads, so under
    Inductor a hop waited for whatever fused kernel the step was in (a
    probe here: another Python thread stalled 73 ms per call of one fused
    elementwise kernel, at most the 5 ms switch interval between aten ops).
    Inside this context the bindings Inductor generates release the GIL
    around the kernel; the kernels touch no Python object."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    with mock.patch.object(
        CppPythonBindingsCodeCache, "call_entry_function", _CALL_WITHOUT_THE_GIL
    ):
        yield
