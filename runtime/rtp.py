"""RTP's ring: rotated weight shards applied to each rank's own micro-batch.

Each rank holds rows [r*R, (r+1)*R) of a rotated weight (its flat shard, the
same `Shard(0)` layout as zero3). A ring step sends the shard in hand to the
previous rank and receives the next rank's, so at step s rank r holds shard
(r + s) % N; after N steps every rank has applied every shard to its own data
and no rank ever held more than two shards of the layer (the one computing and
the one arriving: double buffering, the transfer overlapping the matmul).

- `rtp_linear`: `F.linear` with the weight's rows split, each step filling the
  output columns of the shard in hand (no partial sums, no reshuffle).
- `rtp_embedding`: the rows are vocabulary entries; each step looks up the
  indices that fall in the shard in hand.
- `rtp_addmm`: `bias + x @ W` with W stored [in, out] (Hugging Face's Conv1D),
  its rows the input features: each step adds the shard's partial product.
- Backward re-rotates the weights (nothing but this rank's shard and the input
  is saved) and sends each shard's gradient partial sum along with it, each
  rank adding its own; one last hop brings the sum to the shard's owner, which
  divides by N (gradients are means over ranks, like DDP's).

With qwZ (`Config(qwz="int8"|"int4")`) the weights travel as one quantized
payload per shard (block scales and values, `zppc.kernels.quant`), quantized
once by the owner and passed on unchanged; every rank, the owner included,
applies the dequantized weights, so all ranks use the same ones, and backward
re-rotates the same payloads. Gradient partial sums travel unquantized.

Every transfer is counted in the ledger as `send_recv` bytes from the peer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula
from zppc.kernels import quant
from zppc.runtime.failures import naming_failures, wait_for
from zppc.runtime.ledger import record_ring
from zppc.runtime.topology import group_ranks

_GROUP_FROM_NAME = dist.distributed_c10d._resolve_process_group


class Ring:
    """This rank's place in the ring over a group: it sends to the previous
    rank and receives from the next."""

    def __init__(self, group_name: str):
        self.group_name = group_name
        self.group = _GROUP_FROM_NAME(group_name)
        self.size = self.group.size()
        self.rank = dist.get_rank(self.group)
        self.to = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        self.source = dist.get_global_rank(self.group, (self.rank + 1) % self.size)

    def pass_on(self, send: Tensor, recv: Tensor) -> list:
        """Start sending `send` to the previous rank and receiving the next
        rank's into `recv`; returns the works to wait on."""
        ops = [
            dist.P2POp(dist.isend, send, self.to, self.group),
            dist.P2POp(dist.irecv, recv, self.source, self.group),
        ]
        with naming_failures(f"an RTP ring step over ranks {group_ranks(self.group_name)}"):
            works = dist.batch_isend_irecv(ops)
        record_ring("send_recv", self.group_name, recv.numel() * recv.element_size())
        return works

    def wait(self, works: list) -> None:
        wait_for(works, f"an RTP ring step over ranks {group_ranks(self.group_name)}")


def _identity(tensor: Tensor) -> Tensor:
    return tensor


def _rotate(
    shard: Tensor,
    ring: Ring,
    visit: Callable[[int, Tensor], None],
    read: Callable[[Tensor], Tensor] = _identity,
) -> None:
    """Call `visit(j, read(shard_j))` for every shard j of the ring, starting
    with this rank's own and receiving the next while the current one is
    visited (`read` turns what travels into the weights: a qwZ payload's
    dequantization)."""
    own = shard.contiguous()
    current, arriving = own, torch.empty_like(own)
    for step in range(ring.size):
        works = ring.pass_on(current, arriving) if step < ring.size - 1 else []
        visit((ring.rank + step) % ring.size, read(current))
        ring.wait(works)
        # The shard in hand becomes the next receive buffer, except this rank's
        # own, which is the parameter's storage.
        spare = current if current is not own else torch.empty_like(own)
        current, arriving = arriving, spare


