"""OSP (arXiv 2306.16926): two-stage gradient synchronization with
local-gradient parameter correction (LGP), zppc's definition.

The `osp` pass turns the reductions of the gradients produced last in backward
(a fraction `Config.osp` of the gradient bytes) into `zppc::osp_issue`: the
reduction is issued asynchronously on a side group and left in flight past the
end of the graph, and the parameter receives this rank's own gradient (for a
zero* shard: this rank's slice of its local gradient) in its place. Stage 1,
the rest, is reduced in the graph as always.

At each optimizer step on a model's parameters (a global step pre-hook; the
step is not in the compiled graph), for the stage-2 parameters in that
optimizer:

- LGP (`osp_lgp=True`): the step of the previous iteration, taken with local
  gradients, is redone now that its global gradient has landed: the saved
  values before that step (parameter, optimizer state, the group's settings)
  come back and the optimizer steps them with the gradient the step used plus
  (global mean - local) of every reduction of that iteration. Then this step's
  pre-step values are saved, and this step uses the local gradients. So only
  one forward and backward ever sees parameters moved by local gradients.
- Stale (`osp_lgp=False`): this step uses the global gradient of the previous
  iteration (none at the first step: the stage-2 parameters do not move).

`synchronize` completes everything pending (an LGP redo, or the stale step
still owed), so every rank then holds the synchronous-equivalent values.

With `Config.qgz`, a stage-2 bucket is reduced as the `qgz` pass reduces
stage 1 (reordered, quantized, an intra-node all-to-all, summed in fp32,
requantized, a cross-node all-to-all, summed: the mean over the world), on
side groups of its own. The hops chain, so they are issued at two points: the
intra-node hop by the backward, the cross-node hop by the next forward (or by
whatever needs the result first), which waits for the first hop after it has
had the optimizer step to finish. ddp then gathers the shards back, when the
result is needed.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from zppc.kernels import qgz as qgz_kernels
from zppc.kernels.quant import FORMAT_BITS, PayloadLayout
from zppc.runtime import compat
from zppc.runtime.collectives import all_gather_flat, bytes_per_peer
from zppc.runtime.failures import wait_for, waiting_on
from zppc.runtime.ledger import record
from zppc.runtime.topology import group_ranks, side_node_groups

_GROUP_FROM_NAME = dist.distributed_c10d._resolve_process_group


@dataclass
class Reduction:
    """One stage-2 bucket's collective, issued by a backward and not yet waited."""

    work: dist.Work
    total: Tensor
    """Receives the sum over ranks (this rank's shards for zero2/3, the whole
    bucket otherwise)."""
    mode: str
    group_name: str
    direct: bool = False
    """`total` holds every rank's slice for this rank (an all-to-all, see
    `OspState.reduce_scatter` "all_to_all"), to be summed here."""
    _mean: Tensor | None = None

    def mean(self) -> Tensor:
        """This rank's part of the bucket's global mean, in fp32 (waits once)."""
        if self._mean is None:
            wait_for(
                [self.work], f"OSP's stage-2 reduction over ranks {group_ranks(self.group_name)}"
            )
            group = _GROUP_FROM_NAME(self.group_name)
            total = self.total
            if self.direct:
                total = total.view(group.size(), -1).float().sum(0)
            if self.mode == "zero1":
                total = total.view(group.size(), -1)[dist.get_rank(group)]
            self._mean = total.float() / group.size()
            self.total = None
        return self._mean


@dataclass(frozen=True)
class TwoHops:
    """How stage 2 reduces a bucket in two hops: with qgZ (`Config.qgz`), or
    unquantized where stage 1's reduce-scatters take two hops."""

    intra_group: str
    cross_group: str
    """Side groups: this rank's node, and the ranks of its local rank on every node."""
    intra_quant: dict | None
    """`block` and `bits` of the intra-node hop (None: unquantized: no qgZ, or `qgz_quantize=False`)."""
    cross_quant: dict | None
    residuals: dict[str, Tensor] | None
    """`qgz_error_feedback`: the model's residual store (what each hop's
    quantization lost at the previous step, added before the next one)."""


