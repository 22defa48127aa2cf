"""zppc: a torch.compile backend for ZeRO-3 / ZeRO++ training on slow networks.

model = zppc.distribute(model, zppc.Config(strategy="zero3"))
step = torch.compile(model, backend="zppc")
"""

from zppc.checkpoint import load, save
from zppc.clipping import clip_grad_norm_
from zppc.config import Config
from zppc.distribute import (
    distribute,
    full_parameters,
    no_sync,
    set_requires_gradient_sync,
    synchronize,
)
from zppc.inspect import inspect
from zppc.runtime.failures import CollectiveError
from zppc.runtime.ledger import CommStats, comm_stats, reset_comm_stats

__all__ = [
    "CollectiveError",
    "CommStats",
    "Config",
    "clip_grad_norm_",
    "comm_stats",
    "distribute",
    "full_parameters",
    "inspect",
    "load",
    "no_sync",
    "reset_comm_stats",
    "save",
    "set_requires_gradient_sync",
    "synchronize",
]
__version__ = "0.1.0"
