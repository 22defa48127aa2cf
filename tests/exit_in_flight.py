"""Run under torchrun (4 ranks, nodes of 2): issue two-hop gathers and
reductions and leave without waiting for them, as a script interrupted
between a graph's issue and its wait does. `MODE=return` ends the script
normally, `MODE=raise` with an exception. Used by
`test_reliability.py::test_exit_with_two_hop_collectives_in_flight_is_clean`."""

import os

import torch
import torch.distributed as dist
from zppc.runtime.topology import Topology, gather_hops, reduction_hops, setup_groups

dist.init_process_group("gloo")
world = dist.get_world_size()
groups = setup_groups(Topology(world, 2))
reductions, gathers = reduction_hops(groups.world), gather_hops(groups.world)
in_flight = []
for _ in range(8):
    flat = torch.randn(world * 1_000_000)
    in_flight.append(torch.ops.zppc.reduce_scatter_in_two_hops(flat, reductions.world))
    in_flight.append(torch.ops.zppc.all_gather_in_place(torch.randn(1_000_000), gathers.world))
print(f"rank {dist.get_rank()}: leaving with {len(in_flight)} collectives issued", flush=True)
if os.environ["MODE"] == "raise":
    raise RuntimeError("a user's error mid-step")