def two_hops_for(
    config, topology, residuals: dict[str, Tensor], stage1_in_two_hops: bool
) -> TwoHops | None:
    """Stage 2's two hops for a model with `config`: qgZ's, or unquantized
    where stage 1 reduce-scatters in two hops (gloo, several nodes of several
    ranks); None otherwise. Collective: it creates the side groups."""
    if config.qgz is None and not stage1_in_two_hops:
        return None

    def quant(fmt: str | None) -> dict | None:
        if fmt is None or not config.qgz_quantize:
            return None
        return dict(block=config.qgz_block_size, bits=FORMAT_BITS[fmt])

    intra, cross = side_node_groups(topology, config.timeout_s)
    if config.qgz is None:
        return TwoHops(intra, cross, None, None, None)
    return TwoHops(
        intra,
        cross,
        quant(config.qgz_intra_node),
        quant(config.qgz),
        residuals if config.qgz_error_feedback else None,
    )


@dataclass
class TwoHopReduction:
    """One stage-2 bucket reduced in two hops: the same interface as
    `Reduction`, plus `advance`, which waits for the first hop and issues the
    second. Both are issued from the thread that calls: no completion
    callback is left pending when the process exits with a reduction in
    flight (one issuing a hop from gloo's thread then aborted the process)."""

    hops: TwoHops
    key: str
    """The bucket's parameter names: its error-feedback residuals' key (the same on every rank)."""
    world_group: str
    """For ddp's gather of the shards back."""
    ddp_layout: list[tuple[int, int]] | None
    """ddp: (numel, columns) of each gradient in the rank-major rows, in order."""
    wire_dtype: torch.dtype = torch.float32
    """What unquantized hops send (the gradients' reduce dtype): sums
    accumulate in fp32 and round to it once per hop, as stage 1's."""
    _pending: tuple | None = None
    """(work or None, received, peers, numel, quant, group) of the hop in flight."""
    _hop: int = 0
    _mean: Tensor | None = None

    def issue(self, rank_major: Tensor) -> None:
        """Start the intra-node hop of `rank_major` ([world, S]: row r is what
        rank r owns, already divided by the world size, fp32)."""
        nodes, per_node = self._sizes()
        rows = qgz_kernels.reorder_for_two_hops(rank_major.reshape(-1), nodes, per_node)
        self._start(self.hops.intra_group, self.hops.intra_quant, rows, "intra")
        self._hop = 1

    def advance(self) -> None:
        """After the intra-node hop: its node sums go to the cross-node hop."""
        if self._hop != 1:
            return
        nodes, _ = self._sizes()
        node_sums = self._finish()
        self._start(
            self.hops.cross_group, self.hops.cross_quant, node_sums.view(nodes, -1), "inter"
        )
        self._hop = 2

    def mean(self) -> Tensor:
        if self._mean is None:
            self.advance()
            shard = self._finish()
            self._mean = shard if self.ddp_layout is None else self._gathered(shard)
        return self._mean

    def _sizes(self) -> tuple[int, int]:
        """(nodes, ranks per node)."""
        nodes = _GROUP_FROM_NAME(self.hops.cross_group).size()
        return nodes, _GROUP_FROM_NAME(self.hops.intra_group).size()

    def _start(self, group_name: str, quant: dict | None, rows: Tensor, hop: str) -> None:
        peers, numel = rows.shape
        if peers == 1:  # a group of one: nothing to send
            self._pending = (None, rows.reshape(-1), 1, numel, None, group_name)
            return
        if quant is None:
            payload = rows.to(self.wire_dtype).contiguous()
        elif self.hops.residuals is None:
            payload = qgz_kernels.quantize_rows(rows, **quant)
        else:
            key = f"osp:{self.key}:{hop}"
            residual = self.hops.residuals.get(key)
            if residual is not None and residual.shape == rows.shape:
                rows = rows + residual
            payload = qgz_kernels.quantize_rows(rows, **quant)
            sent = qgz_kernels.dequantize_rows(payload, peers, numel, **quant)
            self.hops.residuals[key] = rows - sent
        received = torch.empty_like(payload)
        group = _GROUP_FROM_NAME(group_name)
        work = dist.all_to_all_single(
            received.view(-1), payload.view(-1), group=group, async_op=True
        )
        record("all_to_all", group_name, bytes_per_peer("all_to_all", payload, peers))
        self._pending = (work, received, peers, numel, quant, group_name)

    def _finish(self) -> Tensor:
        """The fp32 sum of the rows the hop in flight received, [numel]."""
        work, received, peers, numel, quant, group_name = self._pending
        self._pending = None
        if work is None:
            return received
        wait_for([work], f"OSP's stage-2 qgZ all-to-all over ranks {group_ranks(group_name)}")
        if quant is None:
            return qgz_kernels.exact_sum(received, peers)
        return qgz_kernels.dequantize_sum(received, peers, numel, **quant)

    def _gathered(self, shard: Tensor) -> Tensor:
        """ddp: every rank's shard of the mean, back in the bucket's order of whole gradients."""
        rows = all_gather_flat(shard, self.world_group).view(-1, shard.numel())
        pieces, column = [], 0
        for numel, columns in self.ddp_layout:
            pieces.append(rows[:, column : column + columns].reshape(-1)[:numel])
            column += columns
        return torch.cat(pieces)


