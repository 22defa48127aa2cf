"""qgZ's arithmetic between its two all-to-all hops, as pure torch.

The `qgz` pass inlines these functions into the backward graph, so Inductor
fuses each hop's dequantize + sum with the next hop's requantize. Payload rows
use `quant.PayloadLayout` (fp32 block scales, then int8 or packed int4 values):
one row per destination rank.

Sums run over the received rows in a fixed order (row 0 first, then 1, ...) in
fp32, so a result does not depend on how a backend would tree-reduce.
"""

from __future__ import annotations

import torch
from torch import Tensor
from zppc.kernels.quant import quantize_pack_rows_reference, unpack_dequantize_reference


def reorder_for_two_hops(flat: Tensor, nodes: int, per_node: int) -> Tensor:
    """[K*D*S] (shard k*D + d at its place) -> [D, K*S]: row d holds the shards
    that local rank d of every node owns, node by node."""
    return flat.view(nodes, per_node, -1).permute(1, 0, 2).reshape(per_node, -1)


def quantize_rows(rows: Tensor, block: int, bits: int) -> Tensor:
    """[P, n] values -> [P, nbytes] payloads, each row quantized on its own."""
    return quantize_pack_rows_reference(rows, block, bits)


def ordered_sum(values: Tensor) -> Tensor:
    """Sum of the rows of a [P, n] fp32 tensor, row 0 first."""
    total = values[0]
    for row in range(1, values.shape[0]):
        total = total + values[row]
    return total


def dequantize_sum(received: Tensor, peers: int, numel: int, block: int, bits: int) -> Tensor:
    """`peers` payload rows of `numel` values each -> their fp32 sum, [numel]."""
    values = unpack_dequantize_reference(received, peers, numel, block, bits, torch.float32)
    return ordered_sum(values.view(peers, numel))


def exact_sum(received: Tensor, peers: int) -> Tensor:
    """Unquantized rows (qgz_quantize=False) -> their fp32 sum."""
    return ordered_sum(received.view(peers, -1).float())
