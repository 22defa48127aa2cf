"""Rank functions for tests/test_huggingface.py: tiny Hugging Face causal LMs,
built from configs, trained through their own `model(input_ids, labels=...)`."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import zppc
from zppc.distribute import state_of

VOCAB, SEQ, BATCH = 97, 16, 8


def tiny(arch: str):
    import transformers

    if arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=36,
            n_layer=2,
            n_head=3,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=36,
        intermediate_size=50,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=SEQ,
    )
    return transformers.LlamaForCausalLM(config)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def train_hf(rank, world, arch, config_kwargs, checkpointing, steps=3):
    """Train a distributed copy and a single-process reference on the whole batch."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = tiny(arch).train()
    reference = copy.deepcopy(model)
    if checkpointing:
        for m in (model, reference):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    zppc.distribute(model, zppc.Config(node_size=2, lowering="eager", **config_kwargs))
    step = torch.compile(model, backend="zppc")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for i in range(steps):
        ids = batch(i)
        mine = ids.chunk(world)[rank]
        loss = step(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    full = zppc.full_parameters(model)
    gaps = {n: (full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()}
    finals = [gm for r in zppc.inspect(step).compiles for gm in r.final.values()]
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "gap": max(gaps.values()),
        "modes": {fqn: spec.mode for fqn, spec in state_of(model).specs.items()},
        "ops": [str(n.target) for gm in finals for n in gm.graph.nodes if n.op == "call_function"],
    }
