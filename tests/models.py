"""Small models for the tests. Every model's forward takes (x, y) and returns the loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zppc.models import GPT, PRESETS


class OddMLP(nn.Module):
    """Layer sizes that divide by nothing, a 1-element parameter, and a weight
    read twice (exercises padding, tiny shards, and gather dedupe)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(13, 37)
        self.fc2 = nn.Linear(37, 23)
        self.fc3 = nn.Linear(23, 5)
        self.scale = nn.Parameter(torch.tensor(0.7))

    def reset_parameters(self):
        """Initializes the module's own parameter (meta-device construction)."""
        nn.init.constant_(self.scale, 0.7)

    def forward(self, x, y):
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h)) + 0.1 * self.fc2(h)
        return F.mse_loss(self.scale * self.fc3(h), y)

    @staticmethod
    def batch(step: int, n: int = 8):
        """Fresh inputs each step, targets from a fixed teacher (learnable)."""
        teacher = torch.randn(13, 5, generator=torch.Generator().manual_seed(1234))
        x = torch.randn(n, 13, generator=torch.Generator().manual_seed(step))
        return x, torch.tanh(x @ teacher)


class FrozenMLP(OddMLP):
    """OddMLP whose first layer is frozen (a pretrained trunk)."""

    def __init__(self):
        super().__init__()
        self.fc1.requires_grad_(False)
        self.register_buffer("shift", torch.linspace(-1, 1, 13))

    def forward(self, x, y):
        return super().forward(x + self.shift, y)


class BrokenMLP(OddMLP):
    """OddMLP with a graph break in the middle: dynamo compiles two graphs."""

    def forward(self, x, y):
        h = torch.tanh(self.fc1(x))
        torch._dynamo.graph_break()
        h = torch.tanh(self.fc2(h))
        return F.mse_loss(self.scale * self.fc3(h), y)


class TailBreakMLP(OddMLP):
    """A graph break after the last parameter use: the second graph has no
    parameter at all."""

    def forward(self, x, y):
        out = self.scale * self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))
        torch._dynamo.graph_break()
        return F.mse_loss(out, y)


class TinyGPT(GPT):
    def __init__(self):
        super().__init__(PRESETS["gpt-tiny"])

    @staticmethod
    def batch(step: int, n: int = 8):
        """The same random sequences every step: memorizing them lowers the loss."""
        tokens = torch.randint(0, 256, (n, 33), generator=torch.Generator().manual_seed(0))
        return tokens[:, :-1], tokens[:, 1:]


MODELS = {
    "mlp": OddMLP,
    "frozen": FrozenMLP,
    "gpt": TinyGPT,
    "broken": BrokenMLP,
    "tail_break": TailBreakMLP,
}


class Chain(nn.Module):
    """Three bias-free linears: easy to predict the bytes of one step."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(10, 30, bias=False)
        self.l2 = nn.Linear(30, 21, bias=False)
        self.l3 = nn.Linear(21, 7, bias=False)

    def forward(self, x, y):
        return F.mse_loss(self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x))))), y)

    @staticmethod
    def batch(step: int, n: int = 8):
        g = torch.Generator().manual_seed(step)
        return torch.randn(n, 10, generator=g), torch.randn(n, 7, generator=g)


MODELS["chain"] = Chain


class PaddedMLP(nn.Module):
    """The model of the "Inductor trains wrong" report: Linear 13->31, LayerNorm,
    Linear 31->5 and a 1-element scale; no size divides by 2 or 4."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(13, 31)
        self.ln = nn.LayerNorm(31)
        self.l2 = nn.Linear(31, 5)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x, y):
        return F.mse_loss(self.scale * self.l2(self.ln(torch.tanh(self.l1(x)))), y)

    batch = OddMLP.batch


