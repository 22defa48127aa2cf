"""`zppc.save` / `zppc.load`: thin helpers over torch.distributed.checkpoint.

A distributed model's parameters are DTensors under their original names, so
its state dicts are the standard ones (`get_model_state_dict` /
`get_optimizer_state_dict`) and DCP writes each rank's pieces. The checkpoint
does not depend on the world size: one saved on 4 ranks loads on 2 or 8.

qgZ error-feedback residuals are this rank's own (not shards of anything), so
they are saved under `qgz_residuals.rank<r>` and come back only on the same
world size; on another one they start from zero again, with a warning.
"""

from __future__ import annotations

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

from zppc.distribute import state_of


def _state_dicts(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict:
    if state_of(model) is None:
        raise ValueError("zppc.save/load need a model passed to zppc.distribute")
    sd = {"model": get_model_state_dict(model)}
    if opt is not None:
        sd["optim"] = get_optimizer_state_dict(model, opt)
    return sd


def save(model: nn.Module, opt: torch.optim.Optimizer | None, path: str) -> None:
    """Write this rank's pieces of the model (and optimizer) state to `path`."""
    sd = _state_dicts(model, opt)
    residuals = state_of(model).qgz_residuals
    if residuals:
        sd["qgz_residuals"] = {f"rank{dist.get_rank()}": dict(residuals)}
    dcp.save(sd, checkpoint_id=path)


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


def load(model: nn.Module, opt: torch.optim.Optimizer | None, path: str) -> None:
    """Read the checkpoint at `path` into the model (and the optimizer),
    whatever the world size it was saved with."""
    sd = _state_dicts(model, opt)
    residuals = _saved_residuals(path)
    if residuals:
        sd["qgz_residuals"] = residuals
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    state_of(model).qgz_residuals.clear()
    for saved in residuals.values():
        state_of(model).qgz_residuals.update(saved)
    if opt is not None:
        set_optimizer_state_dict(model, opt, sd["optim"])
