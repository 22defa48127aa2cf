"""`zppc.save` / `zppc.load`: thin helpers over torch.distributed.checkpoint.

A distributed model's parameters are DTensors under their original names, so
its state dicts are the standard ones (`get_model_state_dict` /
`get_optimizer_state_dict`) and DCP writes each rank's pieces. The checkpoint
does not depend on the world size: one saved on 4 ranks loads on 2 or 8.
"""

from __future__ import annotations

import torch
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
    dcp.save(_state_dicts(model, opt), checkpoint_id=path)


def load(model: nn.Module, opt: torch.optim.Optimizer | None, path: str) -> None:
    """Read the checkpoint at `path` into the model (and the optimizer),
    whatever the world size it was saved with."""
    sd = _state_dicts(model, opt)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    if opt is not None:
        set_optimizer_state_dict(model, opt, sd["optim"])
