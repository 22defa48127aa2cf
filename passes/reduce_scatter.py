"""The `reduce_scatter` pass: run each gradient reduce-scatter with the
algorithm that moves fewest bytes on its backend.

Requires: `zero` and `bucket`, and `qgz` when enabled (it consumes the
reduce-scatters it quantizes): reduce-scatters in the `CollectiveMatch` form,
each over a rank-major flat input [world * S]. Runs before `overlap`, which
then schedules the all-to-alls like any reduction.

Rewrite, where `Config.reduce_scatter` resolves to "all_to_all" for the
group (under "auto": gloo, where it moves fewer bytes;
`runtime.collectives.direct_reduce_scatter`): the reduce-scatter of `x` becomes an all-to-all
of `x`'s world slices (slice r to rank r) and a local sum over the [world, S]
slices received. gloo runs a reduce-scatter as an all-reduce (a ring's
2 (W - 1) / W of the input through every link); the all-to-all sends each
slice once, directly. NCCL's ring reduce-scatter sends (W - 1) / W, fewer
than a direct exchange across a node boundary, so "auto" keeps it.

Every rank decides alike (the config and the group's backend). Numerics: the
same sum in another order; the local sum accumulates in fp32 for 16-bit
gradients, gloo's all-reduce in the gradient's own dtype.
"""

from __future__ import annotations

import torch
from torch import fx
from zppc.passes import is_planning, planned_backend
from zppc.passes.graph_utils import GraphBuilder
from zppc.passes.zero import collective, find_collectives
from zppc.runtime.collectives import direct_reduce_scatter
from zppc.runtime.topology import group_backend, group_size

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def uses_all_to_all(algorithm: str, group_name: str) -> bool:
    """`direct_reduce_scatter` for a group of this compile: in a plan, for the
    backend the plan stands for (its groups are the fake process group's)."""
    backend = planned_backend() if is_planning() else group_backend(group_name)
    return direct_reduce_scatter(algorithm, group_name, backend)


def reduce_scatter_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    algorithm = ctx.config.reduce_scatter
    for m in find_collectives(gm.graph):
        if m.kind != "reduce_scatter" or not uses_all_to_all(algorithm, m.group_name):
            continue
        b = GraphBuilder(gm, m.issue)
        world = group_size(m.group_name)
        slice_numel = m.input.meta["val"].numel() // world
        splits = [slice_numel] * world
        received = collective(
            b,
            "all_to_all",
            m.group_name,
            c10d.all_to_all_single.default,
            m.input,
            splits,
            splits,
            m.group_name,
        )
        rows = b.call(aten.view.default, received, [world, slice_numel])
        m.replace_with(b.call(aten.sum.dim_IntList, rows, [0]))
    return gm
