"""The `reduce_scatter` pass: run each gradient reduce-scatter with the
algorithm that moves fewest bytes on its backend.

Requires: `zero` and `bucket`, and `qgz` when enabled (it consumes the
reduce-scatters it quantizes): reduce-scatters in the `CollectiveMatch` form,
each over a rank-major flat input [world * S]. Runs before `reduction_groups`
(a two-hop reduction is on hop groups of its own, which have no twin) and
`overlap`, which then schedules the new collectives like any reduction.

Rewrite, by what `Config.reduce_scatter` resolves to for the group
(`runtime.collectives.reduce_scatter_algorithm`; under "auto" on gloo, whose
reduce-scatter is an all-reduce underneath: two hops with several nodes of
several ranks, else all_to_all where it moves fewer bytes):

- "two_hop": the reduce-scatter of `x` becomes `zppc::reduce_scatter_in_two_hops`
  of `x` over the group's reduction hop world: inside each node, then across
  the nodes, the second hop issued off the main thread. D (N - 1) slices
  enter each node of D ranks over its link, against D (W - D) for the direct
  exchange (2 x 2: half; 2 x 4: a quarter).
- "all_to_all": an all-to-all of `x`'s world slices (slice r to rank r) and a
  local sum over the [world, S] slices received. gloo runs a reduce-scatter
  as an all-reduce (a ring's 2 (W - 1) / W of the input through every link);
  the all-to-all sends each slice once, directly.

NCCL's ring reduce-scatter sends (W - 1) / W, fewer than a direct exchange
across a node boundary, so "auto" keeps it.

Every rank decides alike (the config and the group's backend). Numerics: the
same sum in another order; the local sums accumulate in fp32 for 16-bit
gradients and round once per hop, gloo's all-reduce in the gradient's own
dtype.
"""

from __future__ import annotations

import torch
from torch import fx
from zppc.passes import is_planning, planned_backend
from zppc.passes.graph_utils import GraphBuilder
from zppc.passes.zero import collective, find_collectives
from zppc.runtime.collectives import reduce_scatter_algorithm
from zppc.runtime.topology import group_backend, group_size, reduction_hops

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def algorithm_for(algorithm: str, group_name: str) -> str:
    """`reduce_scatter_algorithm` for a group of this compile: in a plan, for
    the backend the plan stands for (its groups are the fake process group's)."""
    backend = planned_backend() if is_planning() else group_backend(group_name)
    return reduce_scatter_algorithm(algorithm, group_name, backend)


def reduce_scatter_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    for m in find_collectives(gm.graph):
        if m.kind != "reduce_scatter":
            continue
        algorithm = algorithm_for(ctx.config.reduce_scatter, m.group_name)
        if algorithm == "two_hop":
            b = GraphBuilder(gm, m.issue)
            hop_world = reduction_hops(m.group_name).world
            reduced = collective(
                b,
                "reduce_scatter",
                hop_world,
                torch.ops.zppc.reduce_scatter_in_two_hops.default,
                m.input,
                hop_world,
            )
            m.replace_with(reduced)
        elif algorithm == "all_to_all":
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
