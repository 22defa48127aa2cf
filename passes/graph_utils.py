"""Small helpers shared by the passes: matching the IR ops, inserting nodes with
current fake values, and summarizing what a pass changed."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import partial

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_map_only

import zppc.ir  # noqa: F401  (registers the ops matched below)
from zppc.config import qualified_name

UNSHARD = torch.ops.zppc.unshard.default
REDUCE_GRAD = torch.ops.zppc.reduce_grad.default
SECONDARY_SHARD = torch.ops.zppc.secondary_shard.default
UNSHARD_SECONDARY = torch.ops.zppc.unshard_secondary.default


def lowers_to_triton_kernels(val: torch.Tensor) -> bool:
    """Whether a pass lowers quantization to zppc's Triton custom ops (one node
    each) rather than inlining the torch reference's aten ops for Inductor.

    On CUDA, and in a plan (`zppc.passes.planning()`, tensors on meta) unless
    it asks for the CPU's torch kernels: a plan describes a GPU cluster by
    default, so it builds the graph a GPU compile would. The payloads, and so
    the bytes on the wire, are the same either way."""
    from zppc.passes import planned_kernels

    return val.device.type == "cuda" or (
        val.device.type == "meta" and planned_kernels() == "triton"
    )


@dataclass(frozen=True)
class UnshardMatch:
    """One `zppc::unshard` node and its arguments."""

    node: fx.Node
    shard: fx.Node
    shape: tuple[int, ...]
    group_name: str
    mode: str
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ReduceGradMatch:
    """One `zppc::reduce_grad` node and its arguments."""

    node: fx.Node
    grad: fx.Node
    shard_numel: int
    group_name: str
    mode: str
    reduce_dtype: torch.dtype | None
    out_dtype: torch.dtype


def find_unshards(graph: fx.Graph) -> list[UnshardMatch]:
    return [
        UnshardMatch(n, n.args[0], tuple(n.args[1]), *n.args[2:6])
        for n in graph.find_nodes(op="call_function", target=UNSHARD)
    ]


def find_reduce_grads(graph: fx.Graph) -> list[ReduceGradMatch]:
    return [
        ReduceGradMatch(n, *n.args[:6])
        for n in graph.find_nodes(op="call_function", target=REDUCE_GRAD)
    ]


def block_unit(node: fx.Node, block_classes: frozenset[str]) -> str | None:
    """The repeated block (its path in dynamo's module stack, e.g.
    "L['self'].blocks[3]") whose forward uses the parameter an IR node gathers
    or reduces, the outermost one if they nest; None outside every block.
    A backward node reads the stack of the forward node it came from."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    for path, cls in stack.values():
        if qualified_name(cls) in block_classes:
            return path
    return None


def node_value(node: fx.Node):
    return node.meta.get("val", node.meta.get("example_value"))


FAKE_MODE_META = "zppc_fake_mode"
"""Where GraphBuilder keeps a graph's fake mode while the passes run."""


class GraphBuilder:
    """Inserts call_function nodes before an anchor, filling `meta["val"]` by
    running each op on the fake values of its inputs."""

    def __init__(self, gm: fx.GraphModule, anchor: fx.Node):
        self.graph = gm.graph
        self.anchor = anchor
        # Found once per graph: a scan per builder made passes quadratic.
        if FAKE_MODE_META not in gm.meta:
            vals = [node_value(n) for n in gm.graph.nodes]
            gm.meta[FAKE_MODE_META] = detect_fake_mode(
                [v for v in vals if isinstance(v, torch.Tensor)]
            )
        self.fake_mode = gm.meta[FAKE_MODE_META]

    def call(self, target, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        if isinstance(target, torch._ops.OpOverload) and not target._schema.returns:
            return node  # nothing to describe (the ledger hook): skip running it on fakes
        fake_args, fake_kwargs = tree_map_only(fx.Node, node_value, (args, kwargs))
        key = _call_key(target, fake_args, fake_kwargs, self.fake_mode)
        if key in _OUTPUTS:
            node.meta["val"] = _fresh_like(_OUTPUTS[key], self.fake_mode)
        else:
            with self.fake_mode:
                node.meta["val"] = target(*fake_args, **fake_kwargs)
            if key is not None:
                _remember(_OUTPUTS, key, node.meta["val"])
        if isinstance(self.anchor.meta.get("stack_trace"), str):
            node.meta["stack_trace"] = self.anchor.meta["stack_trace"]
        return node

    def inline(self, fn, *inputs: fx.Node) -> fx.Node:
        """Insert the aten ops of `fn(*inputs)`, traced on the inputs' fake
        values, instead of one opaque call: the compiler sees them and can fuse
        them with their neighbours. A trace is reused for inputs of the same
        shapes and dtypes (identical layers' buckets), and the copied nodes get
        fake values of their own."""
        traced, reusable = _traced(fn, [node_value(n) for n in inputs], self.fake_mode)
        placeholders = traced.find_nodes(op="placeholder")
        copied = dict(zip(placeholders, inputs, strict=True))
        with self.graph.inserting_before(self.anchor):
            out = self.graph.graph_copy(traced, copied)
        for original in traced.nodes:
            node = copied.get(original)
            if original.op != "call_function" or node is None:
                continue
            # A cached trace ran the same ops on inputs of the same metadata:
            # its values give each copy's metadata, and only storage (new, or
            # the base's for a view) must be the copy's own. Running the ops on
            # fakes again costs ~10x more, and a 40-layer plan inlines tens of
            # thousands of them.
            val = _value_from_trace(original, copied, self.fake_mode) if reusable else None
            if val is not None:
                node.meta["val"] = val
                continue
            fake_args, fake_kwargs = tree_map_only(fx.Node, node_value, (node.args, node.kwargs))
            with self.fake_mode:
                node.meta["val"] = node.target(*fake_args, **fake_kwargs)
        return out


def _value_from_trace(original: fx.Node, copied: dict, fake_mode) -> torch.Tensor | None:
    """The fake value of `original`'s copy, from `original`'s: a tensor of the
    same metadata on storage of its own, or, for a plain view op (one returned
    tensor aliasing its first argument), on its base's copy's storage at the
    same offset from it. None where the op must run (several or no returned
    tensors, mutation, symbolic sizes)."""
    target, like = original.target, original.meta.get("val")
    if not isinstance(target, torch._ops.OpOverload) or not isinstance(like, torch.Tensor):
        return None
    schema = target._schema
    if len(schema.returns) != 1 or schema.is_mutable:
        return None
    if not all(isinstance(d, int) for d in (*like.shape, *like.stride(), like.storage_offset())):
        return None
    returned = schema.returns[0].alias_info
    if returned is None:
        return _fresh_like(like, fake_mode)
    first = schema.arguments[0].alias_info if schema.arguments else None
    base = original.args[0] if original.args else None
    if first is None or returned.before_set != first.before_set:
        return None
    if not isinstance(base, fx.Node) or base not in copied:
        return None
    traced_base, copy_base = base.meta.get("val"), node_value(copied[base])
    if not isinstance(traced_base, torch.Tensor) or not isinstance(copy_base, torch.Tensor):
        return None
    offset = copy_base.storage_offset() + like.storage_offset() - traced_base.storage_offset()
    with no_dispatch():
        meta = torch.empty(0, dtype=like.dtype, device="meta")
        meta.set_(copy_base.untyped_storage(), offset, like.shape, like.stride())
    return FakeTensor(fake_mode, meta, like.device)


def _fresh_like(like: torch.Tensor, fake_mode) -> FakeTensor:
    """A fake tensor of `like`'s metadata on storage of its own. Made below the
    dispatcher's modes: passes run inside the compile's fake mode, and a meta
    tensor made through it costs ~8x more."""
    with no_dispatch():
        meta = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device="meta")
    return FakeTensor(fake_mode, meta, like.device)


