"""gloo's reduce-scatter against an all-to-all and a local sum, and against
zppc's two hops (inside each node, then across), on the emulated cluster,
counted by the nodes' links: the measurement behind
`Config.reduce_scatter="auto"`.

    sudo python benchmarks/reduce_scatter.py --nodes 2 --ranks-per-node 2 --inter-bw 1gbit,100mbit

For each link speed it builds the cluster (benchmarks/cluster.py) and runs this
file as every rank's script: each algorithm reduces the same rank-major input
(`--shard-mb` MB per rank's output, so `world` times that per input) and the
results are checked equal; the algorithms alternate `--rounds` times,
`--reps` back-to-back operations each, between barriers. The first local rank
of each node reads its node's link counter (`tx_bytes` of the shaped veth
inside the node, the bytes that left the node) around each round. Only the
timed operations are counted; MB = 10^6 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cluster import (  # noqa: E402
    RESULT_PREFIX,
    EmulatedCluster,
    require_privileges,
    result_lines,
)

# IN_FLIGHT: the round's operations issued back to back and waited at the
# end, as a backward with several reductions in flight issues them; each hop
# group still carries one hop at a time, so one operation's intra-node hop
# runs while the previous one's crosses the link.
IN_FLIGHT = "two_hop, in flight"
ALGORITHMS = ("reduce_scatter", "all_to_all+sum", "two_hop", IN_FLIGHT)


def rank_main(shard_bytes: int, rounds: int, reps: int) -> None:
    """One rank of the measurement (run under torchrun inside a node)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from zppc.runtime.topology import Topology, reduction_hops, setup_groups

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    hops = reduction_hops(setup_groups(Topology(world, int(os.environ["LOCAL_WORLD_SIZE"]))).world)
    link = os.environ["GLOO_SOCKET_IFNAME"]
    n = shard_bytes // 4
    x = torch.randn(world * n, generator=torch.Generator().manual_seed(dist.get_rank()))

    def left_node() -> int:
        with open(f"/sys/class/net/{link}/statistics/tx_bytes") as f:
            return int(f.read())

    def native() -> torch.Tensor:
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, x)
        return out

    def direct() -> torch.Tensor:
        out = torch.empty(world * n)
        dist.all_to_all_single(out, x)
        return out.view(world, n).sum(0)

    def two_hop() -> torch.Tensor:
        return funcol.wait_tensor(torch.ops.zppc.reduce_scatter_in_two_hops(x, hops.world))

    def two_hop_in_flight() -> torch.Tensor:
        issued = [torch.ops.zppc.reduce_scatter_in_two_hops(x, hops.world) for _ in range(reps)]
        return [funcol.wait_tensor(t) for t in issued][-1]

    ways = dict(zip(ALGORITHMS, (native, direct, two_hop, two_hop_in_flight), strict=True))
    if hops is None:  # one node, or a rank per node: nothing to take in two hops
        del ways["two_hop"], ways[IN_FLIGHT]
    for name, fn in ways.items():  # the same sum in another order: float32 noise
        torch.testing.assert_close(fn(), native(), rtol=1e-5, atol=1e-5, msg=name)
    rows: dict[str, list[dict]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            dist.barrier()
            time.sleep(0.2)  # let the barrier's own packets leave first
            before, start = left_node(), time.perf_counter()
            for _ in range(1 if name == IN_FLIGHT else reps):  # IN_FLIGHT runs `reps` itself
                fn()
            dist.barrier()
            seconds = time.perf_counter() - start
            time.sleep(0.2)
            rows[name].append({"bytes": (left_node() - before) / reps, "seconds": seconds / reps})
    if int(os.environ["LOCAL_RANK"]) == 0:
        print(RESULT_PREFIX + json.dumps({"node": int(os.environ["GROUP_RANK"]), "rows": rows}))
    dist.destroy_process_group()


def measure(args) -> list[dict]:
    require_privileges()
    world = args.nodes * args.ranks_per_node
    results = []
    for rate in args.inter_bw.split(","):
        with EmulatedCluster(nodes=args.nodes, rate=rate) as cluster:
            script = [__file__, "--rank-main", f"--shard-bytes={int(args.shard_mb * 1e6)}"]
            script += [f"--rounds={args.rounds}", f"--reps={args.reps}"]
            outputs = cluster.launch(
                args.ranks_per_node, script, env={"PYTHONUNBUFFERED": "1"}, timeout=1800
            )
        nodes = result_lines(outputs)
        for name in nodes[0]["rows"]:
            per_round = [
                (
                    sum(n["rows"][name][i]["bytes"] for n in nodes) / len(nodes),
                    max(n["rows"][name][i]["seconds"] for n in nodes),
                )
                for i in range(args.rounds)
            ]
            results.append(
                {
                    "link": rate,
                    "algorithm": name,
                    "world": world,
                    "input_mb_per_rank": args.shard_mb * world,
                    "mb_left_each_node": sum(b for b, _ in per_round) / len(per_round) / 1e6,
                    "seconds": sorted(s for _, s in per_round)[len(per_round) // 2],
                }
            )
    return results


def print_table(rows: list[dict]) -> None:
    print(
        "| link | algorithm | MB out of each node | vs reduce-scatter | seconds (median) | vs reduce-scatter |"
    )
    print("|---|---|---:|---:|---:|---:|")
    base = {r["link"]: r for r in rows if r["algorithm"] == "reduce_scatter"}
    for r in rows:
        b = base[r["link"]]
        print(
            f"| {r['link']} | {r['algorithm']} | {r['mb_left_each_node']:.1f} | "
            f"{r['mb_left_each_node'] / b['mb_left_each_node']:.2f}x | {r['seconds']:.3f} | "
            f"{r['seconds'] / b['seconds']:.2f}x |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--inter-bw", default="1gbit,100mbit")
    p.add_argument("--shard-mb", type=float, default=4.0, help="each rank's output, MB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("-o", "--output", type=Path, default=None, help="the rows as JSON")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shard-bytes", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_main:
        rank_main(args.shard_bytes, args.rounds, args.reps)
        return 0
    rows = measure(args)
    print_table(rows)
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
