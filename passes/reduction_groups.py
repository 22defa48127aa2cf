"""The `reduction_groups` pass: on gloo, all but parameter gathers take a second group.

Requires: every pass that creates or rewrites collectives has run (zero, qwz,
bucket, qgz, reduce_scatter, sync_buffers): collectives in the
`CollectiveMatch` form, the group's name the last argument of the ledger hook
and of the issue. Must run before `lanes` (which spreads the twin's
collectives over the twin's lanes) and `overlap`, whose one-in-flight rule is
per group.

Rewrite: every collective other than a parameter gather moves to its group's
twin, a second group over the same ranks
(`zppc.runtime.topology.reduction_twin`): in the backward the gradient
reduce-scatters and all-reduces, qgZ's hops and the all-to-alls of a direct
reduce-scatter; in the forward the buffer broadcasts. Only on gloo: there a
group runs one collective in flight (`overlap.one_in_flight_on_gloo`), so a
backward's next gather, issued while a reduction was in flight on the same
group, first waited for that reduction on the main thread, and the backward's
compute stopped with it (0.4 s per bucket at 50 Mbit/s, `benchmarks/RESULTS.md`).
On its own group a gather is issued at once and crosses the link beside the
reduction. So the original groups carry parameter gathers alone, which the
runtime chains in the order they are issued, and only the twins need lanes
(`ensure_lanes`). NCCL runs several in flight per group; its graphs are
unchanged.

Every rank rewrites alike (the groups' backend and the graph only). Numerics:
unchanged, the same collectives over the same ranks.
"""

from __future__ import annotations

from torch import fx
from zppc.passes.overlap import is_param_gather, on_gloo
from zppc.passes.zero import find_collectives
from zppc.runtime.topology import reduction_twin


def reduction_groups_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    for m in find_collectives(gm.graph):
        twin = reduction_twin(m.group_name)
        if twin is None or is_param_gather(m) or not on_gloo(m.group_name):
            continue
        m.move_to_group(twin)
    return gm