# (op, its arguments' metadata, fake mode) -> the fake value it returned.
_OUTPUTS: dict[tuple, torch.Tensor] = {}


def _call_key(target, args: tuple, kwargs: dict, fake_mode) -> tuple | None:
    """What the fake value of an op that FakeTensorMode does not cache depends
    on: zppc's custom ops and the functional collectives (non-aten ops, which
    it always reruns; a 40-layer plan calls them thousands of times), when the
    op returns one new tensor. None for every other op, and for symbolic
    sizes or unhashable arguments."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace in ("aten", "prims"):
        return None
    schema = target._schema
    if len(schema.returns) != 1 or schema.returns[0].alias_info is not None or schema.is_mutable:
        return None

    def describe(value):
        if isinstance(value, torch.Tensor):
            described = _tensor_key(value)
            if described is None:
                raise TypeError("symbolic size")
            return described
        if isinstance(value, (list, tuple)):
            return ("seq", *map(describe, value))
        return value

    try:
        key = (target, describe(args), describe(sorted(kwargs.items())), id(fake_mode))
        hash(key)
    except TypeError:
        return None
    return key


# (function, input shapes and dtypes, fake mode) -> its traced graph.
_TRACES: dict[tuple, fx.Graph] = {}


def _traced(fn, fakes: list, fake_mode) -> tuple[fx.Graph, bool]:
    """`fn` traced to aten ops on `fakes`, decomposed as aot_autograd
    decomposed the rest of the graph for Inductor; and whether the trace's
    fake values describe any inputs of the same metadata (a cached trace)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    key = _trace_key(fn, fakes, fake_mode)
    if key is None or key not in _TRACES:
        with fake_mode:
            graph = make_fx(fn, decomposition_table=select_decomp_table())(*fakes).graph
        if key is None:
            return graph, False
        _remember(_TRACES, key, graph)
    return _TRACES[key], True


def _trace_key(fn, fakes: list, fake_mode) -> tuple | None:
    """What a trace depends on, or None when it cannot be reused (symbolic
    sizes, or a function that is not a plain function or partial of one)."""
    if isinstance(fn, partial):
        target, bound = fn.func, (fn.args, tuple(sorted(fn.keywords.items())))
    else:
        target, bound = fn, ()
    if not callable(target) or getattr(target, "__closure__", None):
        return None
    inputs = [_tensor_key(t) for t in fakes]
    if None in inputs:
        return None
    try:
        key = (target, bound, tuple(inputs), id(fake_mode))
        hash(key)
    except TypeError:
        return None
    return key


def _tensor_key(t: torch.Tensor) -> tuple | None:
    """A tensor's metadata as a cache key part; None for symbolic sizes."""
    shape, stride = tuple(t.shape), tuple(t.stride())
    if not all(isinstance(d, int) for d in (*shape, *stride)):
        return None
    return (shape, stride, t.dtype, t.device)


def _remember(cache: dict, key: tuple, value) -> None:
    """Store in one of the bounded per-process caches (cleared when full)."""
    if len(cache) >= 4096:
        cache.clear()
    cache[key] = value


def replace_node(old: fx.Node, new: fx.Node) -> None:
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


def op_census(graph: fx.Graph) -> Counter:
    """How many nodes call each target: the basis of pass-change logs."""
    return Counter(
        getattr(n.target, "__name__", str(n.target)) for n in graph.nodes if n.op == "call_function"
    )
