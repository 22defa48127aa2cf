"""`zppc.distribute`: turn an ordinary model into one whose parameters are shards.

Each unique parameter is replaced by a flat, padded local shard (an
`nn.Parameter` the optimizer steps on) stored next to it as `<name>_shard`, and
the module's attribute `<name>` becomes a property returning
`zppc::unshard(shard)`. Eager execution is therefore correct as it stands (the op
really gathers), and dynamo traces one `unshard` per parameter use, which is the
IR the backend's passes lower.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

import zppc.ir  # noqa: F401  (registers zppc::unshard / zppc::reduce_grad)
from zppc.config import Config
from zppc.runtime.topology import Groups, Topology, default_node_size, setup_groups

SHARD_SUFFIX = "_shard"


@dataclass(frozen=True)
class ShardSpec:
    """How one logical parameter is stored: all ranks hold the same spec."""

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
    def shard_numel(self) -> int:
        """Elements per rank; the last ranks hold zero padding."""
        if self.mode == "ddp":
            return self.numel
        return -(-self.numel // self.world_size)

    def valid_numel(self, rank: int) -> int:
        """Elements of `rank`'s shard that are real (the rest is padding)."""
        if self.mode == "ddp":
            return self.numel
        return max(0, min(self.shard_numel, self.numel - rank * self.shard_numel))

    def shard_of(self, full: Tensor, rank: int) -> Tensor:
        """This rank's piece of the full tensor (what `distribute` stores)."""
        if self.mode == "ddp":
            return full.detach().clone()
        flat = full.detach().reshape(-1)
        padded = torch.nn.functional.pad(flat, (0, self.shard_numel * self.world_size - self.numel))
        return padded[rank * self.shard_numel : (rank + 1) * self.shard_numel].clone()


@dataclass
class DistributedState:
    """What `distribute` did to a model; kept on the model as `_zppc_state`."""

    config: Config
    topology: Topology
    groups: Groups
    specs: dict[str, ShardSpec] = field(default_factory=dict)
    owners: dict[str, list[tuple[nn.Module, str]]] = field(default_factory=dict)
    compiles: list = field(default_factory=list)
    """`CompileRecord`s of every graph compiled from this model (for `zppc.inspect`)."""

    def shard(self, fqn: str) -> nn.Parameter:
        module, name = self.owners[fqn][0]
        return module._parameters[name + SHARD_SUFFIX]


# Shard parameter -> state of the model that owns it; the backend uses it to find
# the Config of the model it is compiling from the graph's example inputs.
# Keyed by id (tensors compare elementwise, so they cannot be dict keys); the
# weak reference tells a live entry from a recycled id.
_STATE_OF_SHARD: dict[int, tuple[weakref.ref, DistributedState]] = {}


def state_of_shard(t: object) -> DistributedState | None:
    entry = _STATE_OF_SHARD.get(id(t))
    if entry is None or entry[0]() is not t:
        return None
    return entry[1]


def live_states() -> list[DistributedState]:
    """States of the distributed models whose shards are still alive."""
    return [state for ref, state in list(_STATE_OF_SHARD.values()) if ref() is not None]


