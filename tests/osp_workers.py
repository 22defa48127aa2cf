"""Rank functions for tests/test_osp.py, and the reference they are compared with."""

from __future__ import annotations

import copy
import hashlib

import torch
from models import OddMLP

import zppc

STEPS = 10


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def osp_training(rank, world, runs, lowering="eager", steps=STEPS, tmp=None, clip=None):
    """For each run (strategy, optimizer, osp_lgp, micro-batches per step, how
    training ends[, other Config fields as (name, value) pairs]): `steps`
    compiled steps of OddMLP with OSP (F=0.5 unless set) on this rank's slice of the batch. Training ends with `zppc.synchronize` ("sync"),
    a forward under `torch.no_grad()` ("no_grad"), one in eval mode ("eval")
    or `zppc.save` ("save"). Returns the initial parameters, the stage-2 set,
    this rank's parameters before and after the end, a digest of the latter,
    and the ledger of the last step. `clip`: `zppc.clip_grad_norm_` to this
    max norm before each step (the norms returned are kept)."""
    out = {}
    for run in runs:
        strategy, optimizer, lgp, micro, finish, *fields = run
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = OddMLP()
        init = {n: p.detach().clone() for n, p in net.named_parameters()}
        settings = dict(strategy=strategy, osp=0.5, osp_lgp=lgp, lowering=lowering)
        config = zppc.Config(**settings | dict(*fields))
        zppc.distribute(net, config)
        opt = make_optimizer(optimizer, net.parameters())
        step = torch.compile(net, backend="zppc")
        norms = []
        for t in range(steps):
            zppc.reset_comm_stats()
            x, y = OddMLP.batch(t, 4 * world * micro)
            for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
                step(xs.chunk(world)[rank], ys.chunk(world)[rank]).backward()
            if clip is not None:
                norms.append(zppc.clip_grad_norm_(net.parameters(), clip).item())
            opt.step()
            opt.zero_grad()
        comm = zppc.comm_stats().as_dict()
        local = {n: p.to_local().detach().clone() for n, p in net.named_parameters()}
        if finish == "sync":
            zppc.synchronize(net)
        elif finish == "no_grad":
            with torch.no_grad():
                step(x, y)
        elif finish == "eval":
            net.eval()
            step(x, y)
        else:
            zppc.save(net, opt, f"{tmp}/{strategy}-{optimizer}-{lgp}")
        params = {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}
        digest = hashlib.sha256(b"".join(params[n].numpy().tobytes() for n in sorted(params)))
        out[run] = {
            "init": init,
            "stage2": sorted(net._zppc_state.osp.stage2),
            "local_before_sync": local,
            "params": params,
            "digest": digest.hexdigest(),
            "comm": comm,
            "residuals": sorted(net._zppc_state.qgz_residuals),
            "compiles": len(net._zppc_state.compiles),
            "norms": norms,
        }
    return out