def _ring_reduce(
    ring: Ring,
    shape: tuple[int, ...],
    acc_dtype: torch.dtype,
    device: torch.device,
    partial: Callable[[int, Tensor | None], Tensor],
    weight: Tensor | None = None,
    read: Callable[[Tensor], Tensor] = _identity,
) -> Tensor:
    """Sum over ranks, for every shard j, of `partial(j, shard_j)` (each rank's
    gradient contribution of `shape`), rotating `weight` as `_rotate` does when
    the contributions need it: the running sum of shard j travels with it, each
    rank adding its own, and a last hop delivers it to its owner. Returns the
    sum for this rank's own shard."""
    if ring.size == 1:  # a world of one: nothing travels
        return partial(ring.rank, None if weight is None else read(weight)).to(acc_dtype)
    incoming = torch.empty(shape, dtype=acc_dtype, device=device)
    pending: list = []
    total: Tensor | None = None

    def visit(j: int, w: Tensor | None) -> None:
        nonlocal pending, total
        mine = partial(j, w).to(acc_dtype)
        ring.wait(pending)  # the running sum of shard j, from the next rank
        total = mine if total is None else mine.add_(incoming)
        pending = ring.pass_on(total, incoming)

    if weight is None:
        for step in range(ring.size):
            visit((ring.rank + step) % ring.size, None)
    else:
        _rotate(weight, ring, visit, read)
    ring.wait(pending)
    return incoming


def _rows(shard: Tensor, shape: list[int], param_dtype: torch.dtype | None) -> Tensor:
    """The flat shard as its [R, ...] block of rows, in the compute dtype."""
    rows = shard.view(-1, *shape[1:])
    return rows if param_dtype is None else rows.to(param_dtype)


def _travelling(
    shard: Tensor, shape: list[int], param_dtype: torch.dtype | None, qwz_bits: int, qwz_block: int
) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """(what travels for this rank's shard, how a rank reads it back as rows):
    the rows themselves, or with qwZ one quantized payload that every rank
    dequantizes, the owner too."""
    rows = _rows(shard, shape, param_dtype)
    if not qwz_bits:
        return rows, _identity
    payload = quant.quantize_pack(rows.reshape(-1), qwz_block, qwz_bits)

    def read(travelled: Tensor) -> Tensor:
        values = quant.unpack_dequantize(
            travelled, 1, rows.numel(), qwz_block, qwz_bits, rows.dtype
        )
        return values.view(rows.shape)

    return payload, read


@torch.library.custom_op("zppc::rtp_linear", mutates_args=())
def rtp_linear(
    x: Tensor,
    shard: Tensor,
    bias: Tensor | None,
    shape: list[int],
    group_name: str,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    qwz_bits: int,
    qwz_block: int,
) -> Tensor:
    """`F.linear(x, W, bias)` with W of `shape` split by rows over the ring
    (`qwz_bits` 8 or 4: quantized hops in blocks of `qwz_block`; 0: exact)."""
    ring = Ring(group_name)
    travel, read = _travelling(shard, shape, param_dtype, qwz_bits, qwz_block)
    rows = shard.numel() // shape[1]
    out = x.new_empty(*x.shape[:-1], rows * ring.size)

    def visit(j: int, w: Tensor) -> None:
        torch.matmul(x, w.t(), out=out[..., j * rows : (j + 1) * rows])

    _rotate(travel, ring, visit, read)
    out = out[..., : shape[0]]
    return out + bias if bias is not None else out.contiguous()


@rtp_linear.register_fake
def _(x, shard, bias, shape, group_name, param_dtype, reduce_dtype, qwz_bits, qwz_block):
    return x.new_empty(*x.shape[:-1], shape[0])


@torch.library.custom_op("zppc::rtp_linear_backward", mutates_args=())
def rtp_linear_backward(
    grad: Tensor,
    x: Tensor,
    shard: Tensor,
    shape: list[int],
    group_name: str,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    need_x: bool,
    need_weight: bool,
    qwz_bits: int,
    qwz_block: int,
) -> tuple[Tensor, Tensor]:
    """(grad of x, this rank's flat shard of the weight gradient averaged over
    ranks); what is not needed comes back as zeros without its ring traffic
    (a frozen weight sends no partial sums; a first layer's weight gradient
    needs no weight, so the weights stay put)."""
    ring = Ring(group_name)
    rows = shard.numel() // shape[1]
    padded = torch.nn.functional.pad(grad, (0, rows * ring.size - shape[0]))
    grad_x = torch.zeros_like(x)
    flat_x = x.reshape(-1, shape[1])

    def columns(j: int) -> Tensor:
        return padded[..., j * rows : (j + 1) * rows]

    def add_grad_x(j: int, w: Tensor) -> None:
        grad_x.add_(torch.matmul(columns(j), w))

    def weight_part(j: int) -> Tensor:
        return columns(j).reshape(-1, rows).t() @ flat_x

    grad_shard = _ring_backward(
        ring, shard, shape, (param_dtype, reduce_dtype, qwz_bits, qwz_block), need_x,
        need_weight, add_grad_x, weight_part,
    )  # fmt: skip
    return grad_x, grad_shard