def state_of(model: nn.Module) -> DistributedState | None:
    return getattr(model, "_zppc_state", None)


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
    node_size = config.node_size or default_node_size(world)
    try:
        if node_size > world:
            raise ValueError(f"node_size ({node_size}) is larger than world_size ({world})")
        if (config.hpz or config.qgz) and world % node_size:
            raise ValueError(f"hpz/qgz need world_size % node_size == 0, got {world} % {node_size}")
        _check_model(model)
        local_error = None
    except ValueError as exc:
        local_error = exc
    # First collective: every rank reaches it, whatever its own checks found, so
    # that disagreeing ranks are named instead of left waiting for each other.
    check_agreement(config, node_size, model, local_error)

    topology = Topology(world_size=world, node_size=node_size)
    groups = setup_groups(topology)

    state = DistributedState(config=config, topology=topology, groups=groups)
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
                    mode=config.strategy,
                    group_name=groups.world,
                    param_dtype=config.param_dtype,
                    reduce_dtype=config.reduce_dtype,
                )
                state.owners[fqn] = []
            state.owners[by_param[id(param)]].append((module, name))

    # Module by module, so that a model built on the meta device never exists in
    # full on any rank: materialize, take rank 0's values, keep this rank's shard.
    first_owner = {id(module): [] for module, _ in (o[0] for o in state.owners.values())}
    for fqn, owners in state.owners.items():
        first_owner[id(owners[0][0])].append(fqn)
    for _, module in model.named_modules():
        _materialize_meta(module)
        _broadcast_from_rank0(module)
        for fqn in first_owner.get(id(module), ()):
            spec = state.specs[fqn]
            param = module._parameters[state.owners[fqn][0][1]]
            shard = nn.Parameter(spec.shard_of(param.data, rank), requires_grad=param.requires_grad)
            for owner, name in state.owners[fqn]:
                _replace_with_property(owner, name, shard, spec)
            _STATE_OF_SHARD[id(shard)] = (weakref.ref(shard), state)
    model._zppc_state = state
    return model


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
        for pname in module._parameters:
            if (
                hasattr(type(module), pname + SHARD_SUFFIX)
                or (pname + SHARD_SUFFIX) in module._parameters
            ):
                raise ValueError(
                    f"{name}.{pname}{SHARD_SUFFIX} already exists; zppc needs that name"
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


def _materialize_meta(module: nn.Module) -> None:
    """Real storage and the module's own initialization for a meta-device module
    (checked beforehand by `_check_meta`; tensors it shares are sharded by now)."""
    if not any(t.is_meta for t in _own_tensors(module)):
        return
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        module.reset_parameters()


@torch.no_grad()
def _broadcast_from_rank0(module: nn.Module) -> None:
    """One flat broadcast per dtype of a module's own tensors, so that every rank
    starts from rank 0's values (shards already taken are left alone)."""
    tensors = [t for t in _own_tensors(module) if state_of_shard(t) is None]
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
    module: nn.Module, name: str, shard: nn.Parameter, spec: ShardSpec
) -> None:
    del module._parameters[name]
    module.register_parameter(name + SHARD_SUFFIX, shard)
    specs = module.__dict__.setdefault("_zppc_specs", {})
    specs[name] = spec
    cls = type(module)
    if not getattr(cls, "_zppc_owned", False):
        # A class of its own per instance (as torch.nn.utils.parametrize does), so
        # that properties never leak onto other instances of the user's class.
        cls = type(cls.__name__, (cls,), {"_zppc_owned": True, "__module__": cls.__module__})
        module.__class__ = cls
    setattr(cls, name, property(_make_getter(name)))


def _make_getter(name: str):
    shard_name = name + SHARD_SUFFIX

    def full_parameter(self: nn.Module) -> Tensor:
        spec: ShardSpec = self._zppc_specs[name]
        return torch.ops.zppc.unshard(
            getattr(self, shard_name),
            list(spec.shape),
            spec.group_name,
            spec.mode,
            spec.param_dtype,
            spec.reduce_dtype,
        )

    full_parameter.__name__ = name
    return full_parameter


@torch.no_grad()
def full_parameters(model: nn.Module) -> dict[str, Tensor]:
    """Every logical parameter of a distributed model as a full tensor, by its
    original name (collective: every rank must call it)."""
    state = state_of(model)
    if state is None:
        raise ValueError("full_parameters needs a model passed to zppc.distribute")
    return {fqn: gather_full(spec, state.shard(fqn)) for fqn, spec in state.specs.items()}


@torch.no_grad()
def gather_full(spec: ShardSpec, local: Tensor) -> Tensor:
    """The full logical tensor from every rank's flat padded `local` piece of it
    (a shard or its gradient; collective)."""
    if spec.mode == "ddp":
        return local.detach().clone()
    gathered = local.new_empty(spec.shard_numel * spec.world_size)
    dist.all_gather_single(gathered, local.detach().contiguous())
    return gathered[: spec.numel].view(spec.shape).clone()
