"""Hugging Face causal LMs (tiny, built from configs) trained through their own
`model(input_ids, labels=...)` path under zero3 and zero3 + ZeRO++, with
gradient checkpointing on and off, against one process on the whole batch."""

import pytest
from spawn import run_ranks

pytest.importorskip("transformers", reason="the Hugging Face tests need `pip install -e .[hf]`")
from hf_workers import train_hf  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

ZERO_PP = {"qwz": "int8", "hpz": True}
CASES = [
    pytest.param("gpt2", {}, False, id="gpt2-zero3"),
    pytest.param("llama", ZERO_PP, True, id="llama-zeropp-checkpointing", marks=pytest.mark.slow),
    pytest.param("gpt2", {}, True, id="gpt2-zero3-checkpointing", marks=pytest.mark.slow),
    pytest.param("gpt2", ZERO_PP, False, id="gpt2-zeropp", marks=pytest.mark.slow),
    pytest.param("llama", {}, False, id="llama-zero3", marks=pytest.mark.slow),
    pytest.param("llama", {}, True, id="llama-zero3-checkpointing", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("arch,zero_pp,checkpointing", CASES)
def test_causal_lm_trains_like_one_process(arch, zero_pp, checkpointing):
    r = run_ranks(train_hf, 4, arch, zero_pp, checkpointing, timeout=840)[0]
    # int8 weights in the forward: the loss moves by the quantization noise only.
    loss_rtol, gap = (1e-3, 1e-2) if zero_pp else (1e-5, 1e-5)
    for loss, ref in zip(r["losses"], r["ref_losses"], strict=True):
        assert loss == pytest.approx(ref, rel=loss_rtol)
    assert r["gap"] <= gap