@dataclass
class InFlight:
    """One parameter's part of a stage-2 reduction."""

    reduction: Reduction | TwoHopReduction
    offset: int
    local: Tensor
    """What the backward gave the parameter instead: this rank's own gradient
    (scaled as the gradient was, by `zppc.clip_grad_norm_`)."""
    scale: Tensor | None = None
    """The clipping coefficient `zppc.clip_grad_norm_` applied to the local
    gradient; the global mean gets the same (None: 1)."""

    def mean(self) -> Tensor:
        flat = self.reduction.mean()[self.offset : self.offset + self.local.numel()]
        mean = flat.view(self.local.shape)
        return mean if self.scale is None else mean * self.scale

    def rescale(self, coefficient: Tensor) -> None:
        """The parameter's gradient was multiplied by `coefficient` (a clip):
        the local copy is, by the same operation (so that the two stay equal
        to the bit), and so will the global mean be."""
        self.local.mul_(coefficient)
        self.scale = coefficient if self.scale is None else self.scale * coefficient

    def wait(self) -> None:
        self.reduction.mean()


def _wait_all(in_flight: list[InFlight]) -> None:
    """Complete reductions whose result is not needed (never leave one behind)."""
    for f in in_flight:
        f.wait()


def _global_mean(in_flight: list[InFlight]) -> Tensor:
    return sum(f.mean() for f in in_flight)


def _corrected(grad: Tensor, in_flight: list[InFlight]) -> Tensor:
    """`grad` (what a step used, or what the backwards left) with each local
    gradient replaced by its global mean: sum of means + (grad - sum of
    locals). The second term is exactly zero when nothing changed the
    gradient in between, so ranks end with bit-identical results."""
    local = sum(f.local.float() for f in in_flight)
    return (_global_mean(in_flight) + (grad.float() - local)).to(grad.dtype)


@dataclass
class TakenStep:
    """An optimizer step a stage-2 parameter took with its local gradient, and
    what redoing it needs."""

    optimizer: weakref.ref
    value: Tensor
    """The flat shard before the step."""
    state: dict
    """The parameter's optimizer state before the step (copies)."""
    grad: Tensor
    """The flat gradient the step used."""
    settings: dict
    """Its param group's settings (lr, ...) at that step."""
    in_flight: list[InFlight]


