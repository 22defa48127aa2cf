"""Rank functions for tests/test_parameters.py: the code around a training loop
(clipping, weight-decay groups, state dicts, nn.init, mixed precision) run on a
distributed model and on a single-process reference that sees the whole batch."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from models import OddMLP
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

import zppc

STEPS = 5


def as_float(value) -> float:
    return float(value.full_tensor() if isinstance(value, DTensor) else value)


def sgd(named):
    return torch.optim.SGD([p for _, p in named], lr=0.2, momentum=0.9)


def nanogpt_adamw(named):
    """nanoGPT's grouping: matrices decay, vectors and scalars do not."""
    params = [p for _, p in named if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.5},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )


def train_pair(rank, world, model, reference, make_opt, clip=None, steps=STEPS):
    """Train the distributed `model` (compiled) and `reference` side by side."""
    step = torch.compile(model, backend="zppc")
    opt, ref_opt = (
        make_opt(list(model.named_parameters())),
        make_opt(list(reference.named_parameters())),
    )
    out = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": [], "total_norms": []}
    for i in range(steps):
        x, y = OddMLP.batch(i)
        loss = step(x.chunk(world)[rank], y.chunk(world)[rank])
        loss.backward()
        ref_loss = reference(x, y)
        ref_loss.backward()
        if clip is not None:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            out["total_norms"].append(as_float(torch.nn.utils.get_total_norm(grads)))
            out["norms"].append(as_float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            out["ref_norms"].append(
                float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip))
            )
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        value = loss.detach().float().clone()
        dist.all_reduce(value)
        out["losses"].append(value.item() / world)
        out["ref_losses"].append(ref_loss.item())
    full = zppc.full_parameters(model)
    out["gaps"] = {
        name: (full[name].float() - p.detach()).abs().max().item()
        for name, p in reference.named_parameters()
    }
    return out


def fresh_pair(seed: int = 0):
    torch.manual_seed(seed)
    model = OddMLP()
    return model, copy.deepcopy(model)


def parameter_model(rank, world, lowering, scenarios):
    """Run each named scenario; return its measurements by name."""
    results = {}
    for name in scenarios:
        torch._dynamo.reset()
        results[name] = SCENARIOS[name](rank, world, lowering)
    return results


def config(lowering, **kw):
    return zppc.Config(strategy=kw.pop("strategy", "zero3"), node_size=2, lowering=lowering, **kw)


def clipping(rank, world, lowering):
    model, reference = fresh_pair()
    zppc.distribute(model, config(lowering))
    return train_pair(rank, world, model, reference, sgd, clip=0.05)


def decay_groups(rank, world, lowering):
    model, reference = fresh_pair()
    zppc.distribute(model, config(lowering))
    out = train_pair(rank, world, model, reference, nanogpt_adamw)
    out["names"] = [n for n, _ in model.named_parameters()]
    out["ref_names"] = [n for n, _ in reference.named_parameters()]
    out["decayed"] = sorted(n for n, p in model.named_parameters() if p.dim() >= 2)
    out["ref_decayed"] = sorted(n for n, p in reference.named_parameters() if p.dim() >= 2)
    return out


def load_full_state_dict(rank, world, lowering):
    """A pretrained (full, plain-tensor) state dict loaded after distribute."""
    pretrained, reference = fresh_pair(seed=7)
    model, _ = fresh_pair(seed=0)
    zppc.distribute(model, config(lowering))
    set_model_state_dict(
        model, pretrained.state_dict(), options=StateDictOptions(full_state_dict=True)
    )
    out = train_pair(rank, world, model, reference, sgd)
    out["state_dict_types"] = sorted({type(v).__name__ for v in model.state_dict().values()})
    return out


def in_place_init(rank, world, lowering):
    """nn.init and copies on parameters after distribute reach every shard."""
    model, reference = fresh_pair()
    zppc.distribute(model, config(lowering))
    new_fc2 = torch.linspace(-0.3, 0.3, 37 * 23).view(23, 37)
    new_fc1 = torch.linspace(0.2, -0.2, 37 * 13).view(37, 13)
    with torch.no_grad():
        for m in (model, reference):
            nn.init.zeros_(m.fc3.bias)
            nn.init.constant_(m.fc1.bias, 0.05)
            m.scale.fill_(1.5)
        reference.fc2.weight.copy_(new_fc2)
        reference.fc1.weight.copy_(new_fc1)
        w = model.fc2.weight
        w.copy_(distribute_tensor(new_fc2, w.device_mesh, w.placements))
        with implicit_replication():
            model.fc1.weight.copy_(new_fc1)
    return train_pair(rank, world, model, reference, sgd)


