"""The emulated-cluster benchmark harness itself (needs root, ip and tc)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
from run import QUICK_CONFIGS  # noqa: E402
from worker import FIRST_STEP_DONE, config_entry  # noqa: E402

CAN_RUN = os.geteuid() == 0 and shutil.which("tc") is not None and shutil.which("ip") is not None

pytestmark = pytest.mark.timeout(900)


@pytest.mark.slow
@pytest.mark.skipif(
    not CAN_RUN, reason="needs root with ip and tc (network namespaces, traffic shaping)"
)
def test_quick_run_builds_measures_and_removes_the_cluster(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "run.py"),
            "--quick",
            "--configs",
            ",".join(QUICK_CONFIGS + ["zppc-zero3@inductor"]),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["namespaces_removed"]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "zppc" not in listed
    (link,) = report["links"]
    # The shaped link really limits bandwidth.
    assert abs(link["measured_bits_per_second"] / link["set_bits_per_second"] - 1) <= 0.2
    # zppc links ran on the cluster: all-gathers into a node get no more than the link.
    assert 0 < link["collective_bits_per_second"] <= 1.2 * link["set_bits_per_second"]
    rows = {r["config"]: r for r in link["rows"]}
    assert set(rows) == {
        "torch-fsdp2",
        "zppc-zero3",
        "zppc-zero3-qwz-int8",
        "zppc-zero3-qgz",
        "zppc-zero3@inductor",
    }
    for name in rows:
        assert rows[name]["status"] == "ok", rows[name]
        # A retry (run.py records it) is only for a run that died before any
        # step: one that trained and then failed is the row's result.
        if "retried_after" in rows[name]:
            assert FIRST_STEP_DONE not in rows[name]["retried_after"]["log"], rows[name]
        assert rows[name]["wire_bytes"] > 0 and rows[name]["tokens_per_second"] > 0
    # qwZ and qgZ put fewer bytes on the wire than plain zero3, by the link's own counters.
    for name in ("zppc-zero3-qwz-int8", "zppc-zero3-qgz"):
        assert rows[name]["wire_bytes"] < rows["zppc-zero3"]["wire_bytes"]
    # A row's own lowering reaches its ranks; the others run the run's.
    assert rows["zppc-zero3@inductor"]["lowering"] == "inductor"
    assert rows["zppc-zero3"]["lowering"] == "eager" and rows["torch-fsdp2"]["lowering"] is None
    assert rows["zppc-zero3@inductor"]["final_loss"] == pytest.approx(
        rows["zppc-zero3"]["final_loss"], rel=1e-3
    )
    assert (tmp_path / "bench.png").stat().st_size > 0
    # The run records one thread's rates for benchmarks/predict.py.
    rates = report["machine_rates"]
    assert rates["flops_per_second"] > 0 and rates["memory_bytes_per_second"] > 0


def test_machine_rates_count_bytes_as_the_cost_model_does(monkeypatch):
    """benchmarks/machine.py: the elementwise rate is the round trip's aten
    bytes (zppc.cost.node_bytes) over its time; the FLOP rate a matmul's."""
    import machine

    monkeypatch.setattr(machine, "_median_seconds", lambda fn: 0.5)
    rates = machine.measure_rates()
    assert rates["flops_per_second"] == 2 * 512 * 256 * 768 / 0.5
    # Quantize: pad, abs, amax, where, mul, floor, clamp, casts...; dequantize
    # back: several passes over the 256 KiB shard, each counted once.
    assert 10 * 2**18 < rates["memory_bytes_per_second"] * 0.5 < 100 * 2**18


def test_a_zppc_row_can_name_its_lowering_and_bucket_cap():
    """`zppc-zero3@inductor` runs zero3 under Inductor whatever `--lowering`
    says, and `:2mib` at a 2 MiB bucket cap whatever `--bucket-mb` says, so
    one run measures both lowerings and several caps side by side; other
    rows, and other suffixes, are refused before anything starts."""
    import run

    assert config_entry("zppc-zero3@inductor") == (
        "zppc",
        {"strategy": "zero3", "lowering": "inductor"},
    )
    assert config_entry("zppc-zero3") == ("zppc", {"strategy": "zero3"})
    assert config_entry("zppc-zero3@eager:2.5mib") == (
        "zppc",
        {"strategy": "zero3", "lowering": "eager", "bucket_bytes": int(2.5 * 2**20)},
    )
    assert config_entry("zppc-zero3:4mib")[1]["bucket_bytes"] == 4 * 2**20
    bad_rows = ("torch-fsdp2@inductor", "torch-fsdp2:2mib", "zppc-zero3@aot", "zppc-zero4")
    bad_rows += ("zppc-zero3:2", "zppc-zero3:0mib", "zppc-zero3:twomib", "zppc-zero3:infmib")
    for bad in bad_rows:
        with pytest.raises(KeyError):
            config_entry(bad)
        with pytest.raises(SystemExit):
            run.parse_args(["--configs", f"zppc-zero3,{bad}"])


def test_predict_plans_a_row_at_its_own_bucket_cap():
    """A row that names its cap is planned at it: its flag comes after the
    run's `--bucket-mb`, and the last one given wins, as in the worker."""
    from predict import schedule_flags

    assert schedule_flags("zppc-zero3:2mib") == ["--strategy", "zero3", "--bucket-mb", "2.0"]
    assert schedule_flags("zppc-zero3") == ["--strategy", "zero3"]
    # Config fields that are off by flag: their row plans with that flag.
    assert schedule_flags("zppc-zero3-no-edge") == ["--strategy", "zero3", "--no-edge-buckets"]


def test_predict_plans_an_older_run_with_the_keep_budget_it_ran():
    """Runs recorded before `keep_last_block`'s budget grew to `prefetch + 1`
    buckets kept one bucket of the last block where the cap was below it:
    planned so, the plan keeps what the run kept; at the block's cap, or
    for other strategies, nothing changes."""
    from predict import keep_budget_of_one_bucket

    half_block = ["--strategy", "zero3", "--bucket-mb", "25", "--bucket-mb", "1.5"]
    assert keep_budget_of_one_bucket(half_block, "gpt-small") == [
        "--no-keep-last-block",
        "--keep-gathered-mb",
        "1.5",
    ]
    budget = [*half_block, "--keep-gathered-mb", "2.5"]
    assert keep_budget_of_one_bucket(budget, "gpt-small")[-1] == "2.5"
    for unchanged in (
        ["--strategy", "zero3", "--bucket-mb", "4"],
        ["--strategy", "zero3"],
        ["--strategy", "zero2", "--bucket-mb", "1.5"],
        [*half_block, "--no-keep-last-block"],
    ):
        assert keep_budget_of_one_bucket(unchanged, "gpt-small") == []


def test_predict_prices_the_all_gathers_rate_where_a_run_measured_it():
    from predict import link_bits

    assert link_bits({"measured_bits_per_second": 48e6}) == 48e6
    assert link_bits({"measured_bits_per_second": 48e6, "collective_bits_per_second": 38e6}) == 38e6


def test_predict_refuses_an_inductor_run():
    from predict import predictions

    report = {"args": {"lowering": "inductor"}, "links": []}
    with pytest.raises(SystemExit, match="inductor run fuses"):
        predictions(report)


def test_refuses_without_privileges_or_tools(monkeypatch, capsys):
    import cluster
    import run

    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    assert run.main(["--quick"]) == 2
    assert "needs root" in capsys.readouterr().err
    monkeypatch.setattr(
        cluster.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool
    )
    assert run.main(["--quick"]) == 2
    assert "needs tc (package iproute2)" in capsys.readouterr().err


@pytest.mark.skipif(
    not CAN_RUN, reason="needs root with ip and tc (network namespaces, traffic shaping)"
)
def test_cpu_per_rank_holds_a_rank_in_a_node_to_its_share_of_a_core():
    """A rank that joins its cgroup gets no more CPU than its quota, even on
    an idle host, from inside a node's namespace (where /sys is the
    namespace's own); every cgroup and the mount go with the cluster."""
    from cluster import EmulatedCluster

    with EmulatedCluster(nodes=1, rate="1gbit", cpu_per_rank=0.25) as cluster:
        env = {**cluster.cpu_shares(world=2), "RANK": "1"}
        spin = (
            "import time\n"
            "from cluster import join_cpu_share\n"
            "join_cpu_share()\n"
            "line = [l for l in open('/proc/self/cgroup') if ':cpu:' in l][0].strip()\n"
            "start, cpu = time.monotonic(), time.process_time()\n"
            "while time.monotonic() - start < 1.0:\n"
            "    pass\n"
            "print(line, time.process_time() - cpu, flush=True)\n"
        )
        done = subprocess.run(
            [*cluster.exec_args(0, env), sys.executable, "-c", spin],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT / "benchmarks",
        )
        assert done.returncode == 0, done.stderr[-2000:]
        group, cpu_seconds = done.stdout.split()
        assert group.endswith(f"/zppc{cluster.tag}/r1")
        mount = cluster.cpu_mount
        stat = (mount / f"zppc{cluster.tag}" / "r1" / "cpu.stat").read_text()
        throttled = int(stat.split("nr_throttled ")[1].split()[0])
    # A second of spinning at a quarter of a core.
    assert float(cpu_seconds) < 0.6 and throttled > 0
    assert not mount.exists()


