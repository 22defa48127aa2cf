"""Rank functions for tests/test_qgz.py: the gradients one compiled backward
produces with and without qgZ, from the same weights and the same batch."""

from __future__ import annotations

import warnings

import torch
from models import MODELS

import zppc


def reduced_gradients(
    rank, world, node_size, variants, dtype_name="float32", model="mlp", lowering="eager"
):
    """For each variant (a dict of Config fields): the flat gradient shards this
    rank holds after one compiled forward and backward of the same batch, the
    ledger of a second such step, its compiled schedule, and the warnings."""
    dtype = getattr(torch, dtype_name)
    out = {}
    for name, fields in variants.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = MODELS[model]().to(dtype)
        zppc.distribute(net, zppc.Config(node_size=node_size, lowering=lowering, **fields))
        step = torch.compile(net, backend="zppc")
        x, y = net.batch(0)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        x = x.to(dtype) if x.is_floating_point() else x
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(x, y).backward()
        state = net._zppc_state
        grads = {fqn: state.shard(fqn).grad.detach().float().clone() for fqn in state.specs}
        zppc.reset_comm_stats()
        step(x, y).backward()
        out[name] = {
            "grads": grads,
            "comm": zppc.comm_stats().as_dict(),
            "schedule": [
                (c.graph, c.kind, c.group_size, c.intra_node_bytes, c.inter_node_bytes)
                for c in zppc.inspect(step).schedule
            ],
            "warnings": [str(w.message) for w in caught if "qgz" in str(w.message)],
        }
    return out


def hop_order(rank, world, node_size, bucket_bytes):
    """The order in which the final backward graph issues and waits for qgZ's
    hops: ("issue" | "wait", "intra" | "inter") per all-to-all."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = MODELS["gpt"]()
    config = zppc.Config(
        node_size=node_size, lowering="eager", qgz="int4", bucket_bytes=bucket_bytes
    )
    zppc.distribute(net, config)
    step = torch.compile(net, backend="zppc")
    x, y = net.batch(0)
    step(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    from zppc.runtime.topology import group_lanes, reduction_twin

    groups = net._zppc_state.groups
    # On gloo the hops run on the groups' twins (the reduction_groups pass),
    # in turn on the twins' lanes (the lanes pass).
    where = {}
    for group, hop in ((groups.intra_node, "intra"), (groups.cross_node, "inter")):
        for name in (group, *group_lanes(reduction_twin(group))):
            where[name] = hop
    a2a = torch.ops._c10d_functional.all_to_all_single.default
    wait = torch.ops._c10d_functional.wait_tensor.default
    events = []
    for record in zppc.inspect(step).compiles:
        for node in record.final["backward"].graph.nodes:
            if node.target is a2a:
                events.append(("issue", where[node.args[-1]]))
            elif node.target is wait and node.args[0].target is a2a:
                events.append(("wait", where[node.args[0].args[-1]]))
    return events


def accumulated_gradients(rank, world, node_size, variants, steps):
    """For each variant: the flat gradient shards after `steps` backward passes
    on different batches, accumulated without zero_grad (what the optimizer
    would see after that many micro-steps), with the weights held fixed."""
    out = {}
    for name, fields in variants.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = MODELS["gpt"]()
        zppc.distribute(net, zppc.Config(node_size=node_size, lowering="eager", **fields))
        step = torch.compile(net, backend="zppc")
        for i in range(steps):
            x, y = net.batch(i)
            step(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        state = net._zppc_state
        out[name] = {
            "grads": {fqn: state.shard(fqn).grad.detach().clone() for fqn in state.specs},
            "residuals": sorted(state.qgz_residuals),
        }
    return out


def error_feedback_resume(rank, world, path):
    """Train 3 steps with qgZ error feedback, save, train 2 more; then a fresh
    model loads the checkpoint and trains the same 2 steps, with and without
    the residuals it saved."""
    config = zppc.Config(node_size=2, lowering="eager", qgz="int4", qgz_error_feedback=True)

    def fresh():
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = zppc.distribute(MODELS["gpt"](), config)
        return net, torch.compile(net, backend="zppc"), torch.optim.SGD(net.parameters(), lr=0.1)

    def train(net, step, opt, batches):
        for i in batches:
            x, y = net.batch(i)
            step(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            opt.step()
            opt.zero_grad()
        return {k: v.full_tensor() for k, v in net.state_dict().items()}

    net, step, opt = fresh()
    train(net, step, opt, range(3))
    zppc.save(net, opt, path)
    saved = sorted(net._zppc_state.qgz_residuals)
    reference = train(net, step, opt, range(3, 5))
    gaps = {}
    for keep in (True, False):
        net, step, opt = fresh()
        zppc.load(net, opt, path)
        if not keep:
            net._zppc_state.qgz_residuals.clear()
        resumed = train(net, step, opt, range(3, 5))
        gaps[keep] = max((resumed[k] - reference[k]).abs().max().item() for k in reference)
    return {"saved": saved, "gap_with_residuals": gaps[True], "gap_without": gaps[False]}