@dataclass
class OspState:
    """One model's stage-2 bookkeeping on this rank."""

    index: int
    """The model's index among `distribute` calls (the same on every rank)."""
    lgp: bool
    group_name: str
    """The side group stage 2 runs on."""
    model_state: weakref.ref
    """The model's `DistributedState`."""
    stage2: set[str] = field(default_factory=set)
    """Parameters whose gradients some compiled backward defers to stage 2."""
    in_flight: dict[str, list[InFlight]] = field(default_factory=dict)
    """Reductions issued since the last optimizer step, by parameter."""
    taken: dict[str, TakenStep] = field(default_factory=dict)
    """LGP: steps taken with local gradients, to redo."""
    owed: dict[str, tuple[weakref.ref, list[InFlight]]] = field(default_factory=dict)
    """Stale: the reductions the next step (or `synchronize`) applies, with the
    optimizer that stepped the parameter last."""
    split: str = "last"
    """`Config.osp_split`."""
    magnitudes: dict[str, float] | None = None
    """`osp_split="magnitude"`: each parameter's gradient RMS at the first
    optimizer step (global, so the same on every rank); None until then."""
    plan: int = 0
    """Bumped when the stage-2 choice changes (once magnitudes are measured):
    graphs compiled for an older plan are compiled again."""
    two_hops: TwoHops | None = None
    """Stage 2 reduces in two hops on side node groups: quantized with
    `Config.qgz`, else unquantized where stage 1 reduce-scatters in two hops."""
    reduce_scatter: str = "native"
    """zero2/3 without qgZ: how stage 2's reduce-scatters run, `Config.reduce_scatter`
    resolved for the side group as the `reduce_scatter` pass resolves it for
    stage 1: "native", "all_to_all" (exchanged directly and summed here) or
    "two_hop" (`two_hops` set)."""
    first_hops: list[TwoHopReduction] = field(default_factory=list)
    """Two-hop reductions whose cross-node hop is not issued yet, in issue order."""

    def advance(self) -> None:
        """Issue the cross-node hop of every two-hop reduction that took its
        intra-node hop, in the order they were issued (the same on every rank:
        each side group sees its collectives in one order)."""
        for reduction in self.first_hops:
            reduction.advance()
        self.first_hops.clear()

    def measure(self) -> None:
        """`osp_split="magnitude"`: every parameter's gradient RMS over its
        elements, from the gradients this step will use (all synchronous: no
        stage 2 before magnitudes exist). Collective: a sharded gradient's
        sum of squares is added over the world, so every rank holds the same
        values and every rank's next compile picks the same stage 2."""
        state = self.model_state()
        names = [fqn for fqn in sorted(state.specs) if state.shard(fqn).grad is not None]
        squares = torch.tensor(
            [state.shard(fqn).grad.detach().float().pow(2).sum() for fqn in names]
        )
        group = _GROUP_FROM_NAME(state.groups.world)
        with waiting_on(f"OSP's gradient measurement over ranks {group_ranks(state.groups.world)}"):
            dist.all_reduce(squares, group=group)
        self.magnitudes = {}
        for fqn, total in zip(names, squares.tolist(), strict=True):
            spec = state.specs[fqn]
            replicas = group.size() if spec.mode == "ddp" else 1  # each rank added it whole
            self.magnitudes[fqn] = (total / replicas / spec.numel) ** 0.5
        self.plan += 1

    def holds_any(self, held: set[int]) -> bool:
        """Whether the optimizer whose parameter ids are `held` steps any of this model's."""
        state = self.model_state()
        return state is not None and any(id(state.parameter(f)) in held for f in state.specs)

    def stage2_in(self, held: set[int]) -> list[str]:
        """The stage-2 parameters among `held` (ids of an optimizer's parameters)."""
        state = self.model_state()
        if state is None:
            return []
        return [fqn for fqn in sorted(self.stage2) if id(state.parameter(fqn)) in held]

    def before_step(self, optimizer: torch.optim.Optimizer, ours: list[str]) -> None:
        """`ours`: the stage-2 parameters `optimizer` steps."""
        self.check_replicas_unchanged(ours)
        self.advance()
        state = self.model_state()
        if self.lgp:
            self._redo([fqn for fqn in ours if fqn in self.taken])
            for fqn in ours:
                in_flight = self.in_flight.pop(fqn, [])
                if in_flight and state.parameter(fqn).grad is not None:
                    self.taken[fqn] = _take_snapshot(optimizer, state, fqn, in_flight)
                else:  # no step for it (a skipped step): nothing to redo
                    _wait_all(in_flight)
            return
        for fqn in ours:
            _, owed = self.owed.pop(fqn, (None, []))
            flat, param = state.shard(fqn), state.parameter(fqn)
            if owed and param.grad is not None:
                with torch.no_grad():
                    flat.grad.copy_(_global_mean(owed))
            else:  # nothing global yet (first step), or no step: it does not move
                param.grad = None
                _wait_all(owed)
            self.owed[fqn] = (weakref.ref(optimizer), self.in_flight.pop(fqn, []))

    def check_replicas_unchanged(self, fqns: list[str]) -> None:
        """A replicated stage-2 gradient (ddp, 0-dim parameters) holds this
        rank's own values. If something scaled it since the backward without
        telling zppc (`torch.nn.utils.clip_grad_norm_`: each rank by its own
        norm, which its local gradients enter), every other gradient was
        scaled by a coefficient that differs across ranks too, and the
        replicas would drift apart for good. Raised on every rank alike (each
        ran the same code), before any collective of this step."""
        state = self.model_state()
        for fqn in fqns:
            in_flight, grad = self.in_flight.get(fqn), state.shard(fqn).grad
            if state.specs[fqn].mode != "ddp" or not in_flight or grad is None:
                continue
            if not torch.equal(grad, sum(f.local for f in in_flight)):
                raise ValueError(
                    f"the gradient of {fqn!r}, a replicated parameter whose reduction OSP "
                    "defers (stage 2), changed between backward and the optimizer step: "
                    "torch.nn.utils.clip_grad_norm_ clips each rank by a norm of its own "
                    "local gradients, and the ranks' parameters would drift apart; use "
                    "zppc.clip_grad_norm_(model.parameters(), max_norm), which clips every "
                    "rank alike"
                )

    def synchronize(self) -> None:
        """Complete every pending stage-2 reduction and what it owes."""
        self.advance()
        state = self.model_state()
        if self.lgp:
            self._redo(sorted(self.taken))
        else:
            by_optimizer: dict[int, tuple[torch.optim.Optimizer, dict[str, Tensor]]] = {}
            for fqn, (optimizer_ref, owed) in sorted(self.owed.items()):
                optimizer = optimizer_ref()
                if owed and optimizer is not None:
                    grads = by_optimizer.setdefault(id(optimizer), (optimizer, {}))[1]
                    grads[fqn] = _global_mean(owed).to(state.shard(fqn).dtype)
            self.owed.clear()
            for optimizer, grads in by_optimizer.values():
                _step_only(optimizer, state, grads, settings=None)
        # Backwards run since the last step: their gradients become global ones.
        for fqn, in_flight in sorted(self.in_flight.items()):
            flat = state.shard(fqn)
            if flat.grad is not None:
                with torch.no_grad():
                    flat.grad.copy_(_corrected(flat.grad, in_flight))
            else:
                _wait_all(in_flight)
        self.in_flight.clear()

    def _redo(self, fqns: list[str]) -> None:
        """LGP's correction of the steps `fqns` took with local gradients."""
        state = self.model_state()
        by_optimizer: dict[int, list[tuple[str, TakenStep]]] = {}
        for fqn in fqns:
            taken = self.taken.pop(fqn)
            if taken.optimizer() is not None:
                by_optimizer.setdefault(id(taken.optimizer()), []).append((fqn, taken))
        for items in by_optimizer.values():
            optimizer = items[0][1].optimizer()
            grads, settings = {}, {}
            for fqn, taken in items:
                flat, param = state.shard(fqn), state.parameter(fqn)
                grads[fqn] = _corrected(taken.grad, taken.in_flight)
                with torch.no_grad():
                    flat.copy_(taken.value)
                if taken.state:
                    optimizer.state[param] = taken.state
                else:
                    optimizer.state.pop(param, None)
                settings[fqn] = taken.settings
            _step_only(optimizer, state, grads, settings)


