"""qgZ error feedback: the quantization error a hop made at one step is added to
that hop's values at the next step, before they are quantized again, so the
errors do not accumulate over steps (the idea of 1-bit Adam and of LoCo in
DeepSpeed).

The residuals live outside the graph, in a per-model store (`DistributedState.
qgz_residuals`, saved by `zppc.save`), under keys the qgz pass derives from the
compile, the bucket and the hop, the same on every rank. Two custom ops touch
them: `zppc::qgz_compensate` reads (values + residual) and
`zppc::qgz_remember` writes (values - what was sent); the second returns
nothing and is marked as having a side effect, so no compiler drops it.
"""

from __future__ import annotations

import torch
from torch import Tensor

# id of a store -> the store (a model's `qgz_residuals` dict, key -> fp32 tensor).
_STORES: dict[int, dict[str, Tensor]] = {}


def register_store(store: dict[str, Tensor]) -> int:
    _STORES[id(store)] = store
    return id(store)


@torch.library.custom_op("zppc::qgz_compensate", mutates_args=())
def compensate(values: Tensor, store: int, key: str) -> Tensor:
    """`values` plus the residual the same hop left at the previous step."""
    residual = _STORES[store].get(key)
    if residual is None or residual.shape != values.shape:
        return values.clone()
    return values + residual.to(values.device)


@compensate.register_fake
def _(values: Tensor, store: int, key: str) -> Tensor:
    return torch.empty_like(values)


@torch.library.custom_op("zppc::qgz_remember", mutates_args=())
def remember(values: Tensor, sent: Tensor, store: int, key: str) -> None:
    """Keep what quantization lost: the values meant minus the values sent."""
    _STORES[store][key] = (values - sent).detach().clone()


@remember.register_fake
def _(values: Tensor, sent: Tensor, store: int, key: str) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.zppc.qgz_remember.default)