def adafactor(named):
    return torch.optim.Adafactor([p for _, p in named], lr=1e-2)


def adafactor_on_shards_or_replicas(rank, world, lowering):
    """Adafactor is refused at construction on sharded parameters, before any
    state exists; on ddp's replicated ones it trains like one process."""
    model, _ = fresh_pair()
    zppc.distribute(model, config(lowering))
    try:
        torch.optim.Adafactor(model.parameters(), lr=1e-2)
        error = None
    except ValueError as exc:
        error = str(exc)
    replicated, reference = fresh_pair()
    zppc.distribute(replicated, config(lowering, strategy="ddp"))
    out = train_pair(rank, world, replicated, reference, adafactor)
    out["error"] = error
    return out


def bf16_compute(rank, world, lowering):
    model, reference = fresh_pair()
    zppc.distribute(model, config(lowering, param_dtype=torch.bfloat16))
    out = train_pair(rank, world, model, reference, sgd)
    out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    return out


def read_on_one_rank(rank, world, lowering):
    """Reading a parameter outside a forward on one rank runs no collective."""
    model, _ = fresh_pair()
    zppc.distribute(model, config(lowering))
    zppc.reset_comm_stats()
    seen = {}
    if rank == 0:
        w = model.fc1.weight
        seen = {
            "type": type(w).__name__,
            "shape": tuple(w.shape),
            "local": w.to_local().norm().item(),
        }
    dist.barrier()
    return {"seen": seen, "comm": zppc.comm_stats().as_dict()}


def one_step_bytes(rank, world, model) -> dict:
    step = torch.compile(model, backend="zppc")
    x, y = OddMLP.batch(0)
    zppc.reset_comm_stats()
    step(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    return zppc.comm_stats().as_dict()


def two_topologies(rank, world, lowering):
    """Two models in one process, one on 2 nodes of 2 and one on a single node:
    each keeps its own groups, and its bytes are split by its own nodes."""
    two_nodes, _ = fresh_pair()
    one_node, _ = fresh_pair()
    zppc.distribute(two_nodes, zppc.Config(node_size=2, lowering=lowering))
    zppc.distribute(one_node, zppc.Config(node_size=4, lowering=lowering))
    meshes = {}
    for name, model in (("two_nodes", two_nodes), ("one_node", one_node)):
        state = model._zppc_state
        meshes[name] = {
            "shape": tuple(state.node_mesh.shape),
            "names": state.node_mesh.mesh_dim_names,
            "groups_from_mesh": [
                dist.get_process_group_ranks(state.node_mesh.get_group(d)) for d in (1, 0)
            ]
            == [
                dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(g))
                for g in (state.groups.intra_node, state.groups.cross_node)
            ],
        }
    return {
        "two_nodes": one_step_bytes(rank, world, two_nodes),
        "one_node": one_step_bytes(rank, world, one_node),
        "two_nodes_again": one_step_bytes(rank, world, two_nodes),
        "meshes": meshes,
    }


def user_mesh(rank, world, lowering):
    """Config(mesh=...) takes the user's 2-D DeviceMesh and trains like one process."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("node", "local"))
    model, reference = fresh_pair()
    zppc.distribute(model, zppc.Config(mesh=mesh, lowering=lowering, qwz="int8", hpz=True))
    out = {"node_size": model._zppc_state.topology.node_size}
    out["groups"] = [
        dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name))
        for name in (model._zppc_state.groups.intra_node, model._zppc_state.groups.cross_node)
    ]
    out.update(train_pair(rank, world, model, reference, sgd))
    return out


SCENARIOS = {
    "clipping": clipping,
    "decay_groups": decay_groups,
    "load_full_state_dict": load_full_state_dict,
    "in_place_init": in_place_init,
    "adafactor": adafactor_on_shards_or_replicas,
    "bf16_compute": bf16_compute,
    "read_on_one_rank": read_on_one_rank,
    "two_topologies": two_topologies,
    "user_mesh": user_mesh,
}
