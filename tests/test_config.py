"""zppc.Config: every bad value or combination raises a ValueError naming it."""

import pytest
import torch

import zppc


def test_defaults_are_zero3_inductor():
    cfg = zppc.Config()
    assert (cfg.strategy, cfg.lowering, cfg.qwz, cfg.hpz, cfg.qgz, cfg.osp) == (
        "zero3",
        "inductor",
        None,
        False,
        None,
        None,
    )


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        zppc.Config().strategy = "ddp"


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(strategy="zero4"), ["strategy", "zero4"]),
        (dict(qwz="int2"), ["qwz", "int2"]),
        (dict(qgz="fp8"), ["qgz", "fp8"]),
        (dict(lowering="jit"), ["lowering", "jit"]),
        (dict(reduce_scatter="ring"), ["reduce_scatter", "ring"]),
        (dict(qwz_block=0), ["qwz_block", "0"]),
        (dict(qwz="int4", qwz_block=65), ["qwz_block", "even", "65"]),
        (dict(bucket_bytes=-1), ["bucket_bytes", "-1"]),
        (dict(node_size=0), ["node_size", "0"]),
        (dict(osp=1.5), ["osp", "1.5"]),
        (dict(osp=0.0), ["osp", "0.0"]),
        (dict(hpz="yes"), ["hpz", "yes"]),
        (dict(param_dtype=torch.int8), ["param_dtype", "int8"]),
        (dict(disable_passes=("zer0",)), ["disable_passes", "zer0"]),
        (dict(strategy="ddp", qwz="int8"), ["qwz", "ddp"]),
        (dict(strategy="zero2", hpz=True), ["hpz", "zero2"]),
        (dict(qgz="int4", qgz_intra_node="fp8"), ["qgz_intra_node", "fp8"]),
        (dict(qgz="int4", qgz_block=33), ["qgz_block", "even"]),
        (dict(qgz="int8", qgz_intra_node="int4", qgz_block=33), ["qgz_block", "even"]),
        (dict(qgz="int8", qgz_quantize="no"), ["qgz_quantize"]),
        (dict(strategy="rtp", qgz="int4"), ["rtp", "qgz"]),
        (dict(timeout_s=0), ["timeout_s", "0"]),
        (dict(timeout_s=float("inf")), ["timeout_s", "inf"]),
        (dict(buffer_sync="average"), ["buffer_sync", "average"]),
        (dict(nonfinite_grads="ignore"), ["nonfinite_grads", "ignore"]),
    ],
)
def test_bad_values_name_the_field(kwargs, words):
    with pytest.raises(ValueError) as info:
        zppc.Config(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_unbuilt_features_refuse_instead_of_ignoring():
    with pytest.raises(NotImplementedError, match="not implemented yet"):
        zppc.Config(strategy="rtp", osp=0.5)


def test_replace_checks_again():
    cfg = zppc.Config(lowering="eager")
    assert cfg.replace(bucket_bytes=10).bucket_bytes == 10
    with pytest.raises(ValueError, match="strategy"):
        cfg.replace(strategy="nope")
    with pytest.raises(ValueError, match="unknown"):
        cfg.replace(colour="red")


def test_default_bucket_cap_is_the_repeated_block():
    """bucket_bytes=None: the gathered size of the largest repeated block
    (gpt-small: 12 d^2 + 13 d values at d=256), in the parameter dtype, kept
    within 1-25 MiB; a model with no repeated block gets 25 MiB."""
    from zppc.config import MAX_BUCKET_BYTES, MIN_BUCKET_BYTES, block_bucket_bytes
    from zppc.models import GPT, PRESETS

    assert zppc.Config().bucket_bytes is None
    with torch.device("meta"):
        small, tiny, big = (GPT(PRESETS[p]) for p in ("gpt-small", "gpt-tiny", "gpt2-124m"))
        lone = torch.nn.Linear(4096, 4096)
        mlp = torch.nn.Sequential(
            torch.nn.Linear(600, 700), torch.nn.ReLU(), torch.nn.Linear(700, 5)
        )
    block = 12 * 256**2 + 13 * 256
    assert block_bucket_bytes(small) == 4 * block
    assert block_bucket_bytes(small, torch.bfloat16) == 2 * block
    assert block_bucket_bytes(tiny) == MIN_BUCKET_BYTES
    assert block_bucket_bytes(big) == MAX_BUCKET_BYTES  # its 27 MiB block is capped
    assert block_bucket_bytes(lone) == MAX_BUCKET_BYTES
    assert block_bucket_bytes(mlp) == 4 * (600 * 700 + 700)  # the larger of its two Linears
