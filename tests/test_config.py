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