def test_cpu_per_rank_takes_a_positive_share_or_auto(capsys):
    import run
    from cluster import resolve_cpu_per_rank

    assert run.parse_args(["--cpu-per-rank", "0.5"]).cpu_per_rank == 0.5
    assert resolve_cpu_per_rank(run.parse_args(["--cpu-per-rank", "auto"]).cpu_per_rank, 4) == (
        os.cpu_count() / 4
    )
    assert run.parse_args([]).cpu_per_rank is None
    for bad in ("0", "-1", "half"):
        with pytest.raises(SystemExit):
            run.parse_args(["--cpu-per-rank", bad])
        assert f"a positive share of a core or auto, got '{bad}'" in capsys.readouterr().err


def test_benchmark_scripts_do_not_shadow_what_transformers_imports(tmp_path):
    """`python benchmarks/X.py` puts benchmarks/ first on sys.path, and spawned
    ranks inherit it. A script named like a package transformers imports when
    it finds one (it once was `kernels.py`) breaks building any Hugging Face
    model there."""
    pytest.importorskip("transformers")
    build = (
        "import sys; sys.path.insert(0, sys.argv[1]); import transformers; "
        "transformers.GPT2LMHeadModel(transformers.GPT2Config("
        "n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8)); print('built')"
    )
    done = subprocess.run(
        [sys.executable, "-c", build, str(ROOT / "benchmarks")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("built")


def test_plan_time_sums_every_pass_and_grows_with_the_depth():
    from plan_time import plan
    from zppc.passes import build_passes

    import zppc

    shallow, deep = (plan(layers, "zero3", world=8, node=4) for layers in (1, 2))
    assert 0 < shallow["nodes"] < deep["nodes"]
    assert 0 < shallow["passes_seconds"] <= shallow["compile_seconds"]
    assert deep["slowest"].split()[0] in {p.name for p in build_passes(zppc.Config())}


@pytest.mark.slow
@pytest.mark.skipif(
    not CAN_RUN, reason="needs root with ip and tc (network namespaces, traffic shaping)"
)
def test_overlap_ceiling_times_every_collective_and_work(tmp_path):
    out = tmp_path / "ceiling.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overlap_ceiling.py"), "--inter-bw", "1gbit"]
        + ["--ranks-per-node", "1", "--reps", "1", "--shard-mb", "0.5", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {(r["collective"], r["work"]) for r in rows} == {
        (kind, work) for kind in ("all_gather", "all_reduce") for work in ("matmul", "sleep")
    }
    assert all(min(r["collective_s"], r["work_s"], r["both_s"]) > 0 for r in rows)
    assert "| hidden |" in done.stdout


def test_repeated_runs_report_each_rows_median_run(capsys):
    """With --repeats a link's row is its median run by step time (failed runs
    left out, every run listed in order), the link rate the runs' median;
    the overlap table gives each run's hidden share beside the medians'."""
    import run

    def ok(config, step):
        return {
            "config": config,
            "status": "ok",
            "median_step_seconds": step,
            "wire_bytes": 6 * 50e6,
            "timed_steps": 6,
        }

    fast = [
        {"measured_bits_per_second": 1e10, "rows": [ok("zppc-zero3", s), ok("torch-fsdp2", 5.0)]}
        for s in (6.0, 7.0, 5.0)
    ]
    slow_rows = [
        [ok("zppc-zero3", 6.5), ok("torch-fsdp2", 12.0)],
        [
            ok("zppc-zero3", 9.0),
            {"config": "torch-fsdp2", "status": "failed: gloo", "log": "gloo aborted"},
        ],
        [
            {**ok("zppc-zero3", 7.5), "retried_after": {"status": "failed: gloo"}},
            ok("torch-fsdp2", 13.0),
        ],
    ]
    slow = [
        {"measured_bits_per_second": bits, "collective_bits_per_second": 0.8 * bits, "rows": rows}
        for bits, rows in zip((50e6, 40e6, 60e6), slow_rows, strict=True)
    ]
    links = [run.merge_runs("10gbit", fast), run.merge_runs("50mbit", slow)]
    zero3, fsdp2 = links[1]["rows"]
    assert links[1]["measured_bits_per_second"] == 50e6
    assert links[1]["measured_bits_per_second_runs"] == [50e6, 40e6, 60e6]
    # The all-gathers' rate (zppc links, what the cost model prices) likewise;
    # a run without one (recorded before it) has none.
    assert links[1]["collective_bits_per_second"] == pytest.approx(40e6)
    assert links[1]["collective_bits_per_second_runs"] == pytest.approx([40e6, 32e6, 48e6])
    assert "collective_bits_per_second" not in links[0]
    assert zero3["median_step_seconds"] == 7.5 and links[0]["rows"][0]["median_step_seconds"] == 6.0
    assert [r["median_step_seconds"] for r in zero3["runs"]] == [6.5, 9.0, 7.5]
    # Two runs left: the lower middle one.
    assert fsdp2["median_step_seconds"] == 12.0
    assert [r["status"] for r in fsdp2["runs"]] == ["ok", "failed: gloo", "ok"]
    assert fsdp2["runs"][1]["log"] == "gloo aborted" and "log" not in fsdp2["runs"][0]
    assert [r["retried"] for r in zero3["runs"]] == [False, False, True]
    # One run is the run itself, as before repeats existed.
    single = run.merge_runs("50mbit", slow[:1])
    assert single["rows"][0] == slow_rows[0][0] and "measured_bits_per_second_runs" not in single

    run.print_overlap({"args": {"nodes": "2"}, "links": links})
    table = capsys.readouterr().out
    # 50 MB a step, 25 MB per node: 4 s at 50 Mbit/s. Median step 7.5 against compute 6.0:
    # (6 + 4 - 7.5) / 4 = 62%, step / max 1.25; run 1 hides (6 + 4 - 6.5) / 4 = 88%,
    # run 2 (7 + 5 - 9) / 5 = 60%, run 3 (5 + 3.33 - 7.5) / 3.33 = 25%.
    assert (
        "| 50mbit | zppc-zero3 | 7.500 | 6.000 | 4.000 | 1.25 | 62% "
        "| 88% (1.08), 60% (1.29), 25% (1.50) |" in table
    )
    assert (
        "| 50mbit | torch-fsdp2 | 12.000 | 5.000 | 4.000 | 2.40 | -75% | -75% (2.40), -140% (2.60) |"
        in table
    )


def test_communication_measured_alone_sets_the_second_overlap_table(capsys):
    """With --comm-batch-size every row's run at that batch is kept beside it;
    a link's row gets the median of those steps, chosen apart from the main
    runs' median, and the overlap table is printed a second time with
    communication = that step on the slow link less the one on the fastest,
    for the medians and for each run."""
    import run

    def ok(step, alone):
        return {
            "config": "zppc-zero3",
            "status": "ok",
            "median_step_seconds": step,
            "wire_bytes": 6 * 50e6,
            "timed_steps": 6,
            "comm_only": {"batch_size": 1, "status": alone[0], "median_step_seconds": alone[1]},
        }

    fast = [
        {"measured_bits_per_second": 1e10, "rows": [ok(6.0, ("ok", 0.5))]},
        {"measured_bits_per_second": 1e10, "rows": [ok(5.0, ("ok", 0.3))]},
        {"measured_bits_per_second": 1e10, "rows": [ok(7.0, ("ok", 0.4))]},
    ]
    slow = [
        {"measured_bits_per_second": 50e6, "rows": [ok(8.0, ("ok", 6.5))]},
        {"measured_bits_per_second": 50e6, "rows": [ok(7.0, ("failed: gloo", None))]},
        {"measured_bits_per_second": 50e6, "rows": [ok(9.0, ("ok", 5.5))]},
    ]
    links = [run.merge_runs("10gbit", fast), run.merge_runs("50mbit", slow)]
    (zero3,) = links[1]["rows"]
    # Main median: 8.0 (run 1); alone: the lower middle of 5.5 and 6.5, from run 3.
    assert zero3["median_step_seconds"] == 8.0 and zero3["comm_only_step_seconds"] == 5.5
    assert links[0]["rows"][0]["comm_only_step_seconds"] == 0.4
    assert [r["comm_only_step_seconds"] for r in zero3["runs"]] == [6.5, None, 5.5]

    run.print_overlap({"args": {"nodes": "2", "comm_batch_size": "1"}, "links": links})
    tables = capsys.readouterr().out.split("### ")
    assert len(tables) == 3 and "batch 1 on the link less at 10gbit" in tables[2]
    # Link time 25 MB per node at 50 Mbit/s = 4 s, as before.
    assert "| 50mbit | zppc-zero3 | 8.000 | 6.000 | 4.000 | 1.33 | 50% " in tables[1]
    # Alone: 5.5 - 0.4 = 5.1 s; (6 + 5.1 - 8) / 5.1 = 61%, step / max 8 / 6 = 1.33.
    # Run 1: 6.5 - 0.5 = 6.0, (6 + 6 - 8) / 6 = 67% (1.33); run 2's alone failed;
    # run 3: 5.5 - 0.4 = 5.1, (7 + 5.1 - 9) / 5.1 = 61% (1.29).
    assert (
        "| 50mbit | zppc-zero3 | 8.000 | 6.000 | 5.100 | 1.33 | 61% | 67% (1.33), 61% (1.29) |"
        in tables[2]
    )
    # Rows that did not run alone print the link-time table only.
    for link in links:
        for row in link["rows"]:
            row.pop("comm_only_step_seconds")
    run.print_overlap({"args": {"nodes": "2"}, "links": links})
    assert capsys.readouterr().out.count("### ") == 1