def reference(
    init, strategy, optimizer, lgp, micro, stage2, world, steps=STEPS, stage2_from=0, clip=None
):
    """OSP's semantics on plain tensors, one model copy per rank (no zppc): the
    parameters every rank holds after `steps` steps and the final completion.

    A stage-2 parameter steps with the gradient its owner computed: for a
    replicated one (ddp, or a 0-dim parameter) each rank's own; for a zero3
    shard, rows from the rank that owns them (dim 0 chunked like torch.chunk).
    With LGP, before each step the previous step of the stage-2 parameters is
    redone from the values saved before it, with the global mean gradient;
    without, each step uses the previous iteration's mean (none at step 0).
    `micro` micro-batches per step accumulate into one gradient. An empty
    `stage2` is synchronous training; steps before `stage2_from` are too.

    `clip`: every gradient of a step is scaled by min(1, clip / (norm +
    1e-6)), the norm taken over the gradients the ranks hold at that point:
    the global mean of stage 1, and of stage 2 the local gradient, sharded
    ones as their owners' rows, replicated ones (differing per rank) by the
    mean over ranks of their squared norms. The global mean of a stage-2
    gradient, when it lands, is scaled by its own step's coefficient."""
    models = []
    for _ in range(world):
        m = OddMLP()
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(init[n])
        models.append(m)
    opts = [make_optimizer(optimizer, m.parameters()) for m in models]
    params = [dict(m.named_parameters()) for m in models]
    saved = [None] * world  # per rank: stage-2 values and optimizer state before the step
    previous_mean = None

    def step_with(r, grads):
        for n, p in params[r].items():
            p.grad = grads.get(n)
        opts[r].step()

    def redo(r, mean):
        values, states = saved[r]
        with torch.no_grad():
            for n in stage2:
                params[r][n].copy_(values[n])
                opts[r].state[params[r][n]] = states[n]
        step_with(r, {n: mean[n] for n in stage2})

    for t in range(steps):
        deferred = stage2 if t >= stage2_from else []
        local = local_gradients(models, t, world, micro)
        mean = {n: sum(g[n] for g in local) / world for n in local[0]}
        if clip is not None:
            coefficient = _clip_coefficient(clip, mean, local, deferred, strategy, world)
            local = [{n: g * coefficient for n, g in grads.items()} for grads in local]
            mean = {n: g * coefficient for n, g in mean.items()}
        for r in range(world):
            grads = {n: mean[n] for n in mean if n not in deferred}
            if lgp:
                if saved[r] is not None:
                    redo(r, previous_mean)
                saved[r] = (
                    (
                        {n: params[r][n].detach().clone() for n in deferred},
                        {n: copy.deepcopy(opts[r].state.get(params[r][n], {})) for n in deferred},
                    )
                    if deferred
                    else None
                )
                grads.update({n: _owned(local, r, n, strategy, world) for n in deferred})
            elif previous_mean is not None:
                grads.update({n: previous_mean[n] for n in deferred})
            step_with(r, grads)
        # The mean of a step's stage 2, which the next step applies.
        previous_mean = mean if deferred else None
    for r in range(world):
        if not stage2:
            continue
        if lgp:
            redo(r, previous_mean)
        else:
            step_with(r, {n: previous_mean[n] for n in stage2})
    return [{n: p.detach().clone() for n, p in params[r].items()} for r in range(world)]


def _clip_coefficient(clip, mean, local, deferred, strategy, world) -> float:
    square = sum(g.pow(2).sum() for n, g in mean.items() if n not in deferred)
    for n in deferred:
        if strategy == "ddp" or mean[n].dim() == 0:
            square += sum(g[n].pow(2).sum() for g in local) / world
        else:
            square += _owned(local, 0, n, strategy, world).pow(2).sum()
    return min(1.0, clip / (square.sqrt().item() + 1e-6))


def local_gradients(models, t: int, world: int, micro: int) -> list[dict]:
    """Each rank's gradient at step t (rank r's model on rank r's slice)."""
    x, y = OddMLP.batch(t, 4 * world * micro)
    local = []
    for r, m in enumerate(models):
        m.zero_grad()
        for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
            m(xs.chunk(world)[r], ys.chunk(world)[r]).backward()
        local.append({n: p.grad.clone() for n, p in m.named_parameters()})
    return local


def magnitude_choice(init, world, fraction=0.5) -> list[str]:
    """The stage-2 set `osp_split="magnitude"` must pick: the parameters whose
    step-0 global mean gradient has the smallest root-mean-square, as many as
    bring their bytes closest to `fraction` of all (at least one)."""
    model = OddMLP()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(init[n])
    local = local_gradients([model] * world, 0, world, 1)
    mean = {n: sum(g[n] for g in local) / world for n in local[0]}
    rms = {n: (g.pow(2).mean() ** 0.5).item() for n, g in mean.items()}
    budget = fraction * sum(g.numel() for g in mean.values())
    chosen, taken = [], 0
    for n in sorted(rms, key=rms.get):
        if chosen and abs(taken + mean[n].numel() - budget) >= abs(taken - budget):
            break
        chosen.append(n)
        taken += mean[n].numel()
    return sorted(chosen)


def _owned(local, r, name, strategy, world):
    """The local gradient rank r's copy of parameter `name` steps with."""
    grad = local[r][name]
    if strategy == "ddp" or grad.dim() == 0:
        return grad
    rows = -(-grad.shape[0] // world)
    return torch.cat([local[k][name][k * rows : (k + 1) * rows] for k in range(world)])


def torch_clip_with_replicated_stage2(rank, world):
    """ddp with OSP, clipped by torch's own clip_grad_norm_: what the first
    optimizer step raises."""
    torch.manual_seed(0)
    net = OddMLP()
    zppc.distribute(net, zppc.Config(strategy="ddp", osp=0.5, lowering="eager"))
    opt = make_optimizer("sgd", net.parameters())
    step = torch.compile(net, backend="zppc")
    x, y = OddMLP.batch(0, 4 * world)
    step(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
    try:
        opt.step()
    except ValueError as exc:
        zppc.synchronize(net)  # nothing may stay in flight on a group
        return str(exc)
    return None