def _ring_backward(
    ring: Ring,
    shard: Tensor,
    shape: list[int],
    dtypes_and_qwz: tuple,
    need_x: bool,
    need_weight: bool,
    add_grad_x: Callable[[int, Tensor], None],
    weight_part: Callable[[int], Tensor],
) -> Tensor:
    """The ring of a matmul's backward: re-rotate the weight for
    `add_grad_x(j, shard_j)` when the input needs a gradient, and reduce
    `weight_part(j)` (this rank's contribution to shard j's gradient) onto
    each owner when the weight does; returns this rank's flat gradient shard,
    averaged over ranks (zeros when not needed)."""
    param_dtype, reduce_dtype, qwz_bits, qwz_block = dtypes_and_qwz
    travel, read = _travelling(shard, shape, param_dtype, qwz_bits, qwz_block)
    if not need_weight:
        if need_x:
            _rotate(travel, ring, add_grad_x, read)
        return torch.zeros_like(shard)

    def partial(j: int, w: Tensor | None) -> Tensor:
        if w is not None:
            add_grad_x(j, w)
        return weight_part(j)

    rows = shard.numel() // shape[1]
    acc_dtype = reduce_dtype or param_dtype or shard.dtype
    weight = travel if need_x else None
    total = _ring_reduce(ring, (rows, shape[1]), acc_dtype, shard.device, partial, weight, read)
    return (total / ring.size).to(shard.dtype).reshape(-1)


@rtp_linear_backward.register_fake
def _(
    grad, x, shard, shape, group_name, param_dtype, reduce_dtype, need_x, need_weight, qwz_bits,
    qwz_block,
):  # fmt: skip
    return torch.empty_like(x), torch.empty_like(shard)


def _linear_setup(ctx, inputs, output) -> None:
    x, shard, bias, shape, group_name, param_dtype, reduce_dtype, qwz_bits, qwz_block = inputs
    ctx.save_for_backward(x, shard)
    ctx.args = (shape, group_name, param_dtype, reduce_dtype)
    ctx.qwz = (qwz_bits, qwz_block)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _linear_backward(ctx, grad: Tensor):
    x, shard = ctx.saved_tensors
    need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
    grad_x, grad_shard = torch.ops.zppc.rtp_linear_backward(
        grad, x, shard, *ctx.args, need_x, need_weight, *ctx.qwz
    )
    grad_bias = None
    if need_bias:
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
    return (
        grad_x if need_x else None,
        grad_shard if need_weight else None,
        grad_bias,
        *[None] * 6,
    )


rtp_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


@torch.library.custom_op("zppc::rtp_addmm", mutates_args=())
def rtp_addmm(
    x: Tensor,
    shard: Tensor,
    bias: Tensor | None,
    shape: list[int],
    group_name: str,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    qwz_bits: int,
    qwz_block: int,
) -> Tensor:
    """`bias + x @ W` (Hugging Face's Conv1D) for a 2-D `x`, with W of `shape`
    [in, out] split by rows, that is by input features: each step adds the
    product of the shard in hand with its columns of x."""
    ring = Ring(group_name)
    travel, read = _travelling(shard, shape, param_dtype, qwz_bits, qwz_block)
    rows = shard.numel() // shape[1]
    padded = torch.nn.functional.pad(x, (0, rows * ring.size - shape[0]))
    out = x.new_zeros(x.shape[0], shape[1])

    def visit(j: int, w: Tensor) -> None:
        out.addmm_(padded[:, j * rows : (j + 1) * rows], w)

    _rotate(travel, ring, visit, read)
    return out + bias if bias is not None else out


@rtp_addmm.register_fake
def _(x, shard, bias, shape, group_name, param_dtype, reduce_dtype, qwz_bits, qwz_block):
    return x.new_empty(x.shape[0], shape[1])