def _group_of(optimizer: torch.optim.Optimizer, param: Tensor) -> dict:
    return next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))


def _settings(group: dict) -> dict:
    return {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}


def _take_snapshot(optimizer, state, fqn: str, in_flight: list[InFlight]) -> TakenStep:
    flat, param = state.shard(fqn), state.parameter(fqn)
    saved = {
        k: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v)
        for k, v in optimizer.state.get(param, {}).items()
    }
    return TakenStep(
        optimizer=weakref.ref(optimizer),
        value=flat.detach().clone(),
        state=saved,
        grad=flat.grad.detach().clone(),
        settings=_settings(_group_of(optimizer, param)),
        in_flight=in_flight,
    )


# Set while zppc steps an optimizer on a subset of parameters: zppc's own step
# hooks (this one, the non-finite check) stay out of that step.
_STEPPING_SUBSET = [False]


def stepping_subset() -> bool:
    return _STEPPING_SUBSET[0]


def _step_only(optimizer, state, grads: dict[str, Tensor], settings: dict[str, dict] | None):
    """One optimizer step on the parameters `grads` names, with those gradients
    (flat), the other parameters' gradients hidden; `settings`: the param group
    settings each parameter's step uses (None: the current ones)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    hidden = [(p, p.grad) for p in params]
    current = [_settings(group) for group in optimizer.param_groups]
    for p in params:
        p.grad = None
    for fqn, grad in grads.items():
        param = state.parameter(fqn)
        param.grad = state.specs[fqn].as_dtensor(grad, state.mesh, dist.get_rank())
        if settings is not None:
            _group_of(optimizer, param).update(settings[fqn])
    _STEPPING_SUBSET[0] = True
    try:
        optimizer.step()
    finally:
        _STEPPING_SUBSET[0] = False
        for group, saved in zip(optimizer.param_groups, current, strict=True):
            group.update(saved)
        for p, grad in hidden:
            p.grad = grad


# Model index -> its OSP state, while the model's `DistributedState` (which
# holds it) lives.
_REGISTRY: weakref.WeakValueDictionary[int, OspState] = weakref.WeakValueDictionary()


def register(osp: OspState) -> None:
    _REGISTRY[osp.index] = osp


def before_optimizer_step(optimizer, args, kwargs) -> None:
    """Global optimizer step pre-hook (see the module doc): for each model with
    stage-2 parameters in `optimizer`. Runs before every step of every
    optimizer, so it reads the optimizer's parameters once."""
    if stepping_subset() or not _REGISTRY:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for osp in list(_REGISTRY.values()):
        if osp.split == "magnitude" and osp.magnitudes is None and osp.holds_any(held):
            osp.measure()
        ours = osp.stage2_in(held)
        if ours:
            osp.before_step(optimizer, ours)


