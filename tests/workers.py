"""Functions run on every spawned rank by the multi-process tests."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import threading

import torch
import torch.distributed as dist
from models import MODELS
from torch.distributed.tensor import DTensor

import zppc


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def local_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world)[rank]


def distributed_step(step, opt, x, y, rank, world) -> float:
    """One training step on this rank's slice of the global batch; returns the
    loss averaged over ranks (the loss of the whole batch)."""
    loss = step(local_slice(x, rank, world), local_slice(y, rank, world))
    loss.backward()
    opt.step()
    opt.zero_grad()
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value.item() / world


def train_against_reference(rank, world, model_name, config_kwargs, optimizer, steps=10):
    """Train a distributed compiled model and a single-process reference that sees
    the whole batch; return both loss curves and the largest parameter gap."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model_cls = MODELS[model_name]
    model = model_cls()
    reference = copy.deepcopy(model)
    zppc.distribute(model, zppc.Config(**config_kwargs))
    step = torch.compile(model, backend="zppc")
    opt = make_optimizer(optimizer, model.parameters())
    ref_opt = make_optimizer(optimizer, [p for p in reference.parameters() if p.requires_grad])
    losses, ref_losses = [], []
    for i in range(steps):
        x, y = model_cls.batch(i)
        losses.append(distributed_step(step, opt, x, y, rank, world))

        ref_loss = reference(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    full = zppc.full_parameters(model)
    ref_params = dict(reference.named_parameters())
    gaps = {name: (full[name] - ref_params[name].detach()).abs().max().item() for name in full}
    frozen_moved = [
        name
        for name, p in ref_params.items()
        if not p.requires_grad and not torch.equal(full[name], p.detach())
    ]
    inspection = zppc.inspect(step)
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "gaps": gaps,
        "frozen_moved": frozen_moved,
        "graphs": len(inspection.compiles),
        "comm": zppc.comm_stats().as_dict(),
    }


def graph_hashes(rank, world, model_name, config_kwargs):
    """Hash of every final graph this rank compiled."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS[model_name]()
    zppc.distribute(model, zppc.Config(**config_kwargs))
    step = torch.compile(model, backend="zppc")
    x, y = model.batch(0)
    step(local_slice(x, rank, world), local_slice(y, rank, world)).backward()
    codes = [
        record.final[kind].code
        for record in zppc.inspect(step).compiles
        for kind in ("forward", "backward")
    ]
    return hashlib.sha256("\n".join(codes).encode()).hexdigest()


def saved_for_backward(rank, world, strategy, hpz=False):
    """Shapes of the tensors the compiled forward saves for backward, and the
    full weight shapes they must not include under zero3."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    weight_shapes = sorted(tuple(p.shape) for p in model.parameters() if p.dim() == 2)
    zppc.distribute(model, zppc.Config(strategy=strategy, hpz=hpz, node_size=2, lowering="eager"))
    step = torch.compile(model, backend="zppc")
    x, y = model.batch(0)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step(local_slice(x, rank, world), local_slice(y, rank, world))
    loss.backward()
    return {"saved": saved, "weights": weight_shapes}


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of memory behind `t` on this rank (a DTensor's local piece, with the
    padding of the flat shard it is a view of)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.untyped_storage().nbytes()


def state_bytes(params, opt) -> int:
    total = 0
    for p in params:
        total += storage_bytes(p)
        if p.grad is not None:
            total += storage_bytes(p.grad)
        for value in opt.state.get(p, {}).values():
            if torch.is_tensor(value) and value.dim() > 0:
                total += storage_bytes(value)
    return total