@torch.library.custom_op("zppc::rtp_addmm_backward", mutates_args=())
def rtp_addmm_backward(
    grad: Tensor,
    x: Tensor,
    shard: Tensor,
    shape: list[int],
    group_name: str,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    need_x: bool,
    need_weight: bool,
    qwz_bits: int,
    qwz_block: int,
) -> tuple[Tensor, Tensor]:
    """(grad of x, this rank's flat shard of the weight gradient averaged over
    ranks) for `rtp_addmm`: shard j fills x's gradient columns of its input
    features, and its gradient is x's columns times the output gradient."""
    ring = Ring(group_name)
    rows = shard.numel() // shape[1]
    width = rows * ring.size
    padded_x = torch.nn.functional.pad(x, (0, width - shape[0]))
    grad_x = x.new_zeros(x.shape[0], width)

    def add_grad_x(j: int, w: Tensor) -> None:
        torch.matmul(grad, w.t(), out=grad_x[:, j * rows : (j + 1) * rows])

    def weight_part(j: int) -> Tensor:
        return padded_x[:, j * rows : (j + 1) * rows].t() @ grad

    grad_shard = _ring_backward(
        ring, shard, shape, (param_dtype, reduce_dtype, qwz_bits, qwz_block), need_x,
        need_weight, add_grad_x, weight_part,
    )  # fmt: skip
    return grad_x[:, : shape[0]].contiguous(), grad_shard


@rtp_addmm_backward.register_fake
def _(
    grad, x, shard, shape, group_name, param_dtype, reduce_dtype, need_x, need_weight, qwz_bits,
    qwz_block,
):  # fmt: skip
    return torch.empty_like(x), torch.empty_like(shard)


def _addmm_backward(ctx, grad: Tensor):
    x, shard = ctx.saved_tensors
    need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
    grad_x, grad_shard = torch.ops.zppc.rtp_addmm_backward(
        grad, x, shard, *ctx.args, need_x, need_weight, *ctx.qwz
    )
    grad_bias = grad.sum(0).to(ctx.bias_dtype) if need_bias else None
    return (
        grad_x if need_x else None,
        grad_shard if need_weight else None,
        grad_bias,
        *[None] * 6,
    )


rtp_addmm.register_autograd(_addmm_backward, setup_context=_linear_setup)


def _in_shard(indices: Tensor, j: int, rows: int) -> tuple[Tensor, Tensor]:
    """(mask of the indices in shard j, their row within it)."""
    local = indices - j * rows
    return (local >= 0) & (local < rows), local


@torch.library.custom_op("zppc::rtp_embedding", mutates_args=())
def rtp_embedding(
    indices: Tensor,
    shard: Tensor,
    shape: list[int],
    group_name: str,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    padding_idx: int,
    qwz_bits: int,
    qwz_block: int,
) -> Tensor:
    """`F.embedding(indices, W)` with W of `shape` split by rows (vocabulary
    entries) over the ring."""
    ring = Ring(group_name)
    travel, read = _travelling(shard, shape, param_dtype, qwz_bits, qwz_block)
    rows = shard.numel() // shape[1]
    out = shard.new_zeros(*indices.shape, shape[1], dtype=param_dtype or shard.dtype)

    def visit(j: int, w: Tensor) -> None:
        mask, local = _in_shard(indices, j, rows)
        out[mask] = w[local[mask]]

    _rotate(travel, ring, visit, read)
    return out


@rtp_embedding.register_fake
def _(indices, shard, shape, group_name, param_dtype, reduce_dtype, padding_idx, *qwz):
    return shard.new_empty(*indices.shape, shape[1], dtype=param_dtype or shard.dtype)


@torch.library.custom_op("zppc::rtp_embedding_backward", mutates_args=())
def rtp_embedding_backward(
    grad: Tensor,
    indices: Tensor,
    shard: Tensor,
    shape: list[int],
    group_name: str,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    padding_idx: int,
) -> Tensor:
    """This rank's flat shard of the embedding gradient, averaged over ranks
    (the row `padding_idx`, if not -1, gets none, as in `F.embedding`)."""
    ring = Ring(group_name)
    rows = shard.numel() // shape[1]
    acc_dtype = reduce_dtype or grad.dtype
    flat_grad = grad.reshape(-1, shape[1]).to(acc_dtype)
    flat_indices = indices.reshape(-1)
    if padding_idx >= 0:
        keep = flat_indices != padding_idx
        flat_grad, flat_indices = flat_grad[keep], flat_indices[keep]

    def partial(j: int, _: None) -> Tensor:
        mask, local = _in_shard(flat_indices, j, rows)
        part = torch.zeros(rows, shape[1], dtype=acc_dtype, device=grad.device)
        return part.index_add_(0, local[mask], flat_grad[mask])

    # The weights are not needed: only the partial sums travel.
    total = _ring_reduce(ring, (rows, shape[1]), acc_dtype, grad.device, partial)
    return (total / ring.size).to(shard.dtype).reshape(-1)


