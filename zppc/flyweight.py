"""Flyweight initialization: a meta-device module materialized shard by shard.

A single process initializes a module by running `reset_parameters()` on
full tensors, drawing from one random stream. Here every rank draws the same
stream (rank 0's generator state, broadcast once) and keeps only the values
of its own shard, so no rank ever holds a full weight and every rank's
shard equals the slice of what that single process would have produced.

How: `reset_parameters()` first runs on fake tensors (shapes only) while a
dispatch mode records every in-place op it applies to the module's own
tensors (`InitOp`). Replaying the record: a random fill (`uniform_`,
`normal_`) is drawn over the whole tensor in chunks (see `_chunks`: the CPU
kernels then consume the stream exactly as one call on the whole tensor
would), the chunks overlapping this rank's range are kept; an elementwise op
with scalar arguments (`fill_`, `mul_`, `erfinv_`, `clamp_`, ...) applies to
the kept values; a fill of one row (an embedding's padding row) applies if
the row is this rank's. Anything else (an op reading values, rejection
sampling, an op with tensor arguments, a write through another view) makes
the module fall back to a full materialization from the same stream: the
same values, at the memory of that module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

RANDOM_FILLS = {aten.uniform_.default, aten.normal_.default}
ELEMENTWISE = {
    aten.fill_.Scalar,
    aten.zero_.default,
    aten.mul_.Scalar,
    aten.div_.Scalar,
    aten.add_.Scalar,
    aten.sub_.Scalar,
    aten.erfinv_.default,
    aten.clamp_.default,
    aten.abs_.default,
    aten.neg_.default,
}
ROW_WRITES = {aten.fill_.Scalar, aten.zero_.default}
CHUNK = 1 << 20
"""Elements drawn at a time (a multiple of 16)."""


class Unsupported(Exception):
    """The initialization does something the replay cannot reproduce."""


@dataclass(frozen=True)
class InitOp:
    """One recorded in-place op on a module's own tensor."""

    name: str
    """The tensor's attribute name on the module."""
    op: torch._ops.OpOverload
    args: tuple
    """The op's arguments after the tensor (scalars only)."""
    kwargs: dict
    row: int | None = None
    """Set when the op writes one row (dim 0) of the tensor only."""


class _Recorder(TorchDispatchMode):
    """Records in-place ops on the fake stand-ins of a module's own tensors."""

    def __init__(self, stand_ins: dict[str, Tensor]):
        super().__init__()
        self.by_storage = {t.untyped_storage()._cdata: (name, t) for name, t in stand_ins.items()}
        self.ops: list[InitOp] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            target = args[i] if i < len(args) else kwargs.get(argument.name)
            if isinstance(target, Tensor):
                self._record(func, target, args, kwargs, i)
        return func(*args, **kwargs)

    def _record(self, func, target: Tensor, args, kwargs, position: int) -> None:
        owner = self.by_storage.get(target.untyped_storage()._cdata)
        if owner is None:
            return  # a temporary of the initialization's own
        name, whole = owner
        rest = args[position + 1 :]
        if position != 0 or any(isinstance(a, Tensor) for a in (*rest, *kwargs.values())):
            raise Unsupported(f"{func} writes {name} with tensor arguments")
        kwargs = {k: v for k, v in kwargs.items() if k != "generator" or v is not None}
        if "generator" in kwargs:
            raise Unsupported(f"{func} on {name} draws from its own generator")
        geometry = (tuple(target.shape), target.stride(), target.storage_offset())
        if geometry == (tuple(whole.shape), whole.stride(), whole.storage_offset()):
            if func not in RANDOM_FILLS | ELEMENTWISE:
                raise Unsupported(f"{func} on {name}")
            self.ops.append(InitOp(name, func, tuple(rest), kwargs))
            return
        row_stride = whole.stride()[0] if whole.dim() else 0
        is_row = (
            whole.dim() >= 1
            and whole.is_contiguous()
            and tuple(target.shape) == tuple(whole.shape[1:])
            and target.is_contiguous()
            and row_stride
            and target.storage_offset() % row_stride == 0
        )
        if not is_row or func not in ROW_WRITES:
            raise Unsupported(f"{func} on part of {name}")
        self.ops.append(
            InitOp(name, func, tuple(rest), kwargs, target.storage_offset() // row_stride)
        )


def record_init(module: nn.Module, names: list[str]) -> list[InitOp]:
    """The in-place ops `module.reset_parameters()` applies to its own
    tensors `names`, in order (raises `Unsupported` if the replay cannot
    reproduce them)."""
    originals = {name: getattr(module, name) for name in names}
    fake_mode = FakeTensorMode()
    with fake_mode:
        stand_ins = {
            name: torch.empty(t.shape, dtype=t.dtype, device="cpu") for name, t in originals.items()
        }
    try:
        for name, stand_in in stand_ins.items():
            _set(module, name, stand_in, originals[name])
        recorder = _Recorder(stand_ins)
        try:
            with fake_mode, recorder, torch.no_grad():
                module.reset_parameters()
        except Unsupported:
            raise
        except Exception as exc:  # reads values, data-dependent control flow, ...
            raise Unsupported(f"{type(exc).__name__}: {exc}") from exc
    finally:
        for name, original in originals.items():
            _set(module, name, original, original)
    return recorder.ops


def _set(module: nn.Module, name: str, value: Tensor, like: Tensor) -> None:
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(value, requires_grad=like.requires_grad)
    else:
        module._buffers[name] = value


def _chunks(numel: int) -> list[tuple[int, int]]:
    """[start, end) pieces of a tensor to draw in order. Pieces are multiples
    of 16 elements, and the last is never shorter than 16 (a remainder joins
    the piece before): the CPU `normal_` kernel works in blocks of 16 and
    redraws a tensor's last 16 values when its size is not a multiple of 16,
    and a tensor under 16 takes another path, so only such pieces consume
    the stream as one call on the whole tensor does (`uniform_` is
    element by element)."""
    bounds = list(range(0, numel, CHUNK)) + [numel]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < 16:
        del bounds[-2]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def replay(
    ops: list[InitOp],
    tensors: dict[str, tuple[torch.Size, torch.dtype, int, int]],
    generator: torch.Generator,
) -> dict[str, Tensor]:
    """Run the recorded ops for `tensors` (name -> (shape, dtype, start, end):
    the flat range of the tensor to keep), drawing from `generator`; returns
    the kept values, flat, per name."""
    kept = {
        name: torch.zeros(end - start, dtype=dtype)
        for name, (_shape, dtype, start, end) in tensors.items()
    }
    for op in ops:
        shape, dtype, start, end = tensors[op.name]
        values = kept[op.name]
        if op.row is not None:
            row_numel = values.new_empty(shape[1:]).numel()
            lo, hi = op.row * row_numel - start, (op.row + 1) * row_numel - start
            if 0 <= lo and hi <= values.numel():
                op.op(values[lo:hi], *op.args, **op.kwargs)
        elif op.op in RANDOM_FILLS:
            numel = torch.Size(shape).numel()
            for a, b in _chunks(numel):
                piece = torch.empty(b - a, dtype=dtype)
                op.op(piece, *op.args, **op.kwargs, generator=generator)
                lo, hi = max(a, start), min(b, end)
                if lo < hi:
                    values[lo - start : hi - start] = piece[lo - a : hi - a]
        else:
            op.op(values, *op.args, **op.kwargs)
    return kept
