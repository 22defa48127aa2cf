"""`zppc.distribute`: turn an ordinary model into one whose parameters are shards.

The parameter model is FSDP2's: after `distribute`, `model.named_parameters()`
yields the original names, each a `DTensor` of the original global shape,
sharded on dim 0 over the world (`Shard(0)`, chunked like `torch.chunk`) or
replicated (ddp, and 0-dim parameters). The optimizer, `clip_grad_norm_`,
state dicts and `nn.init` work on those as they do on FSDP2's.

Underneath, each rank's piece lives in a *flat shard*: a padded 1-D tensor of
`rows_per_rank x row_numel` elements, the same size on every rank, which the
DTensor's local tensor is a view of. Inside a forward, a module attribute reads
`zppc::unshard(flat_shard)` (the IR the backend lowers; eagerly a real gather);
outside a forward it returns the DTensor and runs no collective. The flat
shard's gradient is published as the DTensor's `.grad` (a view, so an optimizer
step or an in-place `zero_grad` reaches both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._pytree import tree_map_only

import zppc.ir  # noqa: F401  (registers zppc::unshard / zppc::reduce_grad)
import zppc.runtime.rtp  # noqa: F401  (registers the RTP ring ops)
from zppc import flyweight
from zppc.config import (
    Config,
    bucket_cap_for_block,
    qualified_name,
    repeated_block_bytes,
    repeated_blocks,
)
from zppc.runtime import compat
from zppc.runtime.collectives import all_gather_ints, broadcast_from_first
from zppc.runtime.grad_sync import GradSync, gathered, new_grad_sync
from zppc.runtime.osp import OspState, before_optimizer_step, stepping_subset, two_hops_for
from zppc.runtime.osp import register as register_osp
from zppc.runtime.topology import (
    TWO_HOPS_NEED,
    Groups,
    Topology,
    default_node_size,
    device_type,
    ensure_lanes,
    has_hop_groups,
    lane_count,
    setup_groups,
    side_world_group,
    world_group,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSpec:
    """How one logical parameter is stored: all ranks hold the same spec.

    zero*: dim 0 is split in chunks of `rows_per_rank` rows (rank r holds rows
    [r*R, (r+1)*R), the last ranks fewer or none, as `torch.chunk` and
    `Shard(0)` split), each stored flat and padded to `shard_numel`. So the
    all-gather of the flat shards is the flattened parameter followed by
    padding. ddp: the "shard" is the whole parameter.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    world_size: int
    mode: str
    group_name: str
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def rows_per_rank(self) -> int:
        return -(-self.shape[0] // self.world_size)

    @property
    def shard_numel(self) -> int:
        """Elements per rank, padding included (the same on every rank)."""
        if self.mode == "ddp":
            return self.numel
        return self.rows_per_rank * self.row_numel

    def valid_rows(self, rank: int) -> int:
        return max(0, min(self.rows_per_rank, self.shape[0] - rank * self.rows_per_rank))

    def valid_numel(self, rank: int) -> int:
        """Elements of `rank`'s shard that are real (the rest is padding)."""
        if self.mode == "ddp":
            return self.numel
        return self.valid_rows(rank) * self.row_numel

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of `rank`'s piece of the DTensor."""
        if self.mode == "ddp":
            return self.shape
        return (self.valid_rows(rank), *self.shape[1:])

    @property
    def placements(self) -> tuple:
        return (Replicate(),) if self.mode == "ddp" else (Shard(0),)

    def shard_of(self, full: Tensor, rank: int) -> Tensor:
        """This rank's flat padded piece of the full tensor (what `distribute` stores)."""
        if self.mode == "ddp":
            return full.detach().clone()
        flat = full.detach().reshape(-1)
        padded = torch.nn.functional.pad(flat, (0, self.shard_numel * self.world_size - self.numel))
        return padded[rank * self.shard_numel : (rank + 1) * self.shard_numel].clone()

    def as_dtensor(self, flat: Tensor, mesh: DeviceMesh, rank: int) -> DTensor:
        """The DTensor whose local tensor is a view of `flat` (a flat shard or its
        gradient): writes to either reach the other."""
        local = flat if self.mode == "ddp" else flat[: self.valid_numel(rank)]
        return DTensor.from_local(
            local.view(self.local_shape(rank)),
            mesh,
            self.placements,
            run_check=False,
            shape=torch.Size(self.shape),
            stride=_contiguous_strides(self.shape),
        )


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass
class DistributedState:
    """What `distribute` did to a model; kept on the model as `_zppc_state`."""

    config: Config
    topology: Topology
    groups: Groups
    mesh: DeviceMesh
    """1-D mesh over the world, on which every parameter DTensor lives."""
    specs: dict[str, ShardSpec] = field(default_factory=dict)
    owners: dict[str, list[tuple[nn.Module, str]]] = field(default_factory=dict)
    flat_shards: dict[str, nn.Parameter] = field(default_factory=dict)
    """The padded storage under each DTensor parameter: what the compiled graphs
    take as inputs and the IR gathers."""
    compiles: list = field(default_factory=list)
    """`CompileRecord`s of every graph compiled from this model (for `zppc.inspect`)."""
    grad_sync: GradSync = field(default_factory=new_grad_sync)
    """Whether backwards reduce gradients now, and those deferred while not
    (`zppc.no_sync`)."""
    block_bytes: int = 0
    """Gathered bytes of the model's largest repeated block, 0 without one
    (`zppc.config.repeated_block_bytes`): what `Config.keep_last_block` keeps,
    and what `block_bucket_bytes` derives from."""
    block_classes: frozenset[str] = frozenset()
    """Qualified names of the model's repeated-block classes
    (`zppc.config.repeated_blocks`): default-sized buckets end where one of
    their instances does (`zppc.passes.bucket`)."""
    skipped_steps: int = 0
    """Optimizer steps skipped for non-finite gradients (`Config.nonfinite_grads`)."""
    model_ref: Any = None
    """Weak reference to the distributed model (its buffers are found from it)."""
    osp: OspState | None = None
    """OSP's stage-2 bookkeeping (`Config.osp` set)."""
    ring_group: str | None = None
    """RTP's ring (strategy "rtp"): a group of its own over the world, so that
    its point-to-point transfers never share a gloo connection with a
    collective in flight on the world group (a replicated parameter's
    gradient all-reduce)."""
    qgz_residuals: dict[str, Tensor] = field(default_factory=dict)
    """qgZ error feedback: this rank's quantization error per compile, bucket and
    hop, added before the next step's quantization (saved by `zppc.save`)."""

    @property
    def block_bucket_bytes(self) -> int:
        """The bucket cap `Config.bucket_bytes=None` stands for
        (`zppc.config.bucket_cap_for_block` of `block_bytes`)."""
        return bucket_cap_for_block(self.block_bytes)

    @property
    def node_mesh(self) -> DeviceMesh | None:
        """2-D (node, local) mesh whose groups carry the intra- and cross-node
        collectives (None when `world_size % node_size != 0`)."""
        return self.groups.mesh

    def buffer_ids(self) -> set[int]:
        model = self.model_ref() if self.model_ref is not None else None
        return set() if model is None else {id(b) for b in model.buffers()}

    def shard(self, fqn: str) -> nn.Parameter:
        return self.flat_shards[fqn]

    def parameter(self, fqn: str) -> nn.Parameter:
        """The DTensor parameter users see under `fqn`."""
        module, name = self.owners[fqn][0]
        return module._parameters[name]

    def free_dropped_grads(self) -> None:
        """Free each flat shard's gradient whose DTensor `.grad` the user dropped
        (`zero_grad()` sets it to None): called as a forward starts, eager or
        compiled. Left to the next backward, every such gradient (a shard's
        worth per parameter, the whole model's over the world) stays alive
        through the forward and most of the backward, where activations peak;
        FSDP2 frees it at `zero_grad`."""
        for fqn, flat in self.flat_shards.items():
            if flat.grad is not None and self.parameter(fqn).grad is None:
                flat.grad = None


# Flat shard or DTensor parameter -> state of the model that owns it; the backend
# uses it to find the Config of the model it is compiling from the graph's
# example inputs. Keyed by id (tensors compare elementwise, so they cannot be
# dict keys); the weak reference tells a live entry from a recycled id.
_STATE_OF_SHARD: dict[int, tuple[weakref.ref, DistributedState]] = {}


def state_of_shard(t: object) -> DistributedState | None:
    entry = _STATE_OF_SHARD.get(id(t))
    if entry is None or entry[0]() is not t:
        return None
    return entry[1]


def live_states() -> list[DistributedState]:
    """States of the distributed models whose shards are still alive, each once."""
    alive = {id(state): state for ref, state in list(_STATE_OF_SHARD.values()) if ref() is not None}
    return list(alive.values())


def state_of(model: nn.Module) -> DistributedState | None:
    return getattr(model, "_zppc_state", None)


def _check_two_hop_reductions(config: Config, topology: Topology) -> None:
    """`Config.reduce_scatter="two_hop"` where its hop groups will exist."""
    from zppc.passes import planned_backend

    if config.reduce_scatter != "two_hop":
        return
    backend = planned_backend() or dist.get_backend()
    if not has_hop_groups(topology, backend):
        raise ValueError(
            f"{TWO_HOPS_NEED}, got {backend} with world_size {topology.world_size} and node_size "
            f"{topology.node_size}"
        )


def distribute(model: nn.Module, config: Config | None = None) -> nn.Module:
    """Shard `model` in place over the default process group; returns it.

    Every check runs before the first collective, so a bad model or config
    raises the same error on every rank instead of hanging some of them.
    """
    config = config or Config()
    if not isinstance(model, nn.Module):
        raise TypeError(f"zppc.distribute takes an nn.Module, got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "zppc.distribute needs an initialized torch.distributed process group "
            "(launch with torchrun and call torch.distributed.init_process_group first)"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        node_size = _node_size(config, world)
        if node_size > world:
            raise ValueError(f"node_size ({node_size}) is larger than world_size ({world})")
        if (config.hpz or config.qgz) and world % node_size:
            raise ValueError(f"hpz/qgz need world_size % node_size == 0, got {world} % {node_size}")
        _check_two_hop_reductions(config, Topology(world_size=world, node_size=node_size))
        _check_model(model)
        local_error = None
    except ValueError as exc:
        node_size = config.node_size or default_node_size(world)
        local_error = exc
    # First collective: every rank reaches it, whatever its own checks found, so
    # that disagreeing ranks are named instead of left waiting for each other.
    check_agreement(config, node_size, model, local_error)

    topology = Topology(world_size=world, node_size=node_size)
    groups = setup_groups(topology, config.mesh, config.timeout_s)
    setup_lanes(config, topology, groups)
    mesh = DeviceMesh.from_group(world_group(groups), device_type())

    state = DistributedState(
        config=config,
        topology=topology,
        groups=groups,
        mesh=mesh,
        model_ref=weakref.ref(model),
        block_bytes=repeated_block_bytes(model, config.param_dtype),
        block_classes=frozenset(qualified_name(type(m)) for m in repeated_blocks(model)),
    )
    if config.osp is not None:
        from zppc.passes.reduce_scatter import algorithm_for

        # Stage 2 runs on side groups, a world group and (for its two hops,
        # with qgZ or where stage 1 takes two hops) node groups of its own.
        stage1 = algorithm_for(config.reduce_scatter, groups.world)
        side_group = side_world_group(topology, config.timeout_s)
        two_hops = two_hops_for(config, topology, state.qgz_residuals, stage1 == "two_hop")
        state.osp = OspState(
            index=state.grad_sync.index,
            lgp=config.osp_lgp,
            split=config.osp_split,
            group_name=side_group,
            model_state=weakref.ref(state),
            two_hops=two_hops,
            # The side world group has no hop groups: "two_hop" is `two_hops`.
            reduce_scatter=(
                stage1 if stage1 == "two_hop" else algorithm_for(config.reduce_scatter, side_group)
            ),
        )
        register_osp(state.osp)
    if config.strategy == "rtp":
        state.ring_group = side_world_group(topology, config.timeout_s)
    by_param: dict[int, str] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in list(module.named_parameters(recurse=False)):
            fqn = f"{module_name}.{name}" if module_name else name
            if id(param) not in by_param:
                by_param[id(param)] = fqn
                state.specs[fqn] = ShardSpec(
                    fqn=fqn,
                    shape=tuple(param.shape),
                    dtype=param.dtype,
                    world_size=world,
                    # A 0-dim tensor has no dim 0 to split: it is replicated.
                    mode=config.strategy if param.dim() > 0 else "ddp",
                    group_name=groups.world,
                    param_dtype=config.param_dtype,
                    reduce_dtype=config.reduce_dtype,
                )
                state.owners[fqn] = []
            state.owners[by_param[id(param)]].append((module, name))
    if config.strategy == "rtp":
        for fqn, spec in state.specs.items():
            mode = "rtp" if rotatable(spec, state.owners[fqn]) else "ddp"
            state.specs[fqn] = dataclasses.replace(spec, mode=mode)

    # Module by module: a real module's values are rank 0's; a meta-device
    # module is materialized shard by shard from rank 0's random stream
    # (flyweight), so that no rank ever holds its full weights.
    first_owner = {id(module): [] for module, _ in (o[0] for o in state.owners.values())}
    for fqn, owners in state.owners.items():
        first_owner[id(owners[0][0])].append(fqn)
    stream = _init_stream(model)
    for _, module in model.named_modules():
        owned = {
            state.owners[fqn][0][1]: state.specs[fqn] for fqn in first_owner.get(id(module), ())
        }
        shards = _materialize_meta(module, stream, owned, rank)
        _broadcast_from_rank0(module)
        for fqn in first_owner.get(id(module), ()):
            spec = state.specs[fqn]
            name = state.owners[fqn][0][1]
            param = module._parameters[name]
            shard = shards[name] if name in shards else spec.shard_of(param.data, rank)
            flat = nn.Parameter(shard, requires_grad=param.requires_grad)
            with torch.no_grad():
                dparam = nn.Parameter(
                    spec.as_dtensor(flat.detach(), mesh, rank), requires_grad=param.requires_grad
                )
            for owner, name in state.owners[fqn]:
                _replace_with_property(owner, name, flat, dparam, spec, state.grad_sync)
            if flat.requires_grad:
                _publish_grads(flat, dparam, spec, mesh, rank)
            state.flat_shards[fqn] = flat
            for t in (flat, dparam):
                _STATE_OF_SHARD[id(t)] = (weakref.ref(t), state)
    if stream is not None and rank == 0:
        torch.set_rng_state(stream.get_state())  # as if rank 0 had initialized alone
    _mark_forwards(model, config.param_dtype, state)
    if config.buffer_sync == "broadcast":
        _broadcast_buffers_after_forward(model, groups.world)
    _guard_optimizers()
    model._zppc_state = state
    return model


# RTP's rotated weights: the `rtp` pass rewrites their uses into ring loops.
# Module type -> the names of its weights that it applies with `F.linear` or
# `F.embedding` (nn.MultiheadAttention projects its inputs with `F.linear`,
# packed or one weight each for query, key and value).
ROTATED_WEIGHTS: dict[type, tuple[str, ...]] = {
    nn.Linear: ("weight",),
    nn.Embedding: ("weight",),
    nn.MultiheadAttention: ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"),
}


def _rotated_weight_names(module: nn.Module) -> tuple[str, ...]:
    for kind, names in ROTATED_WEIGHTS.items():
        if isinstance(module, kind):
            return names
    # Hugging Face's Conv1D (GPT-2) applies `addmm(bias, x, weight)`; known
    # by name, so that zppc never imports transformers itself.
    if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers."):
        return ("weight",)
    return ()


def rotatable(spec: ShardSpec, owners: list[tuple[nn.Module, str]]) -> bool:
    """Whether RTP rotates this parameter: a 2-D weight that every module
    holding it applies as a linear's, an embedding's or a Conv1D's weight (a
    GPT's tied embedding and output head). Anything else is replicated. A use
    the `rtp` pass cannot rewrite after all still reads the gathered weight
    (correct, at zero3's memory for that weight)."""
    return len(spec.shape) == 2 and all(
        name in _rotated_weight_names(module) for module, name in owners
    )


# Optimizers that compute statistics over a whole tensor with in-place ops that
# DTensor cannot run on a sharded one (Adafactor's column mean of a Shard(0)
# gradient is a pending sum across ranks, which `square_` cannot take in place):
# refused when they are given sharded zppc parameters, at construction.
PER_TENSOR_OPTIMIZERS = ("Adafactor",)
_GUARD_INSTALLED = [False]


def _guard_optimizers() -> None:
    if _GUARD_INSTALLED[0]:
        return
    for name in PER_TENSOR_OPTIMIZERS:
        cls = getattr(torch.optim, name, None)
        if cls is not None:
            cls.add_param_group = _refusing_sharded(cls.add_param_group)
    register_optimizer_step_pre_hook(_prefer_foreach)
    register_optimizer_step_pre_hook(_skip_nonfinite_steps)
    register_optimizer_step_pre_hook(before_optimizer_step)
    register_optimizer_step_post_hook(_restore_skipped_grads)
    _GUARD_INSTALLED[0] = True


def _refusing_sharded(add_param_group):
    """`add_param_group` of a per-tensor optimizer, raising before a sharded zppc
    parameter joins (the constructor adds its groups through it)."""

    @functools.wraps(add_param_group)
    def checked(optimizer, param_group: dict) -> None:
        params = param_group["params"]
        if not isinstance(params, (Tensor, set)):  # a set: torch's own error follows
            params = param_group["params"] = list(params)
        if isinstance(params, Tensor):
            params = [params]
        if any(_is_sharded_zppc_parameter(p) for p in params):
            raise ValueError(
                f"{type(optimizer).__name__} computes per-tensor statistics that sharded "
                f"zppc parameters cannot provide in place; use strategy='ddp' for it, or "
                f"an elementwise optimizer (SGD, Adam, AdamW, ...)"
            )
        add_param_group(optimizer, param_group)

    return checked


def _is_sharded_zppc_parameter(p: object) -> bool:
    return (
        isinstance(p, DTensor) and state_of_shard(p) is not None and p.placements != (Replicate(),)
    )


def _prefer_foreach(optimizer, args, kwargs) -> None:
    """Before an optimizer steps on zppc parameters, use the multi-tensor
    (foreach) implementation where the user left the choice to torch. torch
    already picks it on GPUs; on CPU it would pick the per-tensor loop, and each
    DTensor op pays a dispatch (a gpt-small AdamW step: 66 ms per-tensor, 20 ms
    foreach, 14 ms before parameters were DTensors)."""
    ours = any(
        isinstance(p, DTensor) and state_of_shard(p) is not None
        for group in optimizer.param_groups
        for p in group["params"]
    )
    if not ours:
        return
    for group in optimizer.param_groups:
        left_to_torch = "foreach" in group and group["foreach"] is None
        if left_to_torch and not group.get("fused") and not group.get("differentiable"):
            group["foreach"] = True


# Optimizer -> the gradients it was stepping with, hidden while a step is skipped.
_HIDDEN_GRADS: dict[int, list[tuple[Tensor, Tensor]]] = {}


def _skip_nonfinite_steps(optimizer, args, kwargs) -> None:
    """Before a step on zppc parameters: refuse gradients still deferred by
    `no_sync` (they would be lost); then, if any rank holds an inf or NaN in the
    model's gradients, every rank skips the step (its gradients are hidden from
    the optimizer until the step returns) or raises, as `Config.nonfinite_grads`
    says. One all-gather of a flag per model decides it, so ranks never differ."""
    if stepping_subset():  # OSP redoing a step: these gradients were checked
        return
    states = {
        id(state): state
        for group in optimizer.param_groups
        for state in map(state_of_shard, group["params"])
        if state is not None
    }
    for state in states.values():
        if state.grad_sync.deferred:
            raise ValueError(
                "zppc: optimizer step with gradients still deferred by zppc.no_sync; run the "
                "last micro-batch's backward with gradient sync on before stepping"
            )
        if state.config.nonfinite_grads is None:
            continue
        bad_ranks, names = _nonfinite_gradients(state)
        if not bad_ranks:
            continue
        where = (
            f"non-finite gradients on ranks {bad_ranks} (this rank: {', '.join(names) or 'none'})"
        )
        if state.config.nonfinite_grads == "raise":
            raise FloatingPointError(f"zppc: {where}; Config(nonfinite_grads='raise')")
        warnings.warn(f"zppc: skipping this optimizer step on every rank: {where}", stacklevel=3)
        state.skipped_steps += 1
        hidden = [
            (p, p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        for p, _ in hidden:
            p.grad = None
        _HIDDEN_GRADS[id(optimizer)] = hidden
        return


def _restore_skipped_grads(optimizer, args, kwargs) -> None:
    for p, grad in _HIDDEN_GRADS.pop(id(optimizer), ()):
        p.grad = grad


def _nonfinite_gradients(state: DistributedState) -> tuple[list[int], list[str]]:
    """(ranks whose gradient shards hold an inf or NaN, this rank's parameters with one)."""
    named = [(fqn, f.grad) for fqn, f in state.flat_shards.items() if f.grad is not None]
    names = []
    if named:
        # The largest magnitude per tensor: inf and NaN survive it, finite values cannot overflow.
        peaks = torch._foreach_norm([g for _, g in named], float("inf"))
        # One device-to-host copy for every tensor, not one per tensor.
        finite = torch.stack([peak.float() for peak in peaks]).isfinite().tolist()
        names = [fqn for (fqn, _), ok in zip(named, finite, strict=True) if not ok]
    device = next((f.device for f in state.flat_shards.values()), torch.device("cpu"))
    flags = torch.zeros(state.topology.world_size, dtype=torch.int32, device=device)
    mine = torch.tensor([int(bool(names))], dtype=torch.int32, device=flags.device)
    all_gather_ints(flags, mine, state.groups.world)
    return [r for r, flag in enumerate(flags.tolist()) if flag], names


def _node_size(config: Config, world: int) -> int:
    """Ranks per node: from the user's mesh (its last dim), else `node_size`,
    else LOCAL_WORLD_SIZE."""
    if config.mesh is None:
        return config.node_size or default_node_size(world)
    mesh = config.mesh
    if mesh.size() != world:
        raise ValueError(f"Config.mesh has {mesh.size()} ranks, the world has {world}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"Config.mesh must be 1-D or 2-D (nodes x ranks per node), got {mesh.ndim}-D"
        )
    if mesh.mesh.flatten().tolist() != list(range(world)):
        raise ValueError(
            "Config.mesh must list ranks in order (node n holds ranks n*node_size ...), "
            f"got {mesh.mesh.tolist()}"
        )
    node_size = mesh.size(mesh.ndim - 1) if mesh.ndim == 2 else world
    if config.node_size is not None and config.node_size != node_size:
        raise ValueError(
            f"Config.node_size={config.node_size} disagrees with Config.mesh ({node_size} ranks per node)"
        )
    return node_size


# How many forwards of distributed modules are running (eager execution): while
# one is, a parameter attribute is the gathered tensor, otherwise the DTensor.
_FORWARDS_RUNNING = [0]


def _mark_forwards(
    model: nn.Module, param_dtype: torch.dtype | None, state: DistributedState
) -> None:
    """Hooks that tell attribute reads inside a forward from reads outside one,
    free the gradients `zero_grad` dropped as the model's forward starts (the
    backend does it for compiled graphs), and cast floating-point inputs to
    `param_dtype` at the model's entry (as FSDP2's
    MixedPrecisionPolicy(cast_forward_inputs=True) does)."""

    def enter(module, args):
        if not torch.compiler.is_compiling():
            if module is model:
                state.free_dropped_grads()
            _FORWARDS_RUNNING[0] += 1

    def leave(module, args, output):
        if not torch.compiler.is_compiling():
            _FORWARDS_RUNNING[0] -= 1

    for module in model.modules():
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
    if param_dtype is not None:

        def cast_inputs(module, args, kwargs):
            def cast(t: Tensor) -> Tensor:
                return t.to(param_dtype) if t.is_floating_point() else t

            return tree_map_only(Tensor, cast, (args, kwargs))

        model.register_forward_pre_hook(cast_inputs, with_kwargs=True, prepend=True)


def _broadcast_buffers_after_forward(model: nn.Module, group_name: str) -> None:
    """Uncompiled forwards: after each forward, rank 0's values of the model's
    persistent buffers (those in its state dict: BatchNorm's statistics and
    counters) replace every rank's. Version counters cannot tell which ones a
    forward changed (BatchNorm's CPU kernel writes its statistics without
    bumping them), and non-persistent ones (masks, rotary tables) are
    constants. Compiled graphs broadcast exactly the buffers they write (the
    `sync_buffers` pass), so this hook steps aside for them."""

    def after(module, args, output):
        if torch.compiler.is_compiling():
            return
        seen: dict[int, Tensor] = {}
        for m in model.modules():
            for name, b in m._buffers.items():
                if b is not None and name not in m._non_persistent_buffers_set:
                    seen.setdefault(id(b), b)
        if seen:
            broadcast_from_first(list(seen.values()), group_name)

    model.register_forward_hook(after)


def _publish_grads(flat: nn.Parameter, dparam: nn.Parameter, spec: ShardSpec, mesh, rank) -> None:
    """Make the flat shard's gradient the DTensor parameter's `.grad` (a view of
    it). A gradient the user dropped (`zero_grad()` sets `.grad = None`) is
    dropped on the flat shard too before the next one accumulates."""

    def before_accumulate(grad: Tensor) -> Tensor:
        if dparam.grad is None:
            flat.grad = None
        return grad

    def after_accumulate(flat: Tensor) -> None:
        if flat.grad is None:  # a backward under `no_sync` gave the shard nothing
            return
        with torch.no_grad():
            dparam.grad = spec.as_dtensor(flat.grad, mesh, rank)

    flat.register_hook(before_accumulate)
    flat.register_post_accumulate_grad_hook(after_accumulate)


# Config fields that change nothing another rank can see.
LOCAL_ONLY_FIELDS = ("log_passes",)


def fingerprint(config: Config, node_size: int, model: nn.Module) -> dict[str, str]:
    """What every rank must hold identically: each Config field, the resolved
    node size, and the model's parameters and buffers (name, shape, dtype,
    requires_grad) as one digest."""
    fields = {
        f"Config.{f.name}": repr(getattr(config, f.name))
        for f in dataclasses.fields(config)
        if f.name not in LOCAL_ONLY_FIELDS
    }
    fields["node_size in effect"] = str(node_size)
    structure = [
        (kind, name, tuple(t.shape), str(t.dtype), t.requires_grad)
        for kind, named in (
            ("parameter", model.named_parameters()),
            ("buffer", model.named_buffers()),
        )
        for name, t in named
    ]
    fields["model structure"] = hashlib.sha256(repr(structure).encode()).hexdigest()[:16]
    return fields


def setup_lanes(config: Config, topology: Topology, groups: Groups) -> None:
    """The gloo lanes the `lanes` pass spreads collectives over, for `config`'s
    prefetch depth (collective; nothing where the pass is disabled)."""
    if "lanes" not in config.disable_passes:
        ensure_lanes(topology, groups, lane_count(config.prefetch), config.timeout_s)


def check_agreement(
    config: Config, node_size: int, model: nn.Module, local_error: ValueError | None
) -> None:
    """One small all-gather: raise the same ValueError on every rank if ranks
    hold different Configs, node sizes or models (naming the field and which
    ranks hold which value), or if any rank's own checks failed."""
    mine = {
        "fields": fingerprint(config, node_size, model),
        "error": local_error and str(local_error),
    }
    everyone: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    differences = []
    for key in everyone[0]["fields"]:
        holders: dict[str, list[int]] = {}
        for r, theirs in enumerate(everyone):
            holders.setdefault(theirs["fields"].get(key, "<missing>"), []).append(r)
        if len(holders) > 1:
            described = "; ".join(f"{v} on ranks {rs}" for v, rs in holders.items())
            differences.append(f"{key}: {described}")
    if differences:
        raise ValueError(
            "zppc.distribute: ranks disagree, so their collectives would not match: "
            + " | ".join(differences)
        )
    errors = {r: e["error"] for r, e in enumerate(everyone) if e["error"]}
    if errors:
        first = min(errors)
        raise ValueError(
            errors[first] if len(set(errors.values())) == 1 else f"rank {first}: {errors[first]}"
        )


_UNSUPPORTED = (nn.RNNBase,)


def _check_model(model: nn.Module) -> None:
    if state_of(model) is not None:
        raise ValueError("this model was already passed to zppc.distribute")
    for name, module in model.named_modules():
        if isinstance(module, _UNSUPPORTED):
            raise ValueError(
                f"zppc cannot shard {type(module).__name__} at {name!r}: it reads its weights "
                f"through flat buffers, not attributes"
            )
    _check_meta(model)
    devices = {p.device.type for p in model.parameters()} - {"meta"}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device type, found {sorted(devices)}")
    for name, p in model.named_parameters():
        if p.is_sparse or not p.is_floating_point():
            raise ValueError(
                f"parameter {name!r} must be a dense floating-point tensor, got {p.dtype}"
            )


def _own_tensors(module: nn.Module) -> list[Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def _check_meta(model: nn.Module) -> None:
    """A meta-device module must be able to initialize itself, and must not share
    a parameter it does not own first (materializing would untie it)."""
    first_seen: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        own = _own_tensors(module)
        for t in own:
            first_seen.setdefault(id(t), module)
        mine = [t for t in own if t.is_meta and first_seen[id(t)] is module]
        if not mine:
            continue  # nothing of its own to materialize (shared tensors come sharded)
        if not hasattr(module, "reset_parameters"):
            raise ValueError(
                f"module {name!r} ({type(module).__name__}) is on the meta device and has no "
                f"reset_parameters() to initialize it"
            )
        if any(first_seen[id(t)] is not module for t in own):
            raise ValueError(
                f"module {name!r} is on the meta device and shares a parameter owned by an earlier "
                f"module; build tied models on a real device or tie only whole parameters of "
                f"self-initializing modules"
            )


def _init_stream(model: nn.Module) -> torch.Generator | None:
    """For a model with tensors on the meta device: a generator holding rank
    0's random state (one broadcast), from which every rank draws its shards
    as rank 0 alone would have drawn the whole model. None otherwise, and
    under the fake process group, where shards stay on meta."""
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.is_meta for t in tensors) or dist.get_backend() == "fake":
        return None
    state = torch.get_rng_state().to(device_type())
    dist.broadcast(state, src=0)
    stream = torch.Generator()
    stream.set_state(state.cpu())
    return stream


@contextlib.contextmanager
def _drawing_from(stream: torch.Generator):
    """The global CPU generator continues `stream` (for code that draws from
    the global one); `stream` continues from where it stopped."""
    saved = torch.get_rng_state()
    torch.set_rng_state(stream.get_state())
    try:
        yield
    finally:
        stream.set_state(torch.get_rng_state())
        torch.set_rng_state(saved)


def _materialize_meta(
    module: nn.Module, stream: torch.Generator | None, owned: dict[str, ShardSpec], rank: int
) -> dict[str, Tensor]:
    """Real values for a meta-device module's own tensors (checked beforehand
    by `_check_meta`; tensors it shares are sharded by now): its buffers and
    replicated parameters whole, and for each sharded parameter of `owned`
    (name -> spec) only this rank's flat shard, returned by name. A module
    whose initialization `flyweight` cannot replay is materialized whole
    from the same stream (same values) and returns nothing."""
    names = [name for name, t in _own_named_tensors(module) if t.is_meta]
    if not names or stream is None:
        return {}
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        ops = flyweight.record_init(module, names)
    except flyweight.Unsupported as exc:
        logger.info("zppc: %s is materialized whole: %s", type(module).__name__, exc)
        module.to_empty(device=device, recurse=False)
        with torch.no_grad(), _drawing_from(stream):
            module.reset_parameters()
        return {}
    ranges = {}
    for name in names:
        t = getattr(module, name)
        spec = owned.get(name)
        start, end = 0, t.numel()
        if spec is not None and spec.mode != "ddp":
            start = rank * spec.shard_numel
            end = start + spec.valid_numel(rank)
        ranges[name] = (t.shape, t.dtype, start, end)
    kept = flyweight.replay(ops, ranges, stream)
    shards = {}
    for name, values in kept.items():
        spec = owned.get(name)
        if name in module._buffers:
            module._buffers[name] = values.view(ranges[name][0]).to(device)
        elif spec is None or spec.mode == "ddp":
            shards[name] = values.view(ranges[name][0]).to(device)
        else:
            shards[name] = F.pad(values, (0, spec.shard_numel - values.numel())).to(device)
    return shards


def _own_named_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


@torch.no_grad()
def _broadcast_from_rank0(module: nn.Module) -> None:
    """One flat broadcast per dtype of a module's own tensors, so that every rank
    starts from rank 0's values (shards already taken are left alone)."""
    tensors = [t for t in _own_tensors(module) if not isinstance(t, DTensor) and not t.is_meta]
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        group = by_dtype[dtype]
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.broadcast(flat, src=0)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def _replace_with_property(
    module: nn.Module,
    name: str,
    flat: nn.Parameter,
    dparam: nn.Parameter,
    spec: ShardSpec,
    grad_sync: GradSync,
) -> None:
    module._parameters[name] = dparam
    module.__dict__["_zppc_sync"] = grad_sync
    module.__dict__.setdefault("_zppc_specs", {})[name] = spec
    module.__dict__.setdefault("_zppc_flat", {})[name] = flat
    cls = type(module)
    if not getattr(cls, "_zppc_owned", False):
        # A class of its own per instance (as torch.nn.utils.parametrize does), so
        # that properties never leak onto other instances of the user's class.
        cls = type(cls.__name__, (cls,), {"_zppc_owned": True, "__module__": cls.__module__})
        module.__class__ = cls
    setattr(cls, name, property(_make_getter(name)))


def _make_getter(name: str):
    def parameter(self: nn.Module) -> Tensor:
        """Inside a forward (or while compiling one): the full parameter,
        `zppc::unshard` of the flat shard. Outside: the DTensor, no collective."""
        if not (torch.compiler.is_compiling() or _FORWARDS_RUNNING[0]):
            return self._parameters[name]
        spec: ShardSpec = self._zppc_specs[name]
        shard, sync = self._zppc_flat[name], self._zppc_sync
        # The common case without a closure or a call into `gathered`: dynamo
        # runs this for every parameter use of a 40-layer plan.
        if not shard.requires_grad or sync.mode() == "sync":
            return _unshard(shard, spec)
        return gathered(shard, functools.partial(_unshard, spec=spec), sync, spec.fqn)

    parameter.__name__ = name
    return parameter


def _unshard(shard: Tensor, spec: ShardSpec) -> Tensor:
    return torch.ops.zppc.unshard(
        shard, list(spec.shape), spec.group_name, spec.mode, spec.param_dtype, spec.reduce_dtype
    )


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Whether the next backwards of `model` reduce gradients across ranks
    (FSDP2's method of the same name). Off: each rank sums its full local
    gradients (one full-size buffer per parameter) and communicates nothing;
    the first backward with it on again reduces them with its own. Call it
    identically on every rank."""
    state = state_of(model)
    if state is None:
        raise ValueError("set_requires_gradient_sync needs a model passed to zppc.distribute")
    if not isinstance(requires_gradient_sync, bool):
        raise ValueError(
            f"requires_gradient_sync must be True or False, got {requires_gradient_sync!r}"
        )
    state.grad_sync.enabled = requires_gradient_sync


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backwards inside the block accumulate gradients on each rank without
    communicating (DDP's `no_sync`); the first backward after it reduces them."""
    set_requires_gradient_sync(model, False)
    try:
        yield
    finally:
        set_requires_gradient_sync(model, True)


def synchronize(model: nn.Module) -> None:
    """Complete OSP's pending stage 2: wait for the reductions still in flight
    and apply what they owe (LGP's correction, or the stale step), so every
    rank holds the synchronous-equivalent parameters. `zppc.save`, `zppc.load`
    and a forward in eval mode or under `torch.no_grad()` call it. Nothing to
    do without `Config.osp`. Collective only in that it waits for collectives
    every rank issued; call it on every rank."""
    state = state_of(model)
    if state is None:
        raise ValueError("synchronize needs a model passed to zppc.distribute")
    if state.osp is not None:
        state.osp.synchronize()


@torch.no_grad()
def full_parameters(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter of a distributed model as a full tensor, by its name
    (collective: every rank must call it). Shorthand for `p.full_tensor()`."""
    if state_of(model) is None:
        raise ValueError("full_parameters needs a model passed to zppc.distribute")
    return {name: p.full_tensor().clone() for name, p in model.named_parameters()}


@torch.no_grad()
def gather_full(spec: ShardSpec, local: Tensor) -> Tensor:
    """The full logical tensor from every rank's flat padded `local` piece of it
    (a flat shard or its gradient; collective)."""
    if spec.mode == "ddp":
        return local.detach().clone()
    gathered = local.new_empty(spec.shard_numel * spec.world_size)
    compat.all_gather_single(gathered, local.detach().contiguous())
    return gathered[: spec.numel].view(spec.shape).clone()
