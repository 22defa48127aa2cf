"""The `gather_hops` pass: on gloo, world all-gathers run in two hops.

Requires: every pass that creates or rewrites collectives has run, and
`reduction_groups` (only gathers are left on the world group): collectives in
the `CollectiveMatch` form, the group's name the last argument of the ledger
hook and of the issue. Must run before `overlap`, whose one-in-flight rule is
per group.

Rewrite: every all-gather over a world group that has two-hop groups
(`zppc.runtime.topology.gather_hops`: gloo, several nodes of several ranks)
moves to its hop world, over which `zppc::all_gather_in_place` gathers across
the nodes first and then inside each node. gloo's all-gather is a ring over
the ranks in order, which brings N D - 1 shards into each node over its link
(N nodes of D ranks); the two hops bring D (N - 1): 2 against 3 on 2 x 2, a
third fewer bytes on the link for every forward and backward gather
(`zppc.runtime.ledger.node_link_bytes` counts both). NCCL picks its own
algorithm; its graphs are unchanged.

Every rank rewrites alike (the groups' backend and the graph only). Numerics:
unchanged, the same shards in the same order.
"""

from __future__ import annotations

from torch import fx
from zppc.passes.overlap import on_gloo
from zppc.passes.zero import find_collectives
from zppc.runtime.topology import gather_hops


def gather_hops_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    for m in find_collectives(gm.graph):
        hops = gather_hops(m.group_name)
        if m.kind != "all_gather" or hops is None or not on_gloo(m.group_name):
            continue
        m.move_to_group(hops.world)
    return gm
