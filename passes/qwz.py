"""The `qwz` pass: quantized parameter all-gathers (ZeRO++ qwZ).

Requires: the `zero` pass (it tags the wait node of every parameter
all-gather). Runs on the forward graph and on the backward graph (the zero3
re-gather; hpZ, once built, serves that one from the node instead).

Rewrite, per gather: local shard -> `zppc::quantize_pack` (fp32 block scales
followed by int8 or packed int4 values, one uint8 payload) -> one all-gather
of the payloads -> `zppc::unpack_dequantize` to the shard's dtype. Data and
scales travel in a single collective.

Numerics: changes results (opt-in); every element is off by at most half a
quantization step of its block. Forward and backward dequantize the same
payload, so both see the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import zppc.kernels.quant  # noqa: F401  (registers the quantization ops)
from torch import fx
from zppc.passes.graph_utils import GraphBuilder
from zppc.passes.zero import PARAM_GATHER, UNQUANTIZED_BYTES, all_gather
from zppc.runtime.topology import group_size

c10d = torch.ops._c10d_functional
BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class GatherMatch:
    """A parameter all-gather as the `zero` pass emitted it."""

    gather: fx.Node
    wait: fx.Node
    record: fx.Node
    local: fx.Node
    group_name: str

    @property
    def shard_numel(self) -> int:
        return self.local.meta["val"].numel()


def find_param_gathers(graph: fx.Graph) -> list[GatherMatch]:
    matches = []
    for wait in graph.find_nodes(op="call_function", target=c10d.wait_tensor.default):
        if not wait.meta.get(PARAM_GATHER):
            continue
        gather = wait.args[0]
        (record,) = [u for u in wait.users if u.target == torch.ops.zppc.record_comm.default]
        matches.append(GatherMatch(gather, wait, record, gather.args[0], gather.args[2]))
    return matches


def qwz_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    bits = BITS[ctx.config.qwz]
    block = ctx.config.qwz_block_size
    zppc_ops = torch.ops.zppc
    for m in find_param_gathers(gm.graph):
        b = GraphBuilder(gm, m.gather)
        world = group_size(m.group_name)
        payload = b.call(zppc_ops.quantize_pack.default, m.local, block, bits)
        gathered = all_gather(b, payload, m.group_name)
        gathered.meta[PARAM_GATHER] = True
        dtype = m.local.meta["val"].dtype
        gathered.meta[UNQUANTIZED_BYTES] = m.shard_numel * dtype.itemsize
        values = b.call(
            zppc_ops.unpack_dequantize.default, gathered, world, m.shard_numel, block, bits, dtype
        )
        m.wait.replace_all_uses_with(values, delete_user_cb=lambda user, r=m.record: user is not r)
        for node in (m.record, m.wait, m.gather):
            gm.graph.erase_node(node)
    return gm
