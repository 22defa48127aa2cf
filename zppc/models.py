"""A small GPT (byte-level, tied embeddings) used by the demo, the tests, the
benchmarks and `zppc schedule`. Plain PyTorch: nothing in it knows about zppc."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0

    @property
    def num_parameters(self) -> int:
        d, v, t, n = self.n_embd, self.vocab_size, self.block_size, self.n_layer
        per_block = (
            2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        )
        return v * d + t * d + n * per_block + 2 * d


PRESETS = {
    "gpt-tiny": GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=48),
    "gpt-small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256),
    "gpt-medium": GPTConfig(block_size=256, n_layer=8, n_head=8, n_embd=512),
    "gpt2-124m": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-1.5b": GPTConfig(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    # The ZeRO++ paper's 18B model (40 layers, hidden 6144, 32 heads): planned by
    # `zppc schedule` on meta tensors, never materialized.
    "gpt-18b": GPTConfig(vocab_size=50304, block_size=1024, n_layer=40, n_head=32, n_embd=6144),
    # The paper's largest model, 138B parameters. Its table's exact shape was not
    # available to us: GPT-3's width (12288, 96 heads) at the depth that gives
    # 138B (76 layers: 138.3B), planned on meta tensors like gpt-18b.
    "gpt-138b": GPTConfig(vocab_size=50304, block_size=1024, n_layer=76, n_head=96, n_embd=12288),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer; the output projection shares the token embedding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
