"""`zppc.save` / `zppc.load`: thin helpers over torch.distributed.checkpoint.

A distributed model's parameters are DTensors under their original names, so
its state dicts are the standard ones (`get_model_state_dict` /
`get_optimizer_state_dict`) and DCP writes each rank's pieces. The checkpoint
does not depend on the world size: one saved on 4 ranks loads on 2 or 8.

qgZ error-feedback residuals are this rank's own (not shards of anything), so
they are saved under `qgz_residuals.rank<r>` and come back only on the same
world size; on another one they start from zero again, with a warning.

A save never damages the checkpoint it replaces: DCP writes into
`<path>.zppc-staging`, and only once every rank has finished does rank 0 move
the old checkpoint aside (`<path>.zppc-old`), the new one into place, and
delete the old. A save killed at any point leaves a loadable checkpoint at
`path`, or, between the two renames, at `<path>.zppc-old`, where `load` looks
next. `path` must be on a filesystem every rank sees (as DCP's writer needs).
DCP's collectives run on the model's own world group, under `Config.timeout_s`.
"""

from __future__ import annotations

import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from zppc.distribute import state_of, synchronize
from zppc.runtime.failures import naming_failures
from zppc.runtime.topology import world_group

STAGING, OLD = ".zppc-staging", ".zppc-old"


def _state_dicts(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict:
    if state_of(model) is None:
        raise ValueError("zppc.save/load need a model passed to zppc.distribute")
    # OSP's pending stage 2 first: its correction replaces optimizer state entries.
    synchronize(model)
    sd = {"model": get_model_state_dict(model)}
    if opt is not None:
        sd["optim"] = get_optimizer_state_dict(model, opt)
    return sd


def save(
    model: nn.Module,
    opt: torch.optim.Optimizer | None,
    path: str,
    extra: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write this rank's pieces of the model (and optimizer) state to `path`;
    `extra`: tensors of the training loop's own (a step counter), the same on
    every rank, saved beside them. OSP's pending stage 2 completes first."""
    sd = _state_dicts(model, opt)
    if extra:
        sd["extra"] = dict(extra)
    state = state_of(model)
    if state.qgz_residuals:
        sd["qgz_residuals"] = {f"rank{dist.get_rank()}": dict(state.qgz_residuals)}
    group = world_group(state.groups)
    path = os.fspath(path)
    staging = path + STAGING
    with naming_failures(f"zppc.save to {path}"):
        if dist.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)  # what an interrupted save left
        dist.barrier(group=group)
        dcp.save(sd, checkpoint_id=staging, process_group=group)
        dist.barrier(group=group)  # every rank's files are written
        if dist.get_rank() == 0:
            _swap_in(staging, path)
        dist.barrier(group=group)


def _swap_in(staging: str, path: str) -> None:
    """Replace the checkpoint at `path` with the finished one at `staging`."""
    old = path + OLD
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(staging, path)
    shutil.rmtree(old, ignore_errors=True)


def _readable(path: str) -> str:
    """`path`, or the previous checkpoint a save interrupted between its renames left."""
    path = os.fspath(path)
    if not os.path.exists(path) and os.path.exists(path + OLD):
        warnings.warn(
            f"{path} is missing; loading {path + OLD} (a save was interrupted)", stacklevel=3
        )
        return path + OLD
    return path


def _saved_residuals(path: str) -> dict[str, dict[str, torch.Tensor]]:
    """Empty tensors for this rank's saved residuals, if the checkpoint holds
    residuals of exactly this world's ranks (read from its metadata)."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    by_rank: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, meta in metadata.items():
        parts = fqn.split(".")
        if parts[0] == "qgz_residuals" and len(parts) == 3:
            by_rank.setdefault(parts[1], {})[parts[2]] = torch.empty(
                meta.size, dtype=meta.properties.dtype
            )
    if not by_rank:
        return {}
    if set(by_rank) != {f"rank{r}" for r in range(dist.get_world_size())}:
        warnings.warn(
            f"checkpoint {path} holds qgZ error-feedback residuals of {len(by_rank)} ranks, "
            f"this world has {dist.get_world_size()}: they start from zero",
            stacklevel=3,
        )
        return {}
    mine = f"rank{dist.get_rank()}"
    return {mine: by_rank[mine]}


def load(
    model: nn.Module,
    opt: torch.optim.Optimizer | None,
    path: str,
    extra: dict[str, torch.Tensor] | None = None,
) -> None:
    """Read the checkpoint at `path` into the model (and the optimizer),
    whatever the world size it was saved with; the tensors of `extra` are
    filled in place from those `save` was given. OSP's pending stage 2
    completes first (the loaded values then replace what it produced)."""
    sd = _state_dicts(model, opt)
    if extra:
        sd["extra"] = extra
    path = _readable(path)
    residuals = _saved_residuals(path)
    if residuals:
        sd["qgz_residuals"] = residuals
    with naming_failures(f"zppc.load from {path}"):
        dcp.load(sd, checkpoint_id=path, process_group=world_group(state_of(model).groups))
    set_model_state_dict(model, sd["model"])
    state_of(model).qgz_residuals.clear()
    for saved in residuals.values():
        state_of(model).qgz_residuals.update(saved)
    if opt is not None:
        set_optimizer_state_dict(model, opt, sd["optim"])
