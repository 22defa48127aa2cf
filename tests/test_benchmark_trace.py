"""benchmarks/step_trace.py's reading of a profiler trace, on a hand-made one:
which communication counts as hidden, and which collectives outlive the
backward that issued them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

step_trace = pytest.importorskip("step_trace")

MAIN, GLOO = 1, 2


def span(name: str, start: float, end: float, tid: int = MAIN) -> dict:
    return {"ph": "X", "name": name, "ts": start, "dur": end - start, "tid": tid}


def test_hidden_is_communication_while_the_main_thread_waits_for_nothing():
    events = [
        span("step 1 forward", 0, 100),
        span("step 1 backward", 100, 300),
        span("step 1 optimizer", 300, 350),
        span("step 2 forward", 350, 450),
        span("step 2 backward", 450, 650),
        span("step 2 optimizer", 650, 700),
        # A gather for 0-40 waited for over 10-40: 10 of its 40 hidden.
        span("gloo:all_gather", 0, 40, GLOO),
        span("_c10d_functional::wait_tensor", 10, 40),
        # A reduction issued at 250 outlives the backward: 50 under the
        # optimizer step, 30 under the next forward; a zppc wait covers 360-380.
        span("gloo:all_reduce", 250, 380, GLOO),
        span("zppc::wait", 360, 380),
        span("aten::mm", 120, 130),  # operators count as compute, like Python time
    ]
    result = step_trace.analyse(events)
    forward = result["phases"]["step 1 forward"]
    assert forward["communication_seconds"] == pytest.approx(40e-6)
    assert forward["waiting_seconds"] == pytest.approx(30e-6)
    assert forward["hidden_seconds"] == pytest.approx(10e-6)
    assert result["phases"]["step 1 backward"]["hidden_seconds"] == pytest.approx(50e-6)
    assert result["communication_seconds"] == pytest.approx(170e-6)
    assert result["hidden_seconds"] == pytest.approx((10 + 130 - 20) * 1e-6)
    (carried,) = result["carried_past_backward"]
    assert carried["collective"] == "gloo:all_reduce"
    assert carried["after_backward_seconds"] == pytest.approx(80e-6)
    assert carried["under"] == pytest.approx(
        {"optimizer": 50e-6, "forward": 30e-6, "backward": 0.0}
    )
    # The link idle, longest first: where no collective ran inside a phase.
    idle = result["link_idle"]
    assert [g["phase"] for g in idle] == [
        "step 2 backward",
        "step 1 backward",
        "step 2 forward",
        "step 1 forward",
        "step 2 optimizer",
    ]
    assert [g["seconds"] for g in idle] == pytest.approx([200e-6, 150e-6, 70e-6, 60e-6, 50e-6])
    assert [g["after_start_seconds"] for g in idle] == pytest.approx([0, 0, 30e-6, 40e-6, 0])


@pytest.mark.timeout(600)
def test_the_script_traces_two_steps_of_two_ranks(tmp_path):
    """The whole script under torchrun: its arguments are what the shared
    `worker.build` reads (a missing `--reduce-scatter` once broke it)."""
    script = Path(step_trace.__file__)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
        + ["--preset", "gpt-tiny", "--warmup", "1", "--block", "32", "--out", str(tmp_path)]
        + ["--every-rank"],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "trace_zppc-zero3.json.gz").exists()
    assert (tmp_path / "trace_zppc-zero3_rank1.json.gz").exists()
    assert "| all |" in done.stdout
    summary = json.loads((tmp_path / "trace_zppc-zero3_summary.json").read_text())
    assert len(summary["ranks"]["step 2 optimizer"]["ends"]) == 2
    steps = summary["idle_cores"]["steps"]
    assert list(steps) == ["step 1", "step 2"]
    for st in steps.values():
        assert sum(st["seconds_with_ranks_waiting"]) == pytest.approx(st["seconds"])
    assert "idle core-seconds" in done.stdout


def test_the_script_refuses_a_cpu_share_without_the_emulated_cluster(tmp_path):
    """`--cpu-per-rank` acts only on the emulated cluster's ranks: without
    `--inter-bw` it once ran, ignored."""
    done = subprocess.run(
        [sys.executable, str(Path(step_trace.__file__)), "--cpu-per-rank", "0.5"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "--cpu-per-rank" in done.stderr and "give --inter-bw too" in done.stderr


def test_phase_spread_reads_every_rank_on_the_common_clock():
    """Two ranks' traces whose own clocks start 1 ms apart: rank 1 ends its
    forward 30 us after rank 0 on the common clock, though its own
    timestamps read 970 us earlier."""

    def trace(base_ns: int, phases: dict) -> dict:
        events = [span(name, a, b) for name, (a, b) in phases.items()]
        return {"baseTimeNanoseconds": base_ns, "traceEvents": events}

    rank0 = trace(0, {"step 1 forward": (1000, 2000), "step 1 backward": (2000, 4000)})
    rank1 = trace(1_000_000, {"step 1 forward": (10, 1030), "step 1 backward": (1030, 3010)})
    phases = step_trace.phase_spread([rank0, rank1])
    assert list(phases) == ["step 1 forward", "step 1 backward"]
    forward = phases["step 1 forward"]
    assert forward["starts"] == pytest.approx([0.0, 10e-6])
    assert forward["ends"] == pytest.approx([1000e-6, 1030e-6])
    assert forward["end_spread_seconds"] == pytest.approx(30e-6)
    assert phases["step 1 backward"]["end_spread_seconds"] == pytest.approx(10e-6)


def test_idle_cores_counts_ranks_waiting_at_once_on_the_common_clock():
    """Two ranks on one core, step 1 over 0-1000 us on the common clock (rank
    1's own clock starts 100 us later). Rank 0 waits 200-600 and 850-880;
    rank 1 waits 400-800 and 840-890, and before its forward (it starts at
    50) and after its optimizer step (done at 950). The core idles only
    while both wait (400-600 and 850-880); a wait on another thread (a gloo
    worker) is no rank waiting."""

    def trace(base_ns: int, shift: float, phases: dict, waits: list) -> dict:
        events = [span(name, a - shift, b - shift) for name, (a, b) in phases.items()]
        events += [span("_c10d_functional::wait_tensor", a - shift, b - shift) for a, b in waits]
        events.append(span("gloo:all_gather", 0, 900 - shift, GLOO))
        events.append(span("wait on a worker", 0, 900 - shift, GLOO))
        return {"baseTimeNanoseconds": base_ns, "traceEvents": events}

    steps = {"step 1 forward": (0, 300), "step 1 backward": (300, 900)}
    rank0 = trace(0, 0, {**steps, "step 1 optimizer": (900, 1000)}, [(200, 600), (850, 880)])
    steps["step 1 forward"] = (50, 300)
    rank1 = trace(100_000, 100, {**steps, "step 1 optimizer": (900, 950)}, [(400, 800), (840, 890)])
    idle = step_trace.idle_cores([rank0, rank1], cores=1, shown_s=100e-6)
    assert idle["cores"] == 1
    st = idle["steps"]["step 1"]
    assert st["seconds"] == pytest.approx(1000e-6)
    # None waiting: 50-200, 800-840, 890-950; one: 0-50, 200-400, 600-800,
    # 840-850, 880-890, 950-1000; both: 400-600, 850-880.
    assert st["seconds_with_ranks_waiting"] == pytest.approx([250e-6, 520e-6, 230e-6])
    assert st["idle_core_seconds"] == pytest.approx(230e-6)
    (stretch,) = st["all_waiting"]  # 850-880 is shorter than shown_s
    assert stretch["after_start_seconds"] == pytest.approx(400e-6)
    assert stretch["seconds"] == pytest.approx(200e-6)
    assert stretch["rank0_phase"] == "step 1 backward"
    # Two cores: one idles while one rank waits, both while both do.
    two = step_trace.idle_cores([rank0, rank1], cores=2)["steps"]["step 1"]
    assert two["idle_core_seconds"] == pytest.approx((520 + 2 * 230) * 1e-6)
    # Each rank held to half a core (--cpu-per-rank 0.5): one core idles even
    # while both compute, one and a half while one does.
    halves = step_trace.idle_cores([rank0, rank1], cores=2, core_per_rank=0.5)
    assert halves["core_per_rank"] == 0.5
    assert halves["steps"]["step 1"]["idle_core_seconds"] == pytest.approx(
        (250 + 1.5 * 520 + 2 * 230) * 1e-6
    )


def gpu(name: str, start: float, end: float, stream: int, cat: str = "kernel") -> dict:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": start,
        "dur": end - start,
        "pid": 0,
        "tid": stream,
        "args": {"device": 0, "stream": stream},
    }


def test_on_the_gpu_communication_is_every_other_stream_and_hidden_is_beside_a_kernel():
    """NCCL's own stream, found without its kernels' names (a world of one
    makes its collectives plain device copies); the compute stream is the one
    with the most kernel time, and its copies are not communication."""
    COMPUTE, NCCL = 7, 20
    events = [
        gpu("sm80_gemm", 0, 50, COMPUTE),
        gpu("triton_poi_fused", 60, 100, COMPUTE),
        gpu("Memcpy HtoD", 100, 110, COMPUTE, "gpu_memcpy"),  # the batch: not communication
        gpu("Memcpy DtoD", 40, 70, NCCL, "gpu_memcpy"),  # 10 beside the gemm, 10 beside triton
        gpu("ncclDevKernel_AllGather", 105, 125, NCCL),  # beside no kernel
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "nccl:all_gather_into_tensor",
            "ts": 30,
            "dur": 5,
            "tid": 1,
        },
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5, "tid": 1},
    ]
    result = step_trace.analyse_gpu(events)
    assert result["communication_seconds"] == pytest.approx(50e-6)
    assert result["hidden_seconds"] == pytest.approx(20e-6)
    assert result["compute_kernel_seconds"] == pytest.approx(90e-6)
    assert result["gpu_seconds"] == pytest.approx(125e-6)
    assert result["collectives_issued"] == 1
    roles = {s["stream"]: s["role"] for s in result["streams"]}
    assert roles == {COMPUTE: "compute", NCCL: "communication"}


def test_a_trace_without_gpu_activity_is_refused():
    with pytest.raises(ValueError, match="no GPU activity"):
        step_trace.analyse_gpu([span("step 1 forward", 0, 100)])
