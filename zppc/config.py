"""`zppc.Config`: every choice zppc makes about one model, checked once, up front.

All checks here are pure (no collective, no rank): every rank holds the same
Config and therefore raises the same error at the same point, so a bad config
can never leave some ranks waiting in a collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "rtp")
QWZ_FORMATS = (None, "int8", "int4")
QGZ_FORMATS = (None, "int4", "int8")
LOWERINGS = ("inductor", "eager")
BUFFER_SYNCS = ("broadcast", None)
NONFINITE_POLICIES = ("skip", "raise", None)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Default block sizes: one bf16 scale per block costs 2 bytes. int8 at 2048
# keeps 41.6 dB signal-to-noise on Gaussian data for 0.1% overhead; int4 needs
# blocks of 128 to stay above 18 dB (18.6 dB, 3% overhead; 2048 gives 16.4 dB).
DEFAULT_BLOCK = {"int8": 2048, "int4": 128}
# qgZ quantizes gradients, which are heavy-tailed, twice, and a bucket's rows
# mix tensors of different scales: on the small GPT's gradients (2 nodes x 2)
# int8 blocks of 2048 give 26.8 dB, of 256 34.6 dB, of 64 39.3 dB; int4 blocks
# of 128 give 17.0 dB, of 64 19.2 dB (against the exact reduce-scatter).
QGZ_DEFAULT_BLOCK = 64

# Bucket caps when `Config.bucket_bytes` is None: a model without a repeated
# block gets the largest; below the smallest a collective's latency outweighs
# the memory a smaller bucket would save.
MAX_BUCKET_BYTES = 25 * 2**20
MIN_BUCKET_BYTES = 2**20

OSP_SPLITS = ("last", "magnitude")
REDUCE_SCATTER_ALGORITHMS = ("auto", "native", "all_to_all", "two_hop")


@dataclass(frozen=True)
class Config:
    """How `zppc.distribute` shards a model and which passes the backend runs."""

    strategy: str = "zero3"
    """"ddp" replicates weights and all-reduces gradients; "zero1"/"zero2" keep
    optimizer state (and, for zero2, gradients) sharded and keep the gathered
    weight for backward; "zero3" also re-gathers weights in backward so no full
    weight outlives its use; "rtp" rotates weight shards around a ring."""

    qwz: str | None = None
    """Quantized weight all-gathers (ZeRO++ qwZ): None, "int8" or "int4". With
    strategy="rtp", the ring's weight hops travel quantized instead."""

    qwz_block: int | None = None
    """Elements per quantization block of qwZ (one bf16 scale each). None: the
    format's default (`DEFAULT_BLOCK`)."""

    hpz: bool = False
    """Keep a secondary shard over the node after the forward gather so that the
    backward gathers only inside the node (ZeRO++ hpZ)."""

    qgz: str | None = None
    """Quantized two-hop gradient all-to-all (ZeRO++ qgZ): None, "int4" or "int8"."""

    qgz_block: int | None = None
    """Elements per quantization block of qgZ's hops (one bf16 scale each).
    None: `QGZ_DEFAULT_BLOCK`."""

    qgz_intra_node: str | None = "int8"
    """Format of qgZ's first hop, inside the node: "int8", "int4" (DeepSpeed's
    choice: both hops int4) or None (unquantized). The intra-node links are the
    fast ones, and int8 there keeps an int4 qgZ's error near that of one int4
    quantization (small GPT gradients, int4 blocks of 128: 17.0 dB with an int8
    first hop, 14.8 dB with two int4 hops; Gaussian ones: 18.5 and 15.6 dB)."""

    qgz_error_feedback: bool = False
    """Keep each qgZ hop's quantization error on this rank and add it to that
    hop's values at the next step before quantizing (error feedback, as in
    DeepSpeed's LoCo): errors stop accumulating over steps. Costs one fp32
    copy of the values each hop quantizes (the first hop's is a full gradient);
    the residuals are part of `zppc.save` checkpoints."""

    qgz_quantize: bool = True
    """Debug switch: False keeps qgZ's reorder, two all-to-all hops and fp32
    sums but sends the gradients unquantized, so the result must equal plain
    reduce-scatter up to summation order."""

    osp: float | None = None
    """OSP: the fraction of gradient bytes deferred to stage 2, in (0, 1): the
    reductions of the gradients produced last in backward (the first layers')
    are issued asynchronously and complete while the next iteration computes,
    on side process groups (in two hops, inside each node and then across,
    where stage 1's reduce-scatters take them: `reduce_scatter`).
    None: every gradient is reduced before the optimizer step."""

    osp_lgp: bool = True
    """With `osp`: step stage-2 parameters at once with this rank's local
    gradient and, when the global one lands (before the next step), redo that
    step from the saved values with it (local-gradient parameter correction).
    False: each step uses the previous iteration's global gradient (one-step
    stale), for comparison."""

    osp_split: str = "last"
    """How `osp` picks stage 2: "last" (the gradients produced last in
    backward, whose reduction would sit exposed after it) or "magnitude" (the
    gradients of smallest root-mean-square at the first step, which a step
    late moves least: the first step runs synchronously and measures them,
    then the graphs are compiled again with that stage 2)."""

    node_size: int | None = None
    """Ranks per node. None: the last dim of `mesh` if given, else the
    LOCAL_WORLD_SIZE environment variable, or the whole world when it is unset
    (one node)."""

    mesh: Any = None
    """A `torch.distributed.DeviceMesh` (nodes x ranks per node, ranks in order)
    whose groups zppc uses for its intra- and cross-node collectives. None: one
    built from `node_size`."""

    bucket_bytes: int | None = None
    """Consecutive collectives are coalesced into buckets whose full tensor (the
    gathered weights in the parameter dtype, or the gradients reduced) stays
    within this many bytes, whatever the world size. It trades memory for
    speed: `prefetch + 1` gathered buckets are alive at once, and larger
    buckets make fewer, faster collectives. None (default): the gathered size
    of the model's largest repeated block (the largest of the same-class
    modules in one `nn.ModuleList` / `nn.Sequential`, e.g. a transformer
    block), kept within 1-25 MiB, and buckets that end where a block does
    (one holds whole blocks; a block is split only when it alone exceeds the
    cap, unpadded): FSDP2's per-block memory and unit, wrapped the way its
    users wrap, without per-block calls. Models without a repeated block get
    25 MiB. Where links are slow against compute, smaller buckets leave less
    exposed: `zppc schedule --tune` ranks caps and `prefetch` depths for given
    links and compute."""

    edge_buckets: bool = True
    """Each graph's first parameter-gather bucket and last reduction bucket
    hold at most half a bucket (half a repeated block where `bucket_bytes` is
    larger): those two transfers have no compute to hide behind, so a smaller
    edge exposes less, and the rest of its block crosses the wire behind the
    edge's compute. One more collective per graph and kind. False: the edges
    are buckets like any other."""

    prefetch: int = 1
    """How many gathered buckets ahead of the one in use the `overlap` pass
    issues parameter gathers: each gather then crosses the wire while the
    compute of the previous `prefetch` buckets runs, and at most
    `prefetch + 1` gathered buckets are alive at once. 0 issues each gather
    when the previous bucket's weights are dead (no overlap of gathers with
    their predecessors' compute, least memory). On gloo, where a group
    carries one collective at a time, the runtime chains a group's gathers
    (each issued once the previous one is done, in the order the graph
    issued them), and `distribute` creates `prefetch + 1` lanes (groups over
    the same ranks, at most 4) for each reduction twin, for the `lanes` pass
    to spread the reductions over."""

    cost_model: Any = None
    """A `zppc.cost.CostModel` (links and compute rates) the `overlap` pass
    plans with: each gather is issued as late as the estimated compute before
    its first use still hides its transfer twice over (estimates are good to
    tens of percent), on a link free of other collectives then, and never
    earlier than `prefetch` allows: the gathered
    bucket lives no longer than it must, and a gather issued into a busy
    link no longer stalls (on gloo, issuing a collective waits for the one in
    flight on its group). Where nothing hides it, as early as `prefetch`
    allows. `zppc schedule --overlap cost` plans with its own rates. None:
    every gather as early as `prefetch` allows (right when links are slower
    than compute)."""

    keep_gathered_bytes: int = 0
    """zero3 only: weights whose gathered bytes fit in this budget stay gathered
    from forward to backward instead of being re-gathered (FSDP2's
    `reshard_after_forward=False` for those; DeepSpeed's prefetcher does this
    implicitly for small models). The last weights the forward gathers are
    kept first: the backward needs them first, before any compute could hide
    their re-gather; one larger than the whole budget is passed over
    (re-gathered) and those read before it still kept. 0 re-gathers every
    weight. `zppc.inspect` states what was kept."""

    keep_last_block: bool = True
    """zero3 only (the other strategies keep every gathered weight): the
    weights the forward reads last, up to one repeated block's gathered bytes
    (the model's largest, as `bucket_bytes=None` measures it; no more than
    `prefetch + 1` buckets of `bucket_bytes`), stay gathered into the
    backward, which reads them first. Re-gathered, they would be the
    backward's first collectives, with nothing computed before them to hide
    behind; kept, they cost no memory at the backward's start, where
    `prefetch + 1` buckets would be gathered again anyway (the `overlap` pass
    counts them as those buckets), only through the loss. So half-block
    buckets at prefetch 1 keep the whole block, as the default cap does,
    with no more bytes re-gathered. FSDP2 keeps its root module's weights so,
    torchtitan its last block. A weight read last that is larger than that
    budget (GPT-2's tied embedding, read by its output head) is re-gathered,
    and the last block's weights are kept all the same. A model without a
    repeated block keeps nothing by this (one bucket there can be the whole
    model). `keep_gathered_bytes` applies instead where it is larger;
    `zppc.inspect` states what was kept. False re-gathers them."""

    reduce_scatter: str = "auto"
    """How a gradient reduce-scatter (zero2/zero3, not qgZ's hops) runs:
    "native", the backend's own reduce-scatter; "all_to_all", an all-to-all of
    the rank-major slices and a local sum over the ranks (each slice crosses
    the wire once, directly); "two_hop", inside each node and then across the
    nodes, the node's partial sums crossing its link (gloo, several nodes of
    several ranks; `zppc.runtime.collectives.reduce_scatter_in_two_hops`);
    "auto", on gloo, whose reduce-scatter is an all-reduce underneath:
    two_hop where it applies (on the emulated 2 x 2 cluster half the bytes of
    all_to_all out of each node), else all_to_all where the direct exchange
    brings fewer bytes into each node (a rank per node, or one node), else
    native; native on NCCL (its ring reduce-scatter)."""

    lowering: str = "inductor"
    """"inductor" generates code with Inductor; "eager" runs the same passes and
    executes the graphs op by op (aot_eager), for fast tests."""

    param_dtype: torch.dtype | None = None
    """dtype the weights are gathered and computed in (mixed precision). None:
    the parameter's own dtype."""

    reduce_dtype: torch.dtype | None = None
    """dtype gradients are reduced in. None: the gradient's own dtype."""

    buffer_sync: str | None = "broadcast"
    """How replicated buffers (BatchNorm's running statistics, counters) stay
    identical on every rank: "broadcast" sends rank 0's values of the buffers a
    forward changed at the end of that forward (DDP's `broadcast_buffers`, done
    after the update instead of before the next forward, so ranks never
    disagree when a user looks); None lets each rank keep its own."""

    timeout_s: float = 600.0
    """Seconds any collective zppc issues may wait before every waiting rank
    raises an error naming the operation (gloo's default is 30 minutes; this is
    NCCL's 10). Set on the process groups zppc runs its collectives on. It must
    cover the skew of first compiles across ranks: a rank that finishes
    compiling a graph waits in its first collective for the slowest one."""

    nonfinite_grads: str | None = "skip"
    """Before each optimizer step on this model's parameters, check the
    gradients for inf/NaN on every rank (one 4-byte all-reduce): "skip" skips
    the step on every rank with a warning, "raise" raises on every rank, None
    does not check."""

    disable_passes: tuple[str, ...] = ()
    """Names of passes to skip (see `zppc.passes.PASS_NAMES`)."""

    log_passes: bool = False
    """Log, for every pass, the ops it added and removed."""

    def __post_init__(self) -> None:
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("qwz", self.qwz, QWZ_FORMATS)
        _check_choice("qgz", self.qgz, QGZ_FORMATS)
        _check_choice("qgz_intra_node", self.qgz_intra_node, QGZ_FORMATS)
        _check_choice("lowering", self.lowering, LOWERINGS)
        _check_choice("buffer_sync", self.buffer_sync, BUFFER_SYNCS)
        _check_choice("nonfinite_grads", self.nonfinite_grads, NONFINITE_POLICIES)
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, (int, float))
            or not 0 < self.timeout_s < float("inf")
        ):
            raise ValueError(
                f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}"
            )
        for name in ("qwz_block", "qgz_block", "bucket_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, formats in (("qwz", (self.qwz,)), ("qgz", (self.qgz, self.qgz_intra_node))):
            block = getattr(self, f"{name}_block")
            if "int4" in formats and block is not None and block % 2:
                raise ValueError(
                    f"{name}_block must be even for int4 (two values per byte), got {block}"
                )
        for name in ("prefetch", "keep_gathered_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.cost_model is not None:
            from zppc.cost import CostModel

            if not isinstance(self.cost_model, CostModel):
                raise ValueError(
                    "cost_model must be a zppc.cost.CostModel or None, "
                    f"got {type(self.cost_model).__name__}"
                )
        if self.keep_gathered_bytes and self.strategy != "zero3":
            raise ValueError(
                "keep_gathered_bytes applies to strategy='zero3' (the other strategies keep "
                f"every gathered weight for backward), got strategy={self.strategy!r}"
            )
        _check_choice("osp_split", self.osp_split, OSP_SPLITS)
        _check_choice("reduce_scatter", self.reduce_scatter, REDUCE_SCATTER_ALGORITHMS)
        for name in (
            "hpz",
            "qgz_quantize",
            "qgz_error_feedback",
            "osp_lgp",
            "keep_last_block",
            "edge_buckets",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.node_size is not None and (
            isinstance(self.node_size, bool)
            or not isinstance(self.node_size, int)
            or self.node_size <= 0
        ):
            raise ValueError(f"node_size must be a positive int or None, got {self.node_size!r}")
        if self.mesh is not None:
            from torch.distributed.device_mesh import DeviceMesh

            if not isinstance(self.mesh, DeviceMesh):
                raise ValueError(
                    f"mesh must be a DeviceMesh or None, got {type(self.mesh).__name__}"
                )
        if self.osp is not None and not (
            isinstance(self.osp, (int, float))
            and not isinstance(self.osp, bool)
            and 0.0 < self.osp < 1.0
        ):
            raise ValueError(f"osp must be None or a fraction in (0, 1), got {self.osp!r}")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in FLOAT_DTYPES:
                raise ValueError(f"{name} must be one of {FLOAT_DTYPES} or None, got {value!r}")
        if not isinstance(self.disable_passes, (tuple, list)):
            raise ValueError(
                f"disable_passes must be a tuple of pass names, got {self.disable_passes!r}"
            )
        from zppc.passes import PASS_NAMES

        unknown = sorted(set(self.disable_passes) - set(PASS_NAMES))
        if unknown:
            raise ValueError(
                f"disable_passes names unknown passes {unknown}; known: {list(PASS_NAMES)}"
            )
        object.__setattr__(self, "disable_passes", tuple(self.disable_passes))

        if self.strategy == "rtp" and self.osp is not None:
            raise NotImplementedError(
                "zppc: strategy='rtp' with osp (a two-stage ring reduction) is not implemented yet"
            )
        sharded = ("zero1", "zero2", "zero3", "rtp")
        if self.qwz is not None and self.strategy not in sharded:
            raise ValueError(
                f"qwz needs a sharded strategy {sharded}, got strategy={self.strategy!r}"
            )
        if self.hpz and self.strategy != "zero3":
            raise ValueError(f"hpz needs strategy='zero3', got strategy={self.strategy!r}")
        if self.qgz_error_feedback and (self.qgz is None or not self.qgz_quantize):
            raise ValueError(
                "qgz_error_feedback needs qgz set and quantizing (qgz_quantize=True), "
                f"got qgz={self.qgz!r}, qgz_quantize={self.qgz_quantize}"
            )
        if self.strategy == "rtp" and (self.hpz or self.qgz):
            raise ValueError("strategy='rtp' does not combine with hpz or qgz")

    def replace(self, **overrides: Any) -> Config:
        """A copy with some fields changed (checked again)."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"unknown zppc.Config fields {unknown}")
        return dataclasses.replace(self, **overrides)

    @property
    def qwz_block_size(self) -> int:
        """The qwZ block size in effect."""
        return self.qwz_block or DEFAULT_BLOCK.get(self.qwz, 0)

    @property
    def qgz_block_size(self) -> int:
        """The qgZ block size in effect."""
        return self.qgz_block or QGZ_DEFAULT_BLOCK


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def qualified_name(cls: type | str) -> str:
    """`module.QualName` of a class (dynamo's module stacks hold the class, or
    already its name)."""
    return cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules that repeat as same-class siblings in an `nn.ModuleList` or
    `nn.Sequential` (a transformer's blocks): the units FSDP2 users wrap."""
    blocks = []
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, list[nn.Module]] = {}
        for child in container.children():
            by_class.setdefault(type(child), []).append(child)
        blocks += [m for siblings in by_class.values() if len(siblings) > 1 for m in siblings]
    return blocks


def repeated_block_bytes(model: nn.Module, param_dtype: torch.dtype | None = None) -> int:
    """The gathered bytes (in `param_dtype` where given) of the largest of the
    `repeated_blocks`; 0 without one. Depends on the model's structure and
    dtypes only, so every rank derives the same."""
    return max(
        (
            sum(p.numel() * (param_dtype or p.dtype).itemsize for p in block.parameters())
            for block in repeated_blocks(model)
        ),
        default=0,
    )


def bucket_cap_for_block(block_bytes: int) -> int:
    """The bucket cap a repeated block of `block_bytes` gathered bytes stands
    for: those bytes kept within [MIN_BUCKET_BYTES, MAX_BUCKET_BYTES];
    MAX_BUCKET_BYTES without a block (0)."""
    if block_bytes == 0:
        return MAX_BUCKET_BYTES
    return min(max(block_bytes, MIN_BUCKET_BYTES), MAX_BUCKET_BYTES)


def block_bucket_bytes(model: nn.Module, param_dtype: torch.dtype | None = None) -> int:
    """The bucket cap `Config.bucket_bytes=None` stands for: the model's
    `repeated_block_bytes` through `bucket_cap_for_block`."""
    return bucket_cap_for_block(repeated_block_bytes(model, param_dtype))