@torch.library.custom_op("zppc::osp_issue", mutates_args=())
def osp_issue(
    grads: list[Tensor],
    model: int,
    fqns: str,
    shard_numels: list[int],
    mode: str,
    reduce_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
) -> list[Tensor]:
    """Issue one stage-2 reduction for a bucket of gradients (each what
    `zppc::reduce_grad` would reduce) and return this rank's own gradient for
    each, in the shape `reduce_grad` returns. `fqns`: the parameters' names,
    one per line (an op schema has no list of strings)."""
    osp = _REGISTRY[model]
    group = _GROUP_FROM_NAME(osp.group_name)
    world, rank = group.size(), dist.get_rank(group)
    gs = [g.detach() if reduce_dtype is None else g.detach().to(reduce_dtype) for g in grads]
    if mode == "ddp":
        send = torch.cat([g.reshape(-1) for g in gs])
        sizes = [g.numel() for g in gs]
        locals_ = [g.detach().to(out_dtype, copy=True) for g in grads]
    else:
        # Rank-major, so the reduce-scatter hands each rank its shards side by side.
        send = _rank_major(gs, shard_numels, world).reshape(-1)
        sizes = list(shard_numels)
        mine = send.view(world, -1)[rank].split(sizes)
        locals_ = [piece.to(out_dtype, copy=True) for piece in mine]
    if osp.two_hops is not None:
        reduction = _issue_two_hops(osp, gs, fqns, shard_numels, mode, send, world)
    else:
        reduction = _issue_one(osp, send, sum(sizes), mode, world)
    offset = 0
    for fqn, size, local in zip(fqns.split("\n"), sizes, locals_, strict=True):
        # The gradient returned may become the parameter's `.grad` itself,
        # which later backwards accumulate into: the record keeps a copy.
        part = InFlight(reduction, offset, local.clone())
        osp.in_flight.setdefault(fqn, []).append(part)
        offset += size
    return locals_


def _issue_one(osp: OspState, send: Tensor, numel: int, mode: str, world: int) -> Reduction:
    group = _GROUP_FROM_NAME(osp.group_name)
    kind = _reduction_kind(mode, osp.reduce_scatter)
    if kind == "all_to_all":
        total = torch.empty_like(send)
        work = dist.all_to_all_single(total, send, group=group, async_op=True)
    elif kind == "reduce_scatter":
        total = send.new_empty(numel)
        work = compat.reduce_scatter_single(total, send, group=group, async_op=True)
    else:
        total = send
        work = dist.all_reduce(total, group=group, async_op=True)
    record(kind, osp.group_name, bytes_per_peer(kind, send, world))
    return Reduction(work, total, mode, osp.group_name, direct=kind == "all_to_all")


