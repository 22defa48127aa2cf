"""`measure_links` / `zppc links`: the links' rates as all-gathers over the
job's own groups get them, and `zppc schedule --links` planning with them;
`measure_compute` / `measure_cost_model`: the compute rates and a whole cost
model measured the same way."""

from __future__ import annotations

import json

import pytest
from spawn import run_ranks
from workers import measure_compute_on_ranks, measure_cost_model_on_ranks, measure_links_on_ranks

from zppc.cli import main
from zppc.cost import DEFAULT_LINKS, Compute, CostModel, Links
from zppc.measure import (
    ELEMENTWISE_BYTES,
    MATMUL_SIDE,
    LinkMeasurement,
    measure_compute,
    measure_cost_model,
    measure_links,
)

MESSAGE = 256 * 1024


def _transfer(seconds: float, latency: float) -> float:
    return max(seconds - latency, seconds / 2)


@pytest.mark.multiproc
@pytest.mark.parametrize("inter_per_node", [False, True])
def test_every_rank_measures_the_same_links_on_two_nodes_of_two(inter_per_node):
    results = run_ranks(measure_links_on_ranks, 4, 2, inter_per_node, MESSAGE)
    assert all(r == results[0] for r in results), "ranks measured different links"
    m = LinkMeasurement(**results[0])
    assert (m.backend, m.world_size, m.node_size, m.message_bytes) == ("gloo", 4, 2, MESSAGE)
    assert m.inter_per_node is inter_per_node
    # Inside a node a rank brings in its one peer's chunk; across the nodes the
    # other node's chunk, for the rank or (a shared link) for both ranks of the node.
    intra = MESSAGE / _transfer(m.intra_seconds, m.intra_latency_seconds)
    inter = MESSAGE / _transfer(m.inter_seconds, m.inter_latency_seconds)
    assert m.intra_bytes_per_second == pytest.approx(intra)
    assert m.inter_bytes_per_second == pytest.approx(inter * (2 if inter_per_node else 1))
    # On loopback a 4-byte all-gather can take longer than the message's (two
    # repeats each): the rates above then count half the time as latency.
    assert 0 < m.latency_seconds and 0 < m.intra_latency_seconds and 0 < m.inter_latency_seconds
    links = m.links(DEFAULT_LINKS)
    assert links.gloo and links.inter_per_node is inter_per_node
    assert links.latency_seconds == m.latency_seconds
    assert links.inter_bytes_per_second == m.inter_bytes_per_second


@pytest.mark.multiproc
def test_one_node_measures_no_inter_node_link():
    (m, _) = run_ranks(measure_links_on_ranks, 2, 2, False, MESSAGE)
    m = LinkMeasurement(**m)
    assert m.inter_seconds is None and m.inter_bytes_per_second is None
    assert m.intra_bytes_per_second > 0
    assert m.links(DEFAULT_LINKS).inter_bytes_per_second == DEFAULT_LINKS.inter_bytes_per_second
    assert not any(flag.startswith("--inter-bw") for flag in m.schedule_flags())


@pytest.mark.multiproc
def test_uneven_nodes_are_refused_on_every_rank_before_any_collective():
    results = run_ranks(measure_links_on_ranks, 4, 3, False, MESSAGE)
    assert results == ["ValueError: measure_links needs world_size % node_size == 0, got 4 % 3"] * 4


@pytest.mark.multiproc
def test_every_rank_measures_the_same_compute_rates_in_the_cost_models_units():
    results = run_ranks(measure_compute_on_ranks, 2, "float32")
    rates = [r[0] for r in results]
    assert rates[0] == rates[1], "ranks measured different compute rates"
    compute = Compute(**rates[0])
    # The slowest rank's median, against one more run each rank timed itself
    # (both ranks at once again): the same figure to within the noise of a
    # shared machine, so FLOPs and bytes are counted in the cost model's units.
    slowest_matmul = max(r[1] for r in results)
    slowest_add = max(r[2] for r in results)
    assert compute.flops_per_second == pytest.approx(
        2 * MATMUL_SIDE["cpu"] ** 3 / slowest_matmul, rel=0.75
    )
    assert compute.memory_bytes_per_second == pytest.approx(
        2 * ELEMENTWISE_BYTES / slowest_add, rel=0.75
    )


@pytest.mark.multiproc
def test_a_compute_measurement_of_an_integer_dtype_is_refused_on_every_rank():
    results = run_ranks(measure_compute_on_ranks, 2, "int8")
    assert (
        results
        == [
            "ValueError: measure_compute needs repeats >= 1 and a floating dtype, got 3, torch.int8"
        ]
        * 2
    )


@pytest.mark.multiproc
def test_a_measured_cost_model_is_the_same_on_every_rank():
    results = run_ranks(measure_cost_model_on_ranks, 4, 2)
    assert all(r == results[0] for r in results), "ranks measured different cost models"
    model = CostModel(Links(**results[0]["links"]), Compute(**results[0]["compute"]))
    assert model.links.gloo and model.links.inter_per_node
    assert model.links.intra_bytes_per_second != DEFAULT_LINKS.intra_bytes_per_second
    assert model.links.latency_seconds > 0 and model.compute.flops_per_second > 0


def test_measuring_needs_a_process_group_and_the_cli_needs_torchrun(monkeypatch):
    with pytest.raises(ValueError, match="needs torch.distributed initialised"):
        measure_links()
    for measure in (measure_compute, measure_cost_model):
        with pytest.raises(ValueError, match=f"{measure.__name__} needs torch.distributed"):
            measure()
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="run it on every rank under torchrun"):
        main(["links"])


def _measurement(**changes) -> LinkMeasurement:
    fields = dict(
        backend="gloo",
        world_size=8,
        node_size=4,
        message_bytes=MESSAGE,
        repeats=3,
        latency_seconds=2e-3,
        intra_seconds=0.01,
        intra_latency_seconds=1e-3,
        inter_seconds=0.4,
        inter_latency_seconds=1.5e-3,
        intra_bytes_per_second=1.25e9,
        inter_bytes_per_second=4.5e6,
        inter_per_node=True,
    )
    return LinkMeasurement(**{**fields, **changes})


def _plan(capsys, *flags) -> dict:
    args = ["schedule", "gpt-tiny", "--world-size", "8", "--node-size", "4", "--format", "json"]
    assert main(args + list(flags)) == 0
    return json.loads(capsys.readouterr().out)


def test_schedule_plans_with_a_measurement_as_with_its_flags(capsys, tmp_path):
    path = tmp_path / "links.json"
    measured = _measurement()
    measured.save(path)
    assert LinkMeasurement.load(path) == measured
    from_file = _plan(capsys, "--links", str(path))
    from_flags = _plan(capsys, *measured.schedule_flags())
    # The flags round the rates to 4 digits; the file keeps them whole.
    assert from_file["totals"]["step_seconds"] == pytest.approx(
        from_flags["totals"]["step_seconds"], rel=1e-3
    )
    for a, b in zip(from_file["collectives"], from_flags["collectives"], strict=True):
        assert a["predicted_seconds"] == pytest.approx(b["predicted_seconds"], rel=1e-3)
        # A shared node link (--inter-link node) on gloo (two hops): the node's bytes.
        seconds = 2e-3 + a["intra_node_bytes"] / 1.25e9 + a["node_link_bytes"] / 4.5e6
        assert a["two_hops"] and a["predicted_seconds"] == pytest.approx(seconds)
    # A flag given on the command line wins over the file.
    faster = _plan(capsys, "--links", str(path), "--inter-bw", "9MB/s")
    assert faster["totals"]["step_seconds"] < from_file["totals"]["step_seconds"]
    assert faster["collectives"][0]["predicted_seconds"] == pytest.approx(
        2e-3
        + faster["collectives"][0]["intra_node_bytes"] / 1.25e9
        + faster["collectives"][0]["node_link_bytes"] / 9e6
    )


def test_schedule_plans_with_measured_compute_rates_as_with_their_flags(capsys, tmp_path):
    path = tmp_path / "links.json"
    measured = _measurement(
        flops_per_second=7.1e10, memory_bytes_per_second=4.96e9, compute_dtype="float32"
    )
    measured.save(path)
    flags = measured.schedule_flags()
    assert "--tflops=0.071" in flags and "--memory-bw=4960MB/s" in flags
    from_file = _plan(capsys, "--links", str(path))
    from_flags = _plan(capsys, *flags)
    assert from_file["totals"] == pytest.approx(from_flags["totals"], rel=1e-3)
    # The measured rates, not --device's: the same graphs' compute at 71 GFLOP/s
    # and 4.96 GB/s against an A100's peak (FLOPs only, the default); a flag
    # given wins over the file's.
    default = _plan(capsys)
    assert from_file["totals"]["compute_seconds"] > 100 * default["totals"]["compute_seconds"]
    faster = _plan(capsys, "--links", str(path), "--tflops", "312")
    assert faster["totals"]["compute_seconds"] < from_file["totals"]["compute_seconds"]
    # A file from before compute was measured still loads, with no compute flags.
    fields = json.loads(path.read_text())
    for key in ("flops_per_second", "memory_bytes_per_second", "compute_dtype"):
        del fields[key]
    path.write_text(json.dumps(fields))
    assert not any(f.startswith("--tflops") for f in LinkMeasurement.load(path).schedule_flags())


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_zppc_links_measures_links_and_compute_under_torchrun(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "links.json"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        + ["-m", "zppc", "links", "--compute", "--message-mb", "0.25", "--repeats", "2"]
        + ["-o", str(path)],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    measured = LinkMeasurement.load(path)
    assert (measured.world_size, measured.compute_dtype) == (2, "float32")
    assert measured.flops_per_second > 0 and measured.memory_bytes_per_second > 0
    assert "--tflops=" in done.stdout and "GFLOP/s" in done.stdout


def test_a_bad_measurement_file_is_a_clear_error(tmp_path):
    path = tmp_path / "links.json"
    path.write_text('{"backend": "gloo"}')
    with pytest.raises(SystemExit, match="cannot read a link measurement from"):
        main(["schedule", "gpt-tiny", "--world-size", "8", "--links", str(path)])
