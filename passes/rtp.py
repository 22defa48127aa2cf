"""The `rtp` pass: uses of rotated weights become ring loops.

Requires: the dynamo graph (before aot_autograd, after `dedupe_unshard`), with
`zppc::unshard(..., mode="rtp")` for every rotated weight (`distribute` gives
that mode to the weights of `nn.Linear` and `nn.Embedding` modules; every other
parameter is replicated, mode "ddp").

Rewrites, for each rotated weight W = unshard(shard):
- `linear(x, W, b)` -> `zppc::rtp_linear(x, shard, b)`;
- `addmm(b, x, W)` (Hugging Face's Conv1D: W stored [in, out]) ->
  `zppc::rtp_addmm(x, shard, b)`;
- `embedding(indices, W, padding_idx)` (no max_norm, scale_grad_by_freq or
  sparse) -> `zppc::rtp_embedding(indices, shard, padding_idx)`;
- `multi_head_attention_forward(..., W, ...)` (dynamo keeps
  `nn.MultiheadAttention`'s functional as one call) -> `ring_attention`, the
  same functional with its `linear` calls on rotated weights routed to
  `zppc::rtp_linear` while aot_autograd traces it: the output projection, the
  separate query/key/value projections, and the packed input projection when
  query, key and value are one tensor (self-attention: one `linear` on W; the
  other paths slice W first, so W keeps its gather there).

Why rows for every layer: each rank applies every shard to its own micro-batch,
so a ring op ends with the layer's whole output for that micro-batch whichever
way the weight is split; splitting by output rows fills disjoint output
columns (no partial sums, no reshuffle before the next layer), and it is the
`Shard(0)` layout the parameter already has. An embedding split by rows
(vocabulary entries) shares that layout with a tied output head. A Conv1D
stores W transposed, so its rows are input features: there each step adds a
partial product into the output (still no reshuffle: the output is whole).

The ring ops carry their own autograd rules, so aot_autograd derives a backward that
re-rotates the weight rather than saving it. A use the pass does not know
(a slice of the weight, a custom matmul) keeps reading the gathered W: correct,
at zero3's memory for that weight. When every use is rewritten the gather goes.

The ring runs on the model's own ring group (`DistributedState.ring_group`).
With `Config.qwz` the ring ops quantize their weight hops (the `qwz` pass then
quantizes the gathers of the uses left unrewritten, so every use of a weight
sees the same dequantized values).

Guarantees: no `unshard` of a rotated weight remains for the rewritten uses;
the choice depends on the graph alone (the same on every rank).
Numerics: the same products summed in the same order per output element as
`F.linear` / `F.embedding` (each output column comes from one shard).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import zppc.runtime.rtp  # noqa: F401  (registers the ring ops)
from torch import fx
from zppc.kernels.quant import FORMAT_BITS
from zppc.passes.dedupe import UNSHARD_TARGETS

LINEAR_TARGETS = (torch._C._nn.linear, F.linear)
ADDMM_TARGETS = (torch.addmm,)
EMBEDDING_TARGETS = (F.embedding,)


@dataclass(frozen=True)
class RotatedUse:
    """One use of a rotated weight the pass rewrites."""

    node: fx.Node
    unshard: fx.Node
    kind: str
    """"linear", "addmm" or "embedding"."""
    data: fx.Node
    """The input (linear) or the indices (embedding)."""
    bias: fx.Node | None = None
    padding_idx: int = -1


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def match_use(user: fx.Node, unshard: fx.Node) -> RotatedUse | None:
    """The rewrite for `user` of the gathered weight `unshard`, if it has one."""
    if user.op != "call_function":
        return None
    shape = unshard.args[1]
    if user.target in LINEAR_TARGETS and len(shape) == 2:
        x, weight = _arg(user, 0, "input"), _arg(user, 1, "weight")
        bias = _arg(user, 2, "bias")
        if weight is unshard and x is not unshard and bias is not unshard:
            return RotatedUse(user, unshard, "linear", x, bias)
    if user.target in ADDMM_TARGETS and len(shape) == 2 and not user.kwargs:
        bias, x, weight = (_arg(user, i, "") for i in range(3))
        if len(user.args) == 3 and weight is unshard and unshard not in (x, bias):
            return RotatedUse(user, unshard, "addmm", x, bias)
    if user.target in EMBEDDING_TARGETS and len(shape) == 2:
        indices, weight = _arg(user, 0, "input"), _arg(user, 1, "weight")
        padding_idx = _arg(user, 2, "padding_idx")
        plain = (
            _arg(user, 3, "max_norm") is None
            and not _arg(user, 5, "scale_grad_by_freq", False)
            and not _arg(user, 6, "sparse", False)
        )
        if weight is unshard and indices is not unshard and plain:
            if padding_idx is None:
                padding_idx = -1
            elif padding_idx < 0:
                padding_idx += shape[0]
            return RotatedUse(user, unshard, "embedding", indices, padding_idx=padding_idx)
    return None


def find_rotated_uses(graph: fx.Graph) -> list[RotatedUse]:
    uses = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in UNSHARD_TARGETS:
            continue
        if node.args[3] != "rtp":
            continue
        uses.extend(filter(None, (match_use(user, node) for user in list(node.users))))
    return uses


ATTENTION_TARGETS = (F.multi_head_attention_forward,)
_ATTENTION_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


@dataclass(frozen=True)
class RotatedAttention:
    """A `multi_head_attention_forward` call whose projections the ring applies."""

    node: fx.Node
    arguments: dict
    """Its arguments by name."""
    weights: dict[str, fx.Node]
    """Argument name -> the `unshard` of the rotated weight passed there."""


def _rotated_unshard(value) -> bool:
    return (
        isinstance(value, fx.Node)
        and value.op == "call_function"
        and value.target in UNSHARD_TARGETS
        and value.args[3] == "rtp"
    )


def match_attention(node: fx.Node) -> RotatedAttention | None:
    """The projections of an attention call that go through one `linear` on
    the whole weight, where that weight is rotated."""
    if node.op != "call_function" or node.target not in ATTENTION_TARGETS:
        return None
    bound = _ATTENTION_SIGNATURE.bind(*node.args, **node.kwargs)
    arguments = dict(bound.arguments)
    names = ["out_proj_weight"]
    if arguments.get("use_separate_proj_weight", False):
        names += ["q_proj_weight", "k_proj_weight", "v_proj_weight"]
    elif arguments["query"] is arguments["key"] is arguments["value"]:
        names.append("in_proj_weight")
    weights = {name: arguments[name] for name in names if _rotated_unshard(arguments.get(name))}
    # A weight passed twice (or also as a bias) is read another way: leave it.
    others = [v for k, v in arguments.items() if k not in weights]
    weights = {k: w for k, w in weights.items() if w not in others}
    return RotatedAttention(node, arguments, weights) if weights else None


@contextlib.contextmanager
def _routed_linear(routes: dict[int, tuple]):
    """`torch.nn.functional.linear` calls on a stand-in weight (by identity)
    run the ring op instead; every other call is unchanged."""
    original = F.linear

    def linear(input, weight, bias=None):
        route = routes.get(id(weight))
        if route is None:
            return original(input, weight, bias)
        shard, ring_args = route
        return torch.ops.zppc.rtp_linear.default(input, shard, bias, *ring_args)

    F.linear = linear
    try:
        yield
    finally:
        F.linear = original


def ring_attention(zppc_rings: dict, **arguments):
    """`F.multi_head_attention_forward(**arguments)` with each weight named in
    `zppc_rings` (name -> (shard, ring op arguments)) applied by the ring: the
    functional gets a stand-in of the weight's shape on the meta device, and
    its `linear` on the stand-in runs `zppc::rtp_linear`. Any other use of a
    stand-in mixes devices and fails while tracing, never silently."""
    routes = {}
    for name, (shard, ring_args) in zppc_rings.items():
        stand_in = torch.empty(ring_args[0], dtype=ring_args[2] or shard.dtype, device="meta")
        arguments[name] = stand_in
        routes[id(stand_in)] = (shard, ring_args)
    with _routed_linear(routes):
        return F.multi_head_attention_forward(**arguments)


def _ring_args(unshard: fx.Node, ctx, qwz: tuple[int, int]) -> tuple[fx.Node, tuple]:
    """(the flat shard, the ring op's arguments after x, shard and bias)."""
    shard, shape, _world, _mode, param_dtype, reduce_dtype = unshard.args
    return shard, (list(shape), ctx.state.ring_group, param_dtype, reduce_dtype, *qwz)


def rtp_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    graph = gm.graph
    qwz = (FORMAT_BITS[ctx.config.qwz], ctx.config.qwz_block_size) if ctx.config.qwz else (0, 0)
    rewrites = []
    for use in find_rotated_uses(graph):
        shard, (shape, *ring_args) = _ring_args(use.unshard, ctx, qwz)
        if use.kind in ("linear", "addmm"):
            op = getattr(torch.ops.zppc, f"rtp_{use.kind}").default
            args = (use.data, shard, use.bias, shape)
        else:
            op, args = torch.ops.zppc.rtp_embedding.default, (use.data, shard, shape)
            ring_args.insert(3, use.padding_idx)  # after the dtypes, before qwz
        rewrites.append((use.node, op, (*args, *ring_args), {}))
    for attention in filter(None, map(match_attention, list(graph.nodes))):
        rings = {name: _ring_args(w, ctx, qwz) for name, w in attention.weights.items()}
        arguments = {k: v for k, v in attention.arguments.items() if k not in rings}
        rewrites.append((attention.node, ring_attention, (), {"zppc_rings": rings, **arguments}))
    for node, op, args, kwargs in rewrites:
        with graph.inserting_before(node):
            ring = graph.call_function(op, args, kwargs)
        ring.meta.update(node.meta)
        node.replace_all_uses_with(ring)
        graph.erase_node(node)
    for node in list(graph.nodes):
        if _rotated_unshard(node) and not node.users:
            graph.erase_node(node)
    return gm
