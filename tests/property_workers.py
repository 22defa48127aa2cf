"""Random small models for the property test, and the rank function that
trains one under zppc beside a single-process reference."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from workers import distributed_step, make_optimizer

import zppc


class RandomNet(nn.Module):
    """Linear layers of the given widths with tanh between them; optionally two
    square layers sharing one weight (tied), the first layers frozen, a
    constant non-persistent buffer in the loss and a counter buffer."""

    def __init__(self, widths: list[int], tied: bool, frozen: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(a, b, bias=bias) for a, b in zip(widths, widths[1:], strict=False)
        )
        self.tied = None
        if tied:
            w = widths[-1]
            self.tied = nn.ModuleList([nn.Linear(w, w), nn.Linear(w, w)])
            self.tied[1].weight = self.tied[0].weight
        for layer in list(self.layers)[:frozen]:
            layer.requires_grad_(False)
        self.register_buffer("weighting", torch.linspace(0.5, 1.5, widths[-1]), persistent=False)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))

    def forward(self, x, y):
        self.forwards += 1
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        if self.tied is not None:
            h = self.tied[1](torch.tanh(self.tied[0](h)))
        return F.mse_loss(h * self.weighting, y)


def batch(step: int, widths: list[int], n: int = 8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, widths[0], generator=g), torch.randn(n, widths[-1], generator=g)


def train_random_model(rank, world, spec: dict, config: dict, optimizer: str, steps: int = 3):
    """`steps` steps of zppc (compiled, eager lowering) and of one process on
    the whole batch; returns both loss curves, the largest parameter gap and
    every rank's buffers."""
    torch._dynamo.reset()
    torch.manual_seed(spec["seed"])
    model = RandomNet(spec["widths"], spec["tied"], spec["frozen"], spec["bias"])
    reference = copy.deepcopy(model)
    zppc.distribute(model, zppc.Config(lowering="eager", **config))
    step = torch.compile(model, backend="zppc")
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(optimizer, trainable)
    ref_opt = make_optimizer(optimizer, [p for p in reference.parameters() if p.requires_grad])
    losses, ref_losses = [], []
    for i in range(steps):
        x, y = batch(i, spec["widths"])
        losses.append(distributed_step(step, opt, x, y, rank, world))
        ref_loss = reference(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    full = zppc.full_parameters(model)
    ref = dict(reference.named_parameters())
    gap = max((full[n] - ref[n].detach()).abs().max().item() for n in full)
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "gap": gap,
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }
