"""qgZ: the two-hop gradient reduction, on gloo ranks emulating nodes.

With quantization off (`qgz_quantize=False`) the two hops must give what plain
reduce-scatter gives, to fp32 summation noise: that checks the reorder, the
hops' groups and the mean. With it on, the gradients are measured against the
exact ones (signal-to-noise) and the ledger against plain zero3.
"""

import math

import pytest
import torch
from qgz_workers import (
    accumulated_gradients,
    error_feedback_resume,
    hop_order,
    reduced_gradients,
)
from spawn import run_ranks
from zppc.kernels import qgz as qgz_kernels
from zppc.kernels.qgz import dequantize_sum, exact_sum, quantize_rows, reorder_for_two_hops
from zppc.kernels.quant import HAS_TRITON, quantize_pack_reference

EXACT = dict(qgz="int4", qgz_quantize=False)
STRATEGIES = ("zero3", "zero2", "zero1", "ddp")


def snr_db(results, base, name) -> float:
    """Signal-to-noise of variant `name` against `base`, over every rank's shards."""
    signal = noise = 0.0
    for r in results:
        for fqn, ref in r[base]["grads"].items():
            signal += float(ref.double().square().sum())
            noise += float((r[name]["grads"][fqn].double() - ref.double()).square().sum())
    return 10 * math.log10(signal / max(noise, 1e-300))


def max_gap(results, base, name) -> float:
    return max(
        (r[name]["grads"][fqn] - ref).abs().max().item()
        for r in results
        for fqn, ref in r[base]["grads"].items()
    )


# ------------------------------------------------------------- the arithmetic


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 129), (5, 64)])
def test_each_row_is_its_own_payload(bits, shape):
    rows = torch.randn(shape)
    payloads = quantize_rows(rows, 64, bits)
    for r in range(shape[0]):
        assert torch.equal(payloads[r], quantize_pack_reference(rows[r], 64, bits))


def test_reorder_puts_each_local_rank_its_shards_node_by_node():
    nodes, per_node, shard = 3, 2, 5
    flat = torch.arange(nodes * per_node * shard, dtype=torch.float32)
    rows = reorder_for_two_hops(flat, nodes, per_node)
    for d in range(per_node):
        owners = [k * per_node + d for k in range(nodes)]
        expected = torch.cat([flat[o * shard : (o + 1) * shard] for o in owners])
        assert torch.equal(rows[d], expected)


def test_sums_run_in_fp32_in_a_fixed_order():
    rows = torch.tensor([[1e8, 1.0], [-1e8, 1.0], [1.0, 1.0]], dtype=torch.bfloat16)
    assert exact_sum(rows.view(-1), 3).dtype == torch.float32
    payload = quantize_rows(rows.float(), 64, 8)
    total = dequantize_sum(payload.view(-1), 3, 2, 64, 8)
    assert total.dtype == torch.float32 and total.shape == (2,)


def received_payloads(peers: int, numel: int, block: int, bits: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(peers * 1000 + numel)
    values = torch.randn(peers, numel, generator=gen) * torch.arange(1, peers + 1)[:, None]
    return quantize_rows(values, block, bits).view(-1)


# (peers, rows, shard, block): odd shards, blocks that straddle rows, one row.
BETWEEN_HOPS = [(2, 2, 5, 4), (3, 2, 130, 64), (2, 3, 77, 6), (4, 1, 33, 64)]


@pytest.mark.parametrize("bits, out_bits", [(8, 8), (8, 4), (4, 8), (4, 4)])
def test_fused_kernel_between_hops_equals_reference_bit_for_bit(bits, out_bits):
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    for peers, rows, shard, block in BETWEEN_HOPS:
        args = (peers, rows * shard, block, bits, rows, out_bits)
        received = received_payloads(peers, rows * shard, block, bits)
        reference = qgz_kernels.dequantize_sum_requantize(received, *args)
        assert torch.equal(qgz_kernels.dequantize_sum_requantize_triton(received, *args), reference)
        # The custom op graphs call: the reference off CUDA.
        assert torch.equal(torch.ops.zppc.dequantize_sum_requantize(received, *args), reference)


# ------------------------------------------------------ two hops on gloo ranks


@pytest.fixture(scope="module")
def exact_two_by_two():
    variants = {}
    for strategy in STRATEGIES:
        variants[strategy] = dict(strategy=strategy)
        variants[f"{strategy}+qgz"] = dict(strategy=strategy, **EXACT)
    return run_ranks(reduced_gradients, 4, 2, variants, timeout=840)


@pytest.mark.multiproc
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unquantized_two_hops_equal_reduce_scatter(exact_two_by_two, strategy):
    gap = max_gap(exact_two_by_two, strategy, f"{strategy}+qgz")
    print(f"{strategy}: two hops vs plain reduction, largest gap {gap:.2e}")
    assert gap <= 1e-7
    for r in exact_two_by_two:
        kinds = [(kind, size) for graph, kind, size, *_ in r[f"{strategy}+qgz"]["schedule"]]
        # One all-to-all per hop for the whole bucket: intra-node (2), then inter-node (2).
        assert kinds.count(("all_to_all", 2)) == 2, kinds
        assert not any(k in ("reduce_scatter", "all_reduce") for k, _ in kinds), kinds


@pytest.mark.multiproc
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)])
def test_unquantized_two_hops_in_half_precision(dtype):
    results = run_ranks(reduced_gradients, 4, 2, {"plain": {}, "qgz": EXACT}, dtype, timeout=840)
    gap, snr = max_gap(results, "plain", "qgz"), snr_db(results, "plain", "qgz")
    print(f"{dtype}: largest gap {gap:.2e}, {snr:.1f} dB (plain sums in {dtype}, qgZ in fp32)")
    assert snr >= 45


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_node_is_one_hop_with_a_warning():
    results = run_ranks(reduced_gradients, 4, 4, {"plain": {}, "qgz": EXACT}, timeout=840)
    assert max_gap(results, "plain", "qgz") <= 1e-7
    for r in results:
        assert any("single node" in w for w in r["qgz"]["warnings"])
        a2a = [row for row in r["qgz"]["schedule"] if row[1] == "all_to_all"]
        assert len(a2a) == 1 and a2a[0][2] == 4 and a2a[0][4] == 0


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("node_size", [4, 2])
def test_unquantized_two_hops_on_eight_ranks(node_size):
    results = run_ranks(reduced_gradients, 8, node_size, {"plain": {}, "qgz": EXACT}, timeout=1700)
    gap = max_gap(results, "plain", "qgz")
    print(f"8 ranks as {8 // node_size} x {node_size}: largest gap {gap:.2e}")
    assert gap <= 1e-7


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_hops_of_consecutive_buckets_are_pipelined():
    # Small buckets: several per backward. Bucket i's inter-node hop is still
    # in flight when bucket i+1's intra-node hop is issued and waited for.
    events = run_ranks(hop_order, 4, 2, 64 * 1024, timeout=840)[0]
    issues = [e for e in events if e[0] == "issue"]
    assert len(issues) >= 6 and issues == [("issue", "intra"), ("issue", "inter")] * (
        len(issues) // 2
    )

    # The k-th inter-node hop is waited only after bucket k + 1's intra-node
    # hop was issued (hops of one kind complete in order).
    def positions(event):
        return [i for i, e in enumerate(events) if e == event]

    inter_waits, intra_issues = positions(("wait", "inter")), positions(("issue", "intra"))
    assert len(inter_waits) == len(intra_issues) == len(issues) // 2
    assert all(inter_waits[k] > intra_issues[k + 1] for k in range(len(intra_issues) - 1))


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_gradient_signal_to_noise_on_the_small_gpt():
    variants = {"plain": {}, "int4": dict(qgz="int4"), "int8": dict(qgz="int8")}
    results = run_ranks(reduced_gradients, 4, 2, variants, "float32", "gpt", timeout=840)
    int4, int8 = snr_db(results, "plain", "int4"), snr_db(results, "plain", "int8")
    print(f"qgZ gradient SNR against reduce-scatter: int4 {int4:.1f} dB, int8 {int8:.1f} dB")
    assert int4 >= 18 and int8 >= 38


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_error_feedback_keeps_errors_from_accumulating():
    variants = {
        "exact": {},
        "int4": dict(qgz="int4"),
        "int4+feedback": dict(qgz="int4", qgz_error_feedback=True),
    }
    results = run_ranks(accumulated_gradients, 4, 2, variants, 10, timeout=840)
    plain, feedback = snr_db(results, "exact", "int4"), snr_db(results, "exact", "int4+feedback")
    print(
        f"10 accumulated steps, int4 qgZ against exact: {plain:.1f} dB without error "
        f"feedback, {feedback:.1f} dB with it ({feedback - plain:+.1f} dB)"
    )
    assert feedback >= plain + 6
    # One residual per bucket and hop, the same keys on every rank.
    keys = results[0]["int4+feedback"]["residuals"]
    assert keys and all(r["int4+feedback"]["residuals"] == keys for r in results)


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_error_feedback_residuals_are_checkpointed(tmp_path):
    for r in run_ranks(error_feedback_resume, 4, str(tmp_path / "ckpt"), timeout=840):
        assert r["saved"]
        # Resumed with its residuals, training continues exactly; without them
        # it does not (so the comparison can fail).
        assert r["gap_with_residuals"] == 0.0
        assert r["gap_without"] > 0.0


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_zeropp_cuts_inter_node_bytes_fourfold():
    variants = {"zero3": {}, "zero++": dict(qwz="int8", hpz=True, qgz="int4")}
    results = run_ranks(reduced_gradients, 4, 2, variants, "bfloat16", "gpt", timeout=840)
    for r in results:
        plain, zpp = r["zero3"]["comm"], r["zero++"]["comm"]
        ratio = plain["inter_node_bytes"] / zpp["inter_node_bytes"]
        print(
            f"inter-node bytes per step: zero3 {plain['inter_node_bytes']}, "
            f"zero++ {zpp['inter_node_bytes']} ({ratio:.2f}x fewer)"
        )
        assert ratio >= 4
        backward_gathers = [
            row for row in r["zero++"]["schedule"] if row[:2] == ("backward", "all_gather")
        ]
        assert backward_gathers and all(row[4] == 0 for row in backward_gathers)
        hops = [row for row in r["zero++"]["schedule"] if row[1] == "all_to_all"]
        # Per bucket (the edge bucket, then the rest): the intra-node hop, then...
        buckets = len(hops) // 2
        assert buckets >= 1 and [row[3] > 0 for row in hops] == [True, False] * buckets
        assert [row[4] > 0 for row in hops] == [False, True] * buckets  # ...the inter-node hop


# The default tier runs qgZ under Inductor in tests/test_differential.py.
@pytest.mark.multiproc
@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_inductor_two_hops_equal_reduce_scatter():
    variants = {"plain": {}, "qgz": EXACT, "int4": dict(qgz="int4")}
    results = run_ranks(
        reduced_gradients, 4, 2, variants, "float32", "mlp", "inductor", timeout=1100
    )
    assert max_gap(results, "plain", "qgz") <= 1e-6
    assert snr_db(results, "plain", "int4") >= 12