def training_state_bytes(rank, world, strategy):
    """Bytes of parameters + gradients + AdamW state on this rank after one step,
    and the same for an undistributed copy."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS["gpt"]()
    single = copy.deepcopy(model)
    zppc.distribute(model, zppc.Config(strategy=strategy, lowering="eager"))
    step = torch.compile(model, backend="zppc")
    result = {}
    for name, m, run in (("rank", model, step), ("single", single, single)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        x, y = m.batch(0)
        if name == "rank":
            x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        run(x, y).backward()
        opt.step()
        result[name] = state_bytes(list(m.parameters()), opt)
    return result


def one_step_ledger(rank, world, node_size, disable_passes=(), hpz=False):
    """The ledger and the compiled schedule of one zero3 training step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS["chain"]()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    config = zppc.Config(
        node_size=node_size, lowering="eager", disable_passes=disable_passes, hpz=hpz
    )
    zppc.distribute(model, config)
    step = torch.compile(model, backend="zppc")
    x, y = model.batch(0)
    step(local_slice(x, rank, world), local_slice(y, rank, world)).backward()  # compile + warm up
    zppc.reset_comm_stats()
    step(local_slice(x, rank, world), local_slice(y, rank, world)).backward()
    stats = zppc.comm_stats().as_dict()
    schedule = [
        (c.graph, c.kind, c.intra_node_bytes, c.inter_node_bytes, c.group_size)
        for c in zppc.inspect(step).schedule
    ]
    return {"stats": stats, "schedule": schedule, "shapes": shapes}


def expect_error(rank, world, what):
    """Call a bad zppc entry point; return the exception text (or None)."""
    import time

    from torch import nn

    start = time.monotonic()
    try:
        if what == "node_size":
            zppc.distribute(MODELS["mlp"](), zppc.Config(node_size=world + 1))
        elif what == "lstm":
            zppc.distribute(nn.LSTM(4, 4), zppc.Config())
        elif what == "twice":
            model = zppc.distribute(MODELS["mlp"](), zppc.Config(lowering="eager"))
            zppc.distribute(model, zppc.Config())
        elif what == "options":
            model = zppc.distribute(MODELS["mlp"](), zppc.Config(lowering="eager"))
            x, y = model.batch(0)
            torch.compile(model, backend="zppc", options={"strategy": "ddp"})(x, y)
    except Exception as exc:  # the test inspects the message
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def undistributed_ddp_fallback(rank, world):
    """An undistributed model compiled with backend="zppc" on several ranks gets
    ddp: its gradients are the average over ranks of the local ones."""
    torch._dynamo.reset()
    torch.manual_seed(rank)  # different on purpose: the backend broadcasts rank 0's
    model = MODELS["mlp"]()
    step = torch.compile(model, backend="zppc", options={"lowering": "eager"})
    x, y = model.batch(rank)
    step(x, y).backward()
    compiled = {n: p.grad.clone() for n, p in model.named_parameters()}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    model(x, y).backward()
    gaps = {}
    for n, p in model.named_parameters():
        expected = p.grad.clone()
        dist.all_reduce(expected)
        gaps[n] = (compiled[n] - expected / world).abs().max().item()
    return {"gaps": gaps, "weights": weights, "records": len(zppc.inspect(step).compiles)}