def _issue_two_hops(osp, grads, fqns, shard_numels, mode, send, world) -> TwoHopReduction:
    """qgZ: the intra-node hop of `send` (rank-major), or for ddp of the
    gradients laid out rank-major here (each padded to a multiple of the world)."""
    layout = None
    if mode == "ddp":
        columns = _ddp_columns(grads, world)
        layout = [(g.numel(), n) for g, n in zip(grads, columns, strict=True)]
        send = _rank_major(grads, columns, world)
    reduction = TwoHopReduction(osp.two_hops, fqns, osp.group_name, layout, send.dtype)
    # Divided first, as the qgz pass does: the two sums are then the mean.
    reduction.issue(send.view(world, -1).float() / world)
    osp.first_hops.append(reduction)
    return reduction


def _rank_major(grads: list[Tensor], columns: list[int], world: int) -> Tensor:
    """[world, sum(columns)]: row r holds every gradient's slice for rank r
    (gradient i padded to world x columns[i])."""
    return torch.cat(
        [
            torch.nn.functional.pad(g.reshape(-1), (0, n * world - g.numel())).view(world, n)
            for g, n in zip(grads, columns, strict=True)
        ],
        dim=1,
    )


def _ddp_columns(grads: list[Tensor], world: int) -> list[int]:
    """ddp gradients are whole: each rank's slice of them for the two hops."""
    return [-(-g.numel() // world) for g in grads]


def stage2_points(node) -> list:
    """The schedule points of an `osp_issue` node: what its reduction sends
    (with qgZ, each hop, and ddp's gather of the shards back)."""
    from zppc.schedule import SchedulePoint

    grads, model, _fqns, shard_numels, mode, reduce_dtype, _out = node.args
    vals = [g.meta["val"] for g in grads]
    osp = _REGISTRY[model]
    world = _GROUP_FROM_NAME(osp.group_name).size()
    dtype = reduce_dtype or vals[0].dtype

    def point(kind, group_name, sent, unquantized=None):
        return SchedulePoint(node, None, kind, group_name, sent, unquantized, stage=2)

    hops = osp.two_hops
    if hops is None:
        numel = sum(v.numel() for v in vals) if mode == "ddp" else sum(shard_numels) * world
        sent = torch.empty(numel, dtype=dtype, device="meta")
        return [point(_reduction_kind(mode, osp.reduce_scatter), osp.group_name, sent)]
    if mode == "ddp":
        shard_numels = _ddp_columns(vals, world)
    columns = sum(shard_numels)
    points, numel = [], world * columns
    for group_name, quant in (
        (hops.intra_group, hops.intra_quant),
        (hops.cross_group, hops.cross_quant),
    ):
        peers = _GROUP_FROM_NAME(group_name).size()
        numel //= peers  # what each destination gets: a node's share, then a shard
        if peers == 1:
            continue
        if quant is None:
            sent = torch.empty(peers, numel, dtype=dtype, device="meta")
        else:
            nbytes = PayloadLayout(numel, quant["block"], quant["bits"]).nbytes
            sent = torch.empty(peers, nbytes, dtype=torch.uint8, device="meta")
        points.append(point("all_to_all", group_name, sent, numel * dtype.itemsize))
    if mode == "ddp":
        points.append(point("all_gather", osp.group_name, torch.empty(columns, device="meta")))
    return points


def _reduction_kind(mode: str, reduce_scatter: str) -> str:
    """zero2/3 keep only their shard of the mean (reduce-scattered, in one
    collective or two hops, or exchanged directly and summed here); ddp and
    zero1 need it whole."""
    if mode not in ("zero2", "zero3"):
        return "all_reduce"
    return "all_to_all" if reduce_scatter == "all_to_all" else "reduce_scatter"


@osp_issue.register_fake
def _(grads, model, fqns, shard_numels, mode, reduce_dtype, out_dtype):
    if mode == "ddp":
        return [g.new_empty(g.shape, dtype=out_dtype) for g in grads]
    return [g.new_empty(n, dtype=out_dtype) for g, n in zip(grads, shard_numels, strict=True)]


# It issues a collective: never dropped or merged with another call.
torch.fx.node.has_side_effect(torch.ops.zppc.osp_issue.default)