@rtp_embedding_backward.register_fake
def _(grad, indices, shard, shape, group_name, param_dtype, reduce_dtype, padding_idx):
    return torch.empty_like(shard)


def _embedding_setup(ctx, inputs, output) -> None:
    indices, shard, shape, group_name, param_dtype, reduce_dtype, padding_idx, *_qwz = inputs
    ctx.save_for_backward(indices, shard)
    ctx.args = (shape, group_name, param_dtype, reduce_dtype, padding_idx)


def _embedding_backward(ctx, grad: Tensor):
    indices, shard = ctx.saved_tensors
    grad_shard = torch.ops.zppc.rtp_embedding_backward(grad, indices, shard, *ctx.args)
    return None, grad_shard, *[None] * 7


rtp_embedding.register_autograd(_embedding_backward, setup_context=_embedding_setup)


@dataclass(frozen=True)
class RingTransfer:
    """What one ring op of a final graph moves: this rank receives
    `received_bytes` from the next rank of the group over the whole op
    (`unquantized_bytes` without qwZ)."""

    group_name: str
    shard: Any
    """The FX node of the flat shard the op rotates (or reduces onto)."""
    received_bytes: int
    unquantized_bytes: int


@dataclass(frozen=True)
class _RingArgs:
    """The arguments of a ring op that size its transfers."""

    kind: str
    """"forward", "linear_backward" or "embedding_backward"."""
    shard: Any
    group_name: str
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    qwz_bits: int = 0
    qwz_block: int = 0
    need_x: bool = True
    need_weight: bool = True


def _ring_args(node) -> _RingArgs | None:
    a = node.args
    if node.target in (torch.ops.zppc.rtp_linear.default, torch.ops.zppc.rtp_addmm.default):
        return _RingArgs("forward", a[1], a[4], a[5], a[6], a[7], a[8])
    if node.target is torch.ops.zppc.rtp_embedding.default:
        return _RingArgs("forward", a[1], a[3], a[4], a[5], a[7], a[8])
    if node.target in (
        torch.ops.zppc.rtp_linear_backward.default,
        torch.ops.zppc.rtp_addmm_backward.default,
    ):
        return _RingArgs("linear_backward", a[2], a[4], a[5], a[6], a[9], a[10], a[7], a[8])
    if node.target is torch.ops.zppc.rtp_embedding_backward.default:
        return _RingArgs("embedding_backward", a[2], a[4], a[5], a[6], need_x=False)
    return None


def ring_transfer(node) -> RingTransfer | None:
    """The transfer of the ring op `node` (an FX node), None for any other
    node. The hop counts are those the ops above run: N-1 weight hops to apply
    every shard, N partial-sum hops to reduce a gradient onto its owner."""
    if getattr(node, "op", None) != "call_function":
        return None
    args = _ring_args(node)
    if args is None:
        return None
    n = _GROUP_FROM_NAME(args.group_name).size()
    val = args.shard.meta["val"]
    weight_hop = val.numel() * (args.param_dtype or val.dtype).itemsize
    sent_hop = weight_hop
    if args.qwz_bits:
        sent_hop = quant.PayloadLayout(val.numel(), args.qwz_block, args.qwz_bits).nbytes
    weight_hops = (n - 1) * (args.kind != "embedding_backward" and args.need_x)
    grad_hops = (n if n > 1 else 0) * (args.kind != "forward" and args.need_weight)
    grad_hop = val.numel() * (args.reduce_dtype or args.param_dtype or val.dtype).itemsize
    return RingTransfer(
        args.group_name,
        args.shard,
        weight_hops * sent_hop + grad_hops * grad_hop,
        weight_hops * weight_hop + grad_hops * grad_hop,
    )


@register_flop_formula([torch.ops.zppc.rtp_linear, torch.ops.zppc.rtp_addmm])
def _linear_flops(x_shape, shard_shape, bias_shape, shape, *args, out_shape=None, **kwargs) -> int:
    """The full weight's matmul, as `F.linear`'s (the cost model reads it)."""
    return 2 * math.prod(x_shape[:-1]) * shape[0] * shape[1]


@register_flop_formula([torch.ops.zppc.rtp_linear_backward, torch.ops.zppc.rtp_addmm_backward])
def _linear_backward_flops(
    grad_shape, x_shape, shard_shape, shape, group_name, param_dtype, reduce_dtype, need_x,
    need_weight, *qwz, out_shape=None, **kwargs,
) -> int:  # fmt: skip
    return 2 * math.prod(x_shape[:-1]) * shape[0] * shape[1] * (int(need_x) + int(need_weight))
