"""The `lanes` pass: on gloo, a twin group's collectives take turns on its lanes.

Requires: every pass that moves collectives to another group has run
(`reduction_groups`, `gather_hops`): collectives in the `CollectiveMatch`
form, the group's name the last argument of the ledger hook and of the issue.
Must run before `overlap`, whose one-in-flight rule is per group.

Rewrite: on a gloo group kept to one collective in flight
(`overlap.one_at_a_time`: not a hop world, whose runtime chains its own hops)
that has lanes (`zppc.runtime.topology.group_lanes`: the reduction twins, made
by `distribute`: the twin itself and groups over the same ranks), the
collectives of the graph but its gathers, in program order, move in turn to
the group's first `Config.prefetch + 1` lanes (at most `MAX_LANES`). On one
group the next reduction waited for the previous one before it was issued,
on the main thread: one reduction in flight, whatever `prefetch` allowed. On
lanes the overlap pass's order stands: `prefetch + 1` reductions in flight,
each lane still carrying one collective at a time. Gathers stay on their
group: the runtime chains them (`overlap.queued_in_issue_order`), `prefetch`
ahead, crossing in the order they are needed, where on lanes they shared the
link and the first one needed finished as late as the others; and since
`reduction_groups` leaves the original groups nothing but parameter
gathers, those groups have no lanes. This matters where zppc's groups are
plain gloo groups: one rank per node (a CPU job's usual layout) or one node;
over a hop world (several nodes of several ranks) the two-hop runtime
already keeps several collectives in flight.

Every rank rewrites alike (the groups' backend, the config and the graph
only), and each lane sees its collectives in the same order on every rank.
Numerics: unchanged, the same collectives over the same ranks.
"""

from __future__ import annotations

from torch import fx
from zppc.passes.overlap import one_at_a_time, queued_in_issue_order
from zppc.passes.zero import find_collectives
from zppc.runtime.topology import group_lanes, lane_count


def lanes_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    turns: dict[str, int] = {}
    for m in find_collectives(gm.graph):
        if not one_at_a_time(m.group_name) or queued_in_issue_order(m):
            continue
        lanes = group_lanes(m.group_name)[: lane_count(ctx.config.prefetch)]
        turn = turns.get(m.group_name, 0)
        turns[m.group_name] = turn + 1
        lane = lanes[turn % len(lanes)]
        if lane != m.group_name:
            m.move_to_group(lane)
    return gm