def dtype_training(rank, world, dtype_name, param_dtype_name, strategy="zero3", steps=5):
    """Losses and final weights of compiled and eager training of a model
    stored in `dtype`, and of a float32 single-process reference."""
    dtype = getattr(torch, dtype_name)
    param_dtype = getattr(torch, param_dtype_name) if param_dtype_name else None
    torch._dynamo.reset()
    result = {}
    for name in ("compiled", "eager", "reference"):
        torch.manual_seed(0)
        model = MODELS["gpt"]().to(torch.float32 if name == "reference" else dtype)
        run = model
        if name != "reference":
            config = zppc.Config(strategy=strategy, lowering="eager", param_dtype=param_dtype)
            zppc.distribute(model, config)
            if name == "compiled":
                run = torch.compile(model, backend="zppc")
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for i in range(steps):
            x, y = model.batch(i)
            if name != "reference":
                x, y = local_slice(x, rank, world), local_slice(y, rank, world)
            loss = run(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            value = loss.detach().float()
            if name != "reference":
                dist.all_reduce(value)
                value /= world
            losses.append(value.item())
        params = (
            zppc.full_parameters(model) if name != "reference" else dict(model.named_parameters())
        )
        result[name] = {
            "losses": losses,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "params": {k: v.detach().float() for k, v in params.items()},
        }
    return result


def meta_init(rank, world):
    """A model built on the meta device is materialized, identical on every rank, and trains."""
    torch._dynamo.reset()
    torch.manual_seed(rank)
    with torch.device("meta"):
        model = MODELS["mlp"]()
    zppc.distribute(model, zppc.Config(lowering="eager"))
    step = torch.compile(model, backend="zppc")
    x, y = model.batch(0)
    loss = step(local_slice(x, rank, world), local_slice(y, rank, world))
    loss.backward()
    return {
        "params": zppc.full_parameters(model),
        "finite": bool(torch.isfinite(loss)),
        "meta": any(p.is_meta for p in model.parameters()),
    }


def qwz_step_bytes(rank, world, dtype_name, formats=(None, "int8")):
    """For each qwZ format: the ledger of one warm zero3 step of the tiny GPT,
    and the bytes per peer of each gather in the schedule (one job for all)."""
    dtype = getattr(torch, dtype_name)
    out = {}
    for qwz in formats:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MODELS["gpt"]().to(dtype)
        zppc.distribute(model, zppc.Config(qwz=qwz, node_size=2, lowering="eager"))
        step = torch.compile(model, backend="zppc")
        x, y = model.batch(0)
        x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        step(x, y).backward()
        zppc.reset_comm_stats()
        step(x, y).backward()
        gathers = [c for c in zppc.inspect(step).schedule if c.kind == "all_gather"]
        out[qwz] = {
            "stats": zppc.comm_stats().as_dict(),
            "gather_peer_bytes": [c.bytes_per_peer for c in gathers],
        }
    return out


def on_grid(model) -> None:
    """Put every shard on the 2^-7 grid with 127/128 in each non-empty shard, so
    that one int8 block per shard represents it exactly."""
    state = model._zppc_state
    g = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for fqn, spec in state.specs.items():
            shard = state.shard(fqn)
            valid = spec.valid_numel(dist.get_rank())
            shard.zero_()
            if valid:
                shard[:valid] = torch.randint(-127, 128, (valid,), generator=g).float() / 128
                shard[0] = 127 / 128


def lossless_qwz_step(rank, world):
    """Loss and shard gradients of one step with and without qwz int8 on weights
    that int8 represents exactly."""
    result = {}
    for qwz in (None, "int8"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MODELS["gpt"]()
        zppc.distribute(model, zppc.Config(qwz=qwz, qwz_block=1 << 20, lowering="eager"))
        on_grid(model)
        step = torch.compile(model, backend="zppc")
        x, y = model.batch(0)
        loss = step(local_slice(x, rank, world), local_slice(y, rank, world))
        loss.backward()
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        result[qwz] = {"loss": loss.detach(), "grads": grads}
    return result


def qwz_training(rank, world, steps):
    """Loss curves and held-out loss of zero3 without and with qwz int8 / int4,
    trained on the same text."""
    from zppc.data import random_windows, stdlib_corpus

    corpus = stdlib_corpus(1 << 20)
    train, held_out = corpus[: 15 << 16], corpus[15 << 16 :]
    result = {}
    for qwz in (None, "int8", "int4"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MODELS["gpt"]()
        zppc.distribute(model, zppc.Config(qwz=qwz, lowering="eager"))
        step = torch.compile(model, backend="zppc")
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        batches = random_windows(train, 8, 32, seed=rank)
        losses = []
        for _ in range(steps):
            loss = step(*next(batches))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():
            val = random_windows(held_out, 16, 32, seed=999)
            held = torch.stack([step(*next(val)) for _ in range(8)]).mean()
        dist.all_reduce(held)
        result[qwz] = {"losses": losses, "held_out": held.item() / world}
    return result


def checkpoint_round_trip(rank, world, path, phase, api="zppc"):
    """phase "save": train 3 steps, save, train 2 more (the reference).
    phase "load": fresh model and optimizer, load, train the same 2 steps.
    api "zppc": zppc.save / zppc.load; "dcp": DCP with the standard
    get/set_{model,optimizer}_state_dict, as a user of FSDP2 would write it."""
    torch._dynamo.reset()
    torch.manual_seed(1 if phase == "load" else 0)  # loading must overwrite everything
    model = MODELS["frozen"]()
    zppc.distribute(model, zppc.Config(lowering="eager"))
    step = torch.compile(model, backend="zppc")
    opt = make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad])

    def train(steps):
        return [distributed_step(step, opt, *model.batch(i), rank, world) for i in steps]

    if phase == "save":
        train(range(3))
    if api == "zppc":
        (zppc.save if phase == "save" else zppc.load)(model, opt, path)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import state_dict as sd

        state = {
            "model": sd.get_model_state_dict(model),
            "optim": sd.get_optimizer_state_dict(model, opt),
        }
        if phase == "save":
            dcp.save(state, checkpoint_id=path)
        else:
            dcp.load(state, checkpoint_id=path)
            sd.set_model_state_dict(model, state["model"])
            sd.set_optimizer_state_dict(model, opt, state["optim"])
    after = train(range(3, 5))
    return {"losses": after, "params": zppc.full_parameters(model), "lr": opt.param_groups[0]["lr"]}


def qwz_lowerings(rank, world, steps=3):
    """Losses of zero3 + qwz int8 under the eager and the Inductor lowering."""
    result = {}
    for lowering in ("eager", "inductor"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MODELS["mlp"]()
        zppc.distribute(model, zppc.Config(qwz="int8", qwz_block=64, lowering=lowering))
        step = torch.compile(model, backend="zppc")
        opt = make_optimizer("adamw", model.parameters())
        result[lowering] = [
            distributed_step(step, opt, *model.batch(i), rank, world) for i in range(steps)
        ]
    return result


def mismatched_setup(rank, world, kind):
    """distribute with a Config or model that differs on some ranks; returns the
    error text and how long it took to appear."""
    import time

    config = {"lowering": "eager"}
    model_name = "mlp"
    if kind == "strategy":
        config["strategy"] = "zero3" if rank < 2 else "ddp"
    elif kind == "node_size":
        config.update(hpz=True, node_size=4 if rank == 0 else 2)
    elif kind == "qwz":
        config["qwz"] = "int8" if rank < 2 else None
    elif kind == "model":
        model_name = "chain" if rank == 3 else "mlp"
    start = time.monotonic()
    try:
        zppc.distribute(MODELS[model_name](), zppc.Config(**config))
    except ValueError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def parameter_free_graph(rank, world):
    """zero3 on 2 nodes of 2, eager lowering, a model whose graph break leaves a
    parameter-free graph: the topology, the ledger's split and the lowering
    must stay the model's."""
    import torch._inductor.compile_fx as inductor_entry

    def no_inductor(*args, **kwargs):
        raise AssertionError("Inductor was called although the model asked for eager")

    inductor_entry.compile_fx = no_inductor
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS["tail_break"]()
    uncompiled = copy.deepcopy(model)
    zppc.distribute(model, zppc.Config(node_size=2, lowering="eager"))
    zppc.distribute(uncompiled, zppc.Config(node_size=2, lowering="eager"))
    step = torch.compile(model, backend="zppc")
    x, y = model.batch(0)
    x, y = local_slice(x, rank, world), local_slice(y, rank, world)
    step(x, y).backward()  # compiles both graphs
    zppc.reset_comm_stats()
    compiled_loss = step(x, y)
    compiled_loss.backward()
    stats = zppc.comm_stats().as_dict()
    eager_loss = uncompiled(x, y)
    return {
        "stats": stats,
        "node_size": model._zppc_state.topology.node_size,
        "losses": (compiled_loss.item(), eager_loss.item()),
        "records": len(zppc.inspect(step).compiles),
    }


def gpt_step_ledger(rank, world, config_kwargs):
    """The ledger of one warm training step of the demo's gpt-tiny."""
    from zppc.models import GPT, PRESETS

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = PRESETS["gpt-tiny"]
    model = zppc.distribute(GPT(cfg), zppc.Config(lowering="eager", **config_kwargs))
    step = torch.compile(model, backend="zppc")
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank))
    step(tokens[:, :-1], tokens[:, 1:]).backward()
    zppc.reset_comm_stats()
    step(tokens[:, :-1], tokens[:, 1:]).backward()
    return zppc.comm_stats().as_dict()