class EvenMLP(nn.Module):
    """Every size divides by 2 and 4: no padding anywhere."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(16, 32)
        self.l2 = nn.Linear(32, 8)

    def forward(self, x, y):
        return F.mse_loss(self.l2(torch.relu(self.l1(x))), y)

    @staticmethod
    def batch(step: int, n: int = 8):
        g = torch.Generator().manual_seed(step)
        return torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)


class BatchNormNet(nn.Module):
    """Buffers mutated in forward: BatchNorm's running statistics and counter,
    and a user counter. Batch statistics are per rank (as with DDP), so the
    reference runs each rank's slice separately (`local_statistics`)."""

    local_statistics = True

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(13, 11, bias=False)  # BatchNorm would cancel a bias exactly
        self.bn = nn.BatchNorm1d(11)
        self.l2 = nn.Linear(11, 5)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x, y):
        self.calls += 1
        return F.mse_loss(self.l2(torch.tanh(self.bn(self.l1(x)))), y)

    @staticmethod
    def batch(step: int, n: int = 16):
        """Four samples per rank at 4 ranks: batch statistics of two samples would
        amplify rounding differences (1/sqrt of a tiny variance) past float noise."""
        return OddMLP.batch(step, n)


MODELS.update(padded=PaddedMLP, even=EvenMLP, batchnorm=BatchNormNet)


class AttentionNet(nn.Module):
    """nn.MultiheadAttention between two linears: its packed input projection is
    read through `F.multi_head_attention_forward`, its output projection is an
    nn.Linear (RTP rotates both)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 12)
        # No biases: the key bias has an exactly zero gradient (softmax ignores
        # it), which AdamW turns into updates of pure rounding noise.
        self.attn = nn.MultiheadAttention(12, 3, batch_first=True, bias=False)
        self.out = nn.Linear(12, 5)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        h, _ = self.attn(h, h, h, need_weights=False)
        return F.mse_loss(self.out(h), y)

    @staticmethod
    def batch(step: int, n: int = 8):
        """Targets: the sequence mean of a fixed teacher map, which attention can
        pool (learnable in a few steps)."""
        teacher = torch.randn(7, 5, generator=torch.Generator().manual_seed(99))
        x = torch.randn(n, 6, 7, generator=torch.Generator().manual_seed(step))
        return x, torch.tanh(0.5 * x @ teacher).mean(dim=1, keepdim=True).expand(n, 6, 5)


MODELS["attention"] = AttentionNet


class CrossAttentionNet(nn.Module):
    """Attention whose query is not its key and value, returning its weights:
    with key/value widths of its own (separate query, key and value weights,
    each applied by one `linear`) and with packed weights (sliced into query
    and key/value parts first, so RTP gathers the packed weight there)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 12, bias=False)
        self.separate = nn.MultiheadAttention(12, 3, kdim=7, vdim=7, batch_first=True, bias=False)
        self.packed = nn.MultiheadAttention(12, 3, batch_first=True, bias=False)
        self.out = nn.Linear(12, 5)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        a, weights = self.separate(h, x, x)
        b, _ = self.packed(a, h, h, need_weights=False)
        return F.mse_loss(self.out(b), y) + 0.1 * weights.square().mean()

    batch = staticmethod(AttentionNet.batch)


MODELS["cross_attention"] = CrossAttentionNet


class TruncatedLinear(nn.Linear):
    """A linear initialized by rejection sampling (`trunc_normal_` reads the
    values it drew): flyweight cannot replay it and materializes it whole."""

    def reset_parameters(self):
        nn.init.trunc_normal_(self.weight, std=0.05)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class ScaledLinear(nn.Linear):
    """A linear initialized by a normal draw, then scalar elementwise ops."""

    def reset_parameters(self):
        self.weight.data.normal_(0.0, 1.0).mul_(0.04).add_(0.001)
        self.bias.data.fill_(0.01)


class InitZoo(nn.Module):
    """Initializations of each kind flyweight replays (a normal draw with a
    padding row, uniform draws, fills, BatchNorm's buffers, scalar ops after a
    draw) and one it does not (`trunc_normal_`). Sizes leave remainders
    under 16 at small chunk sizes."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(37, 15, padding_idx=5)
        self.l1 = nn.Linear(15, 33)
        self.norm = nn.LayerNorm(33)
        self.bn = nn.BatchNorm1d(33)
        self.scaled = ScaledLinear(33, 21)
        self.trunc = TruncatedLinear(21, 3)

    def forward(self, x, y):
        h = self.bn(self.norm(self.l1(self.emb(x).mean(dim=1))))
        return F.mse_loss(self.trunc(torch.tanh(self.scaled(torch.tanh(h)))), y)

    @staticmethod
    def batch(step: int, n: int = 8):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 37, (n, 6), generator=g)
        return x, torch.randn(n, 3, generator=torch.Generator().manual_seed(77))


MODELS["init_zoo"] = InitZoo
