"""The installed entry points: backend="zppc" without importing zppc, and the CLI."""

import json
import subprocess
import sys

import pytest
import torch

from zppc.cli import main
from zppc.config import repeated_block_bytes
from zppc.models import GPT, PRESETS

pytestmark = pytest.mark.timeout(300)

NO_IMPORT = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
x = torch.randn(2, 4)
out = torch.compile(model, backend="zppc", options={"lowering": "eager"})(x)
assert torch.allclose(out, model(x))
import sys
print("zppc imported by dynamo:", "zppc" in sys.modules)
"""


def test_backend_is_found_by_entry_point_in_a_fresh_interpreter():
    done = subprocess.run(
        [sys.executable, "-c", NO_IMPORT], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "zppc imported by dynamo: True" in done.stdout


def test_console_script_prints_version():
    done = subprocess.run(
        [sys.executable, "-m", "zppc", "--version"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "0.1.0"


def test_schedule_at_384_ranks(capsys):
    assert (
        main(
            ["schedule", "gpt-tiny", "--world-size", "384", "--node-size", "16"]
            + ["--bucket-mb", "25", "--format", "json"]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    rows, totals = report["collectives"], report["totals"]
    assert {r["group_size"] for r in rows} == {384}
    assert [r["kind"] for r in rows if r["graph"] == "forward"] == ["all_gather"]  # one bucket
    assert totals["inter_node_bytes"] == sum(r["inter_node_bytes"] for r in rows)
    # 15 of 383 peers share the node.
    for r in rows:
        assert r["intra_node_bytes"] * (384 - 16) == r["inter_node_bytes"] * 15


def test_schedule_qwz_moves_fewer_bytes(capsys):
    sizes = {}
    for qwz in (None, "int8"):
        args = [
            "schedule",
            "gpt-small",
            "--world-size",
            "64",
            "--node-size",
            "8",
            "--format",
            "json",
        ]
        assert main(args + (["--qwz", qwz] if qwz else [])) == 0
        rows = json.loads(capsys.readouterr().out)["collectives"]
        sizes[qwz] = sum(r["bytes_per_peer"] for r in rows if r["kind"] == "all_gather")
    # A quarter of fp32, plus one bf16 scale per block and 4-byte alignment.
    assert 0.25 <= sizes["int8"] / sizes[None] <= 0.26


def test_schedule_rejects_bad_sizes():
    with pytest.raises(SystemExit, match="node-size"):
        main(["schedule", "gpt-tiny", "--world-size", "4", "--node-size", "8"])


def test_schedule_hpz_keeps_backward_gathers_inside_the_node(capsys):
    args = ["schedule", "gpt-tiny", "--world-size", "16", "--node-size", "4", "--format", "json"]
    assert main(args + ["--hpz"]) == 0
    rows = json.loads(capsys.readouterr().out)["collectives"]
    backward_gathers = [r for r in rows if r["graph"] == "backward" and r["kind"] == "all_gather"]
    assert backward_gathers, rows
    for r in backward_gathers:
        assert r["group_size"] == 4 and r["inter_node_bytes"] == 0 and r["intra_node_bytes"] > 0
    forward_gathers = [r for r in rows if r["graph"] == "forward" and r["kind"] == "all_gather"]
    assert all(r["group_size"] == 16 and r["inter_node_bytes"] > 0 for r in forward_gathers)


def test_schedule_qgz_shows_both_hops(capsys):
    args = ["schedule", "gpt-tiny", "--world-size", "384", "--node-size", "16", "--format", "json"]
    main([*args, "--qgz", "int4"])
    rows = json.loads(capsys.readouterr().out)["collectives"]
    hops = [r for r in rows if r["kind"] == "all_to_all"]
    buckets = len(hops) // 2  # gpt-tiny padded to 384 ranks outgrows one 1 MiB bucket
    assert buckets >= 1 and [r["group_size"] for r in hops] == [16, 24] * buckets
    for intra, inter in zip(hops[::2], hops[1::2], strict=True):
        assert intra["inter_node_bytes"] == 0 and inter["intra_node_bytes"] == 0
    assert not [r for r in rows if r["kind"] == "reduce_scatter"]


def test_schedule_rtp_plans_the_ring(capsys):
    """Each rotated use is one ring op receiving from the next rank: rank 3 of
    4 per node receives across nodes, rank 0 inside its node; the embedding's
    forward brings the 15 other shards of ceil(vocab / 16) rows."""
    from zppc.kernels.quant import PayloadLayout

    from zppc.models import PRESETS

    cfg = PRESETS["gpt-tiny"]
    args = ["schedule", "gpt-tiny", "--world-size", "16", "--node-size", "4", "--format", "json"]
    rows = {}
    for rank in (0, 3):
        assert main([*args, "--strategy", "rtp", "--rank", str(rank)]) == 0
        rows[rank] = json.loads(capsys.readouterr().out)["collectives"]
    ring = [r for r in rows[0] if r["ring"]]
    assert ring and all(r["kind"] == "send_recv" for r in ring)
    assert not [r for r in rows[0] if r["kind"] in ("all_gather", "reduce_scatter")]
    assert all(r["inter_node_bytes"] == 0 and r["node_link_bytes"] > 0 for r in ring)
    assert all(r["intra_node_bytes"] == 0 for r in rows[3] if r["ring"])
    wte_shard = -(-cfg.vocab_size // 16) * cfg.n_embd * 4
    assert ring[0]["bytes_per_peer"] == 15 * wte_shard
    # With qwZ int8 each hop is the shard's payload: one bf16 scale per
    # block of 2048, then a byte per value; the unquantized size is kept.
    assert main([*args, "--strategy", "rtp", "--qwz", "int8", "--rank", "0"]) == 0
    quantized = [r for r in json.loads(capsys.readouterr().out)["collectives"] if r["ring"]]
    payload = PayloadLayout(wte_shard // 4, 2048, 8).nbytes
    assert quantized[0]["bytes_per_peer"] == 15 * payload
    assert quantized[0]["unquantized_bytes_per_peer"] == 15 * wte_shard


def _plan_json(capsys, *flags: str) -> dict:
    base = ["schedule", "gpt-tiny", "--world-size", "16", "--node-size", "4", "--format", "json"]
    assert main([*base, *flags]) == 0
    return json.loads(capsys.readouterr().out)


# Each flag against the plan it refines: a flag must change what is planned.
FLAG_CHANGES = [
    ((), ("--strategy", "zero2")),
    ((), ("--strategy", "rtp")),
    ((), ("--qwz", "int8")),
    (("--qwz", "int8"), ("--qwz-block", "64")),
    ((), ("--hpz",)),
    ((), ("--qgz", "int4")),
    (("--qgz", "int4"), ("--qgz-block", "256")),
    (("--qgz", "int4"), ("--qgz-intra-node", "none")),
    ((), ("--osp", "0.5")),
    ((), ("--param-dtype", "bfloat16")),
    ((), ("--reduce-dtype", "bfloat16")),
    ((), ("--bucket-mb", "0.01")),
    ((), ("--reduce-scatter", "all_to_all")),
    (("--bucket-mb", "0.01"), ("--prefetch", "0")),
    (("--bucket-mb", "0.01", "--prefetch", "2", "--tflops", "0.01"), ("--overlap", "cost")),
    ((), ("--keep-gathered-mb", "1")),
    ((), ("--no-keep-last-block",)),
    ((), ("--no-edge-buckets",)),
    # The cost model's compute: memory-bound ops, and the CPU's quantization ops.
    ((), ("--memory-bw", "1GB/s")),
    (("--qwz", "int8", "--memory-bw", "1GB/s"), ("--kernels", "torch")),
]


def test_schedule_states_what_zero3_keeps_gathered(capsys):
    """The plan says which weights skip the backward's re-gather: by default
    the last block's (`Config.keep_last_block`), none with
    --no-keep-last-block, and those backward gathers are gone from the plan."""
    kept = _plan_json(capsys)
    regathered = _plan_json(capsys, "--no-keep-last-block")
    assert kept["totals"]["kept_gathered_weights"] > 0
    assert 0 < kept["totals"]["kept_gathered_bytes"] <= 4 * 2**20
    assert regathered["totals"]["kept_gathered_weights"] == 0
    assert regathered["totals"]["kept_gathered_bytes"] == 0

    def backward_gathered(plan):
        return sum(
            r["intra_node_bytes"] + r["inter_node_bytes"]
            for r in plan["collectives"]
            if r["graph"] == "backward" and r["kind"] == "all_gather"
        )

    assert backward_gathered(kept) < backward_gathered(regathered)
    base = ["schedule", "gpt-tiny", "--world-size", "16", "--node-size", "4"]
    assert main(base) == 0
    assert "kept gathered from forward to backward (not re-gathered): " in capsys.readouterr().out


def test_a_tied_embedding_larger_than_a_block_does_not_stop_keeping_the_last_block(capsys):
    """GPT-2's output head reads its tied embedding last (154 MB gathered),
    more than the one-block budget of `keep_last_block`: it is passed over
    and gathered first in the backward, and the last block's weights after
    it are kept (before, nothing was kept at all)."""
    base = ["schedule", "gpt2-124m", "--world-size", "16", "--node-size", "4", "--format", "json"]
    assert main(base) == 0
    plan = json.loads(capsys.readouterr().out)
    assert main([*base, "--no-keep-last-block"]) == 0
    regathering = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        block = repeated_block_bytes(GPT(PRESETS["gpt2-124m"]))
    assert plan["totals"]["kept_gathered_weights"] > 0
    assert 0.5 * block < plan["totals"]["kept_gathered_bytes"] <= block

    def backward_gathers(plan):
        return [
            r["bytes_per_peer"] * r["group_size"]
            for r in plan["collectives"]
            if r["graph"] == "backward" and r["kind"] == "all_gather"
        ]

    embedding = PRESETS["gpt2-124m"].vocab_size * PRESETS["gpt2-124m"].n_embd * 4
    assert backward_gathers(plan)[0] >= embedding  # re-gathered, first
    fewer = sum(backward_gathers(regathering)) - sum(backward_gathers(plan))
    assert fewer >= plan["totals"]["kept_gathered_bytes"]


def test_every_config_flag_reaches_the_schedule(capsys):
    """A flag that changes nothing in the plan (collectives, their bytes or
    their place in the timeline) would be a flag the planner ignores."""
    plans = {}
    for base, flag in FLAG_CHANGES:
        for flags in (base, (*base, *flag)):
            if flags not in plans:
                plan = _plan_json(capsys, *flags)
                plans[flags] = (plan["collectives"], plan["timeline"])
        assert plans[(*base, *flag)] != plans[base], f"{flag} changed nothing on top of {base}"


# The emulated 2 x 2 cluster's setting (RESULTS' forty-sixth run): a slow cross-node
# link and compute of the same order, where the bucket cap and prefetch depth matter.
TUNED = ["gpt-small", "--world-size", "4", "--node-size", "2", "--backend", "gloo"]
TUNED += ["--inter-bw", "40mbit", "--tflops", "0.027", "--tokens-per-rank", "8192"]


def test_tune_ranks_bucket_caps_and_prefetch_depths_by_the_plans_they_make(capsys):
    """`--tune` plans every (bucket cap, prefetch) it lists, exactly as a plan
    given those flags would, ranks them by predicted step, and suggests the
    least gathered memory within 2% of the fastest."""
    mib = 2**20
    assert main(["schedule", *TUNED, "--tune", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows, suggested = report["tune"], report["suggested"]
    with torch.device("meta"):
        block = repeated_block_bytes(GPT(PRESETS["gpt-small"]))  # 3.01 MiB
    # None (block-sized buckets ending where blocks do) and explicit caps around it,
    # halving down to 1 MiB.
    caps = {2 * block: 2 * block, None: block, block // 2: block // 2, mib: mib}
    assert sorted((r["bucket_cap_bytes"], r["prefetch"]) for r in rows) == sorted(
        (cap, p) for cap in caps.values() for p in (1, 2, 3)
    )
    for r in rows:
        assert caps[r["bucket_bytes"]] == r["bucket_cap_bytes"]
    assert [(r["bucket_bytes"], r["prefetch"]) for r in rows if r["default"]] == [(None, 1)]
    steps = [r["step_seconds"] for r in rows]
    assert steps == sorted(steps) and len(set(steps)) > 1
    near = [r for r in rows if r["step_seconds"] <= steps[0] * 1.02]
    assert suggested in near
    assert suggested["gathered_bytes_alive_at_most"] == min(
        r["gathered_bytes_alive_at_most"] for r in near
    )
    for r in rows:
        assert r["gathered_bytes_alive_at_most"] == (r["prefetch"] + 1) * r["bucket_cap_bytes"]
    # Each row is the plan those flags make on their own.
    default = next(r for r in rows if r["default"])
    assert default["speedup_over_default"] == 1.0
    for row in (suggested, rows[-1]):
        flags = ["--prefetch", str(row["prefetch"])]
        if row["bucket_bytes"] is not None:
            flags += ["--bucket-mb", repr(row["bucket_bytes"] / mib)]
        assert main(["schedule", *TUNED, *flags, "--format", "json"]) == 0
        plan = json.loads(capsys.readouterr().out)["totals"]
        assert plan["step_seconds"] == row["step_seconds"]
        assert plan["collectives"] == row["collectives"]
    assert main(["schedule", *TUNED, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["step_seconds"] == default["step_seconds"]


def test_tune_prints_its_ranking_and_the_config_to_use(capsys):
    args = ["schedule", "gpt-tiny", "--world-size", "16", "--node-size", "4", "--tune"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "(the default)" in table and "<- suggested" in table
    assert "suggested: zppc.Config(..., bucket_bytes=" in table


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--tune", "--prefetch", "2"], "leave out --prefetch"),
        (["--tune", "--bucket-mb", "4"], "leave out --bucket-mb"),
        (["--tune", "--compare", "zero2"], "leave out --compare"),
        (["--tune", "--format", "chrome"], "not one plan's trace"),
        (["--qwz-block", "64"], "without --qwz"),
        (["--qgz-intra-node", "int4"], "without --qgz"),
        (["--osp-split", "last"], "without --osp"),
        (["--osp", "0.5", "--osp-split", "magnitude"], "measured"),
        (["--hpz", "--node-size", "3"], "16 % 3"),
        (["--qgz", "int4", "--node-size", "3"], "16 % 3"),
        (["--strategy", "rtp", "--osp", "0.5"], "not implemented"),
        (["--osp", "1.5"], "osp"),
        (["--qwz", "int8", "--kernels", "torch"], "without --memory-bw"),
        (["--memory-bw", "fast"], "cannot read the bandwidth"),
        (["--tokens-per-rank", "0"], "at least 1"),
    ],
)
def test_schedule_refuses_what_it_cannot_plan(flags, words):
    with pytest.raises(SystemExit, match=words):
        main(["schedule", "gpt-tiny", "--world-size", "16", *flags])


FACTORY = """
import torch
from torch import nn


def build():
    model = nn.Sequential(nn.Linear(10, 30), nn.ReLU(), nn.Linear(30, 7))
    return model, (torch.randn(3, 10),)
"""


def test_schedule_plans_a_users_factory(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["schedule", "my_models:build", "--world-size", "16", "--node-size", "4"]
    assert main(args + ["--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["totals"]["parameters"] == 10 * 30 + 30 + 30 * 7 + 7
    kinds = [c["kind"] for c in plan["collectives"]]
    assert "all_gather" in kinds and "reduce_scatter" in kinds
    # Each rank receives 15 shards of every weight, padded to 16 rows' worth.
    gathered = sum(c["bytes_per_peer"] for c in plan["collectives"] if c["graph"] == "forward")
    assert gathered * 16 >= (10 * 30 + 30 + 30 * 7 + 7) * 4
    with pytest.raises(SystemExit, match="cannot load 'my_models:nothing'"):
        main(["schedule", "my_models:nothing", "--world-size", "8"])
    with pytest.raises(SystemExit, match="unknown model 'gpt-huge'"):
        main(["schedule", "gpt-huge", "--world-size", "8"])