def in_flight_per_group(rank, world):
    """Collectives in flight in the final graphs of a GPT step on gloo (zero3 +
    hpZ on 2 x 2, small buckets): the most at once on any one process group;
    the most on one group where a gather beside a gather does not count
    (gathers are chained by the runtime, one hop in flight at a time); which
    of those groups are hop worlds (gathers', reductions'); how many gathers
    are issued while a reduction is in flight; and, counted as the step ran,
    the most of zppc's runtime collectives in flight at once on one gloo
    group (`hops_in_flight`)."""
    from zppc.runtime import compat
    from zppc.runtime.topology import two_hop_gather_over, two_hop_reduce_over

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = MODELS["gpt"]()
    config = zppc.Config(node_size=2, lowering="eager", hpz=True, bucket_bytes=20_000)
    zppc.distribute(net, config)
    step = torch.compile(net, backend="zppc")
    x, y = net.batch(0)
    with hops_in_flight(
        (compat, "all_gather_single"), (dist, "all_gather"), (dist, "all_to_all_single")
    ) as on_gloo:
        step(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    from zppc.passes.zero import PARAM_GATHER, find_collectives

    most, unchained, beside = {}, {}, 0
    for record in zppc.inspect(step).compiles:
        for kind, gm in record.final.items():
            pos = {n: i for i, n in enumerate(gm.graph.nodes)}
            matches = find_collectives(gm.graph)
            for m in matches:
                in_flight = [o for o in matches if pos[o.issue] <= pos[m.issue] < pos[o.wait]]
                on_group = [o for o in in_flight if o.group_name == m.group_name]
                key = (kind, m.group_name)
                most[key] = max(most.get(key, 0), len(on_group))
                beside_gathers = sum(
                    o.kind == m.kind == "all_gather" for o in on_group if o is not m
                )
                unchained[key] = max(unchained.get(key, 0), len(on_group) - beside_gathers)
                if m.wait.meta.get(PARAM_GATHER):
                    beside += any(not o.wait.meta.get(PARAM_GATHER) for o in in_flight)
    hop_worlds = {
        "gather": {name for _, name in most if two_hop_gather_over(name) is not None},
        "reduce": {name for _, name in most if two_hop_reduce_over(name) is not None},
    }
    return most, unchained, hop_worlds, beside, dict(on_gloo)


@contextlib.contextmanager
def hops_in_flight(*targets: tuple[object, str]):
    """Count, while open, the most collectives in flight at once per process
    group that the `(module, name)` targets (collectives taking `group=`)
    issued, from any thread: at each issue, the earlier asynchronous ones on
    that group whose futures are not yet done, plus itself. (Done-ness, not a
    completion callback: a callback added earlier may run after one added
    once the future completed.) Yields that dict."""
    most, issued, lock = {}, {}, threading.Lock()
    originals = [(module, name, getattr(module, name)) for module, name in targets]

    def counting(original):
        def counted(*args, group, async_op=False, **kwargs):
            key = group.group_name
            with lock:
                earlier = issued.setdefault(key, [])
                most[key] = max(most.get(key, 0), 1 + sum(not f.done() for f in earlier))
                if async_op:
                    work = original(*args, group=group, async_op=True, **kwargs)
                    earlier.append(work.get_future())
                    return work
            # A synchronous one blocks until it is done: outside the lock, so
            # callbacks issuing on other groups meanwhile are not held up.
            return original(*args, group=group, async_op=False, **kwargs)

        return counted

    for module, name, original in originals:
        setattr(module, name, counting(original))
    try:
        yield most
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def eager_collective_after_chained_gathers(rank, world):
    """Three gathers chained on the world group of one rank per node (a plain
    gloo group), then at once a synchronous eager all-gather over that group
    (`all_gather_flat`, as state dicts and an eager `unshard` issue), then the
    three waited. Returns whether every result is right and the most
    collectives in flight at once on the group, counted as each is issued."""
    import torch.distributed._functional_collectives as funcol
    from zppc.runtime import compat
    from zppc.runtime.collectives import all_gather_flat
    from zppc.runtime.topology import Topology, setup_groups

    groups = setup_groups(Topology(world, 1), timeout_s=120)
    torch.manual_seed(rank)
    shards = [torch.randn(n) for n in (400_001, 300_007, 200_003)]
    mine = torch.full((5,), float(rank))
    with hops_in_flight((compat, "all_gather_single")) as most:
        issued = [torch.ops.zppc.all_gather_in_place(s, groups.world) for s in shards]
        eager = all_gather_flat(mine, groups.world)
        gathered = [funcol.wait_tensor(t) for t in issued]
    right = torch.equal(eager, torch.arange(world).float().repeat_interleave(5))
    for shard, got in zip(shards, gathered, strict=True):
        expected = shard.new_empty(shard.numel() * world)
        dist.all_gather_into_tensor(expected, shard, group=dist.group.WORLD)
        right = right and torch.equal(got, expected)
    return right, most[groups.world]


def eager_collective_inside_a_chain(rank, world):
    """A chained collective over the world group of one rank per node (a
    plain gloo group) whose hop issues a synchronous eager all-gather over
    the same group: it would wait for the chain it runs in. Returns the error
    the chained collective's wait raises (None if it returned)."""
    import torch.distributed._functional_collectives as funcol
    from zppc.runtime.collectives import _chain_hops, all_gather_flat
    from zppc.runtime.topology import Topology, setup_groups

    groups = setup_groups(Topology(world, 1), timeout_s=120)
    out = torch.empty(world)

    def hop():
        return all_gather_flat(torch.ones(1), groups.world)

    _chain_hops(out, groups.world, [hop])
    try:
        funcol.wait_tensor(out)
    except RuntimeError as exc:
        return str(exc)
    return None


def two_hop_gathers(rank, world):
    """Every (size, dtype) case gathered over the hop world of a 2 x 2 topology
    (issued all at once, then waited in reverse: the second hops must still
    meet in order), each beside gloo's own all-gather over the world. Returns
    the cases that differ, the ledger's node-link count of one shard, and the
    most hops in flight at once on each hop group."""
    import torch.distributed._functional_collectives as funcol
    from zppc.runtime import compat
    from zppc.runtime.ledger import node_link_bytes
    from zppc.runtime.topology import Topology, gather_hops, setup_groups

    groups = setup_groups(Topology(world, 2))
    hops = gather_hops(groups.world)
    cases = [(n, dtype) for n in (1, 5, 1001) for dtype in ("float32", "bfloat16", "float16")]
    torch.manual_seed(rank)
    shards = [torch.randn(n).to(getattr(torch, dtype)) for n, dtype in cases]
    with hops_in_flight((compat, "all_gather_single"), (dist, "all_gather")) as most:
        issued = [torch.ops.zppc.all_gather_in_place(s, hops.world) for s in shards]
        gathered = [funcol.wait_tensor(t) for t in reversed(issued)][::-1]
    differ = []
    for case, shard, got in zip(cases, shards, gathered, strict=True):
        expected = shard.new_empty(shard.numel() * world)
        dist.all_gather_into_tensor(expected, shard, group=dist.group.WORLD)
        if not torch.equal(got, expected):
            differ.append(case)
    return differ, node_link_bytes("all_gather", hops.world, rank, 1), most


def two_hop_reduce_scatters(rank, world, node_size):
    """Every (size, dtype) case reduce-scattered over the reduction hop world
    of `node_size`-rank nodes (issued all at once, then waited in reverse: the
    second hops must still meet in order), against the sum in float64 of every
    rank's input (each rank makes all of them from their seeds). Returns the
    largest error relative to the sum's scale per case, the ledger's
    node-link count of one slice (in two hops against a direct exchange), and
    the most hops in flight at once on each hop group."""
    import torch.distributed._functional_collectives as funcol
    from zppc.runtime.ledger import node_link_bytes
    from zppc.runtime.topology import Topology, reduction_hops, setup_groups

    groups = setup_groups(Topology(world, node_size))
    hops = reduction_hops(groups.world)
    cases = [(n, dtype) for n in (1, 5, 1001) for dtype in ("float32", "bfloat16", "float16")]

    def flat_of(r, case):
        n, dtype = case
        generator = torch.Generator().manual_seed(1000 * r + n)
        return torch.randn(world * n, generator=generator).to(getattr(torch, dtype))

    with hops_in_flight((dist, "all_to_all_single")) as most:
        issued = [
            torch.ops.zppc.reduce_scatter_in_two_hops(flat_of(rank, case), hops.world)
            for case in cases
        ]
        reduced = [funcol.wait_tensor(t) for t in reversed(issued)][::-1]
    errors = {}
    for (n, dtype), got in zip(cases, reduced, strict=True):
        total = sum(flat_of(r, (n, dtype)).double() for r in range(world))
        expected = total.view(world, n)[rank]
        assert got.dtype == getattr(torch, dtype) and got.shape == (n,)
        errors[(n, dtype)] = ((got.double() - expected).abs().max() / total.abs().max()).item()
    return (
        errors,
        (
            node_link_bytes("reduce_scatter", hops.world, rank, 1),
            node_link_bytes("all_to_all", groups.world, rank, 1),
        ),
        most,
    )


def two_hop_failure_on_wait(rank, world):
    """Two two-hop gathers over a 2 x 2 topology's hop world, issued back to
    back, the second one's second hop failing as it is issued (on every rank,
    so none waits for another): returns whether the first gathered right and
    what waiting on the second raised (None if it returned)."""
    import torch.distributed._functional_collectives as funcol
    from zppc.runtime.topology import Topology, gather_hops, setup_groups

    hops = gather_hops(setup_groups(Topology(world, 2)).world)
    issued, original = [], dist.all_gather

    def second_hop(*args, **kwargs):
        issued.append(None)
        if len(issued) == 2:
            raise RuntimeError("injected failure of the second hop")
        return original(*args, **kwargs)

    dist.all_gather = second_hop
    try:
        first = torch.ops.zppc.all_gather_in_place(torch.full((3,), float(rank)), hops.world)
        second = torch.ops.zppc.all_gather_in_place(torch.ones(5), hops.world)
        gathered = funcol.wait_tensor(first)
        try:
            funcol.wait_tensor(second)
            raised = None
        except RuntimeError as exc:
            raised = str(exc)
    finally:
        dist.all_gather = original
    expected = torch.arange(world, dtype=torch.float32).repeat_interleave(3)
    return torch.equal(gathered, expected), raised


def two_hop_chain_stress(rank, world, rounds, per_round, seed):
    """Many two-hop gathers and reductions over a 2 x 2 topology's hop worlds,
    and gathers over its world group (a plain gloo group, chained in one hop),
    issued back to back in an order drawn from `seed` (the same on every
    rank), with compute between some of them, some waited at once and the
    rest of each round waited in a shuffled order: the chains of completion
    callbacks (`zppc.runtime.collectives._chain_hops`) find their
    predecessors unfinished as often as this machine allows. Every value is a
    small integer tagged with its collective, so a hop matched with another
    collective's shows. Returns the (round, index, kind) of results that
    differ, and the most hops in flight at once on each hop group."""
    import torch.distributed._functional_collectives as funcol
    from zppc.runtime import compat
    from zppc.runtime.topology import Topology, gather_hops, reduction_hops, setup_groups

    groups = setup_groups(Topology(world, 2))
    gathers, reductions = gather_hops(groups.world), reduction_hops(groups.world)
    draw = torch.Generator().manual_seed(seed)

    def chance(p: float) -> bool:
        return torch.rand(1, generator=draw).item() < p

    def tag_of(round_, k, r):
        return float((round_ * per_round + k) % 1000 * 8 + r)

    differ = []
    with hops_in_flight(
        (compat, "all_gather_single"), (dist, "all_gather"), (dist, "all_to_all_single")
    ) as most:
        for round_ in range(rounds):
            issued = []
            for k in range(per_round):
                n = int(torch.randint(1, 20_000, (1,), generator=draw))
                kind = ("gather", "plain gather", "reduce")[
                    int(torch.randint(3, (1,), generator=draw))
                ]
                if kind != "reduce":
                    # A parameter's shard, as the graphs gather it: it requires grad.
                    shard = torch.full((n,), tag_of(round_, k, rank), requires_grad=True)
                    over = gathers.world if kind == "gather" else groups.world
                    out = torch.ops.zppc.all_gather_in_place(shard, over)
                    expected = torch.cat(
                        [torch.full((n,), tag_of(round_, k, r)) for r in range(world)]
                    )
                else:
                    flat = torch.full((world * n,), tag_of(round_, k, rank))
                    out = torch.ops.zppc.reduce_scatter_in_two_hops(flat, reductions.world)
                    expected = torch.full((n,), sum(tag_of(round_, k, r) for r in range(world)))
                issued.append((k, kind, out, expected))
                if chance(0.3):
                    torch.randn(200, 200) @ torch.randn(200, 200)
                if chance(0.1):
                    funcol.wait_tensor(out)
            for i in torch.randperm(len(issued), generator=draw).tolist():
                k, kind, out, expected = issued[i]
                if not torch.equal(funcol.wait_tensor(out), expected):
                    differ.append((round_, k, kind))
    return differ, most


def measure_links_on_ranks(rank, world, node_size, inter_per_node, message_bytes):
    """This rank's `measure_links` as a dict, or the ValueError it raised."""
    import dataclasses

    from zppc.measure import measure_links

    try:
        measured = measure_links(message_bytes, 2, node_size, inter_per_node)
    except ValueError as exc:
        return f"ValueError: {exc}"
    # Still in step: every rank measured, and the world group carries on.
    dist.barrier()
    return dataclasses.asdict(measured)


def measure_compute_on_ranks(rank, world, dtype_name):
    """This rank's `measure_compute` as a dict, with the median seconds of
    five more matrix products and adds of the probes' sizes (into outputs
    allocated once, as the probes write) this rank timed itself (the ranks
    again at once), or the ValueError it raised."""
    import dataclasses
    import statistics
    import time

    from zppc.measure import ELEMENTWISE_BYTES, MATMUL_SIDE, measure_compute

    try:
        measured = measure_compute(getattr(torch, dtype_name), 3)
    except ValueError as exc:
        return f"ValueError: {exc}"
    side = MATMUL_SIDE["cpu"]
    a, b, product = torch.randn(side, side), torch.randn(side, side), torch.empty(side, side)
    x = torch.ones(ELEMENTWISE_BYTES // 4)
    y = torch.empty_like(x)

    def median_seconds(run) -> float:
        run()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    dist.barrier()
    matmul = median_seconds(lambda: torch.mm(a, b, out=product))
    add = median_seconds(lambda: torch.add(x, 1, out=y))
    dist.barrier()
    return dataclasses.asdict(measured), matmul, add


def measure_cost_model_on_ranks(rank, world, node_size):
    """This rank's `measure_cost_model` (links as each node's shared link) as
    a dict."""
    import dataclasses

    from zppc.measure import measure_cost_model

    model = measure_cost_model(node_size=node_size, inter_per_node=True, message_bytes=2**18)
    dist.barrier()
    return dataclasses.asdict(model)
