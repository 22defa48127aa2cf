"""The `zppc` torch.compile backend.

dynamo graph -> dynamo passes -> aot_autograd (joint graph, zppc_partition) ->
forward / backward passes -> Inductor (`lowering="inductor"`) or op-by-op
execution (`lowering="eager"`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from copy import deepcopy
from functools import cache, partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch._inductor.custom_graph_pass import CustomPartitionerFn

import zppc.ir  # noqa: F401
from zppc.config import Config
from zppc.distribute import DistributedState, live_states, setup_lanes, state_of_shard
from zppc.inductor_fixes import cpu_kernels_release_the_gil, cpu_loop_split_keeps_tails
from zppc.inspect import dump_compile
from zppc.passes import PassContext, is_planning, run_passes
from zppc.passes.overlap import pin_gather_issues
from zppc.passes.partition import zppc_partition
from zppc.passes.zero import find_collectives, gather_in_place
from zppc.runtime.failures import boxed_naming_failures
from zppc.runtime.topology import (
    Topology,
    default_node_size,
    group_ranks,
    setup_groups,
)
from zppc.schedule import CompileRecord, records_for, register_compile

# Fields baked into the shards by `distribute`; options cannot change them later.
FIXED_AT_DISTRIBUTE = ("strategy", "node_size", "param_dtype", "reduce_dtype")


def zppc_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None, **kwargs
):
    """Entry point of `torch.compile(model, backend="zppc", options={...})`."""
    options = dict(options or {})
    state = _find_state(example_inputs)
    if state is None and not any(isinstance(t, nn.Parameter) for t in example_inputs):
        # No parameter, so nothing to communicate: a graph break of a distributed
        # model can leave such a graph. It keeps its model's lowering and must not
        # touch the topology (the ledger's intra/inter split depends on it).
        owner = _state_of_compiling_frame() or _only_live_state()
        base = owner.config if owner is not None else Config()
        return _lower_plain(gm, example_inputs, base.replace(**options))
    if state is not None:
        fixed = sorted(
            k
            for k in options
            if k in FIXED_AT_DISTRIBUTE and options[k] != getattr(state.config, k)
        )
        if fixed:
            raise ValueError(
                f"options cannot change {fixed} of a model already passed to zppc.distribute"
            )
        config = state.config.replace(**options)
    elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        config = Config(**{"strategy": "ddp", **options})
        if config.strategy != "ddp":
            raise ValueError(
                f"strategy={config.strategy!r} needs zppc.distribute(model, config) before torch.compile; "
                f"an undistributed model can only be compiled as 'ddp'"
            )
        _wrap_parameters_for_ddp(gm, example_inputs, config)
    else:
        config = Config(**options) if options else Config()
        return _lower_plain(gm, example_inputs, config)
    return compile_distributed(gm, example_inputs, config, state)


def _find_state(example_inputs: Sequence[Any]) -> DistributedState | None:
    states = {id(s): s for s in map(state_of_shard, example_inputs) if s is not None}
    if len(states) > 1:
        raise ValueError(
            "one compiled graph uses parameters of two models passed to zppc.distribute"
        )
    return next(iter(states.values()), None)


def _state_of_compiling_frame() -> DistributedState | None:
    """The distributed model whose `forward` dynamo is compiling, if any: found
    through the frame's `self` (dynamo's translator of the current frame)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        module = InstructionTranslator.current_tx().f_locals.get("self")
    except AttributeError:  # not inside a dynamo frame translation
        return None
    if not isinstance(module, nn.Module):
        return None
    return next(filter(None, map(state_of_shard, module.parameters())), None)


def _only_live_state() -> DistributedState | None:
    """The distributed models alive in this process, if they all share one Config."""
    states = live_states()
    configs = {s.config for s in states}
    return states[0] if len(configs) == 1 else None


def compile_distributed(gm, example_inputs, config: Config, state: DistributedState | None):
    if state is None:
        return _compile_distributed(gm, example_inputs, config, state)
    if state.osp is None:
        compiled = _compile_distributed(gm, example_inputs, config, state)
    else:
        compiled = _osp_compiled(gm, example_inputs, config, state)
    return _freeing_dropped_grads(compiled, state)


def _freeing_dropped_grads(compiled, state: DistributedState):
    """The compiled graph, freeing the flat-shard gradients `zero_grad` dropped
    before it runs (`DistributedState.free_dropped_grads`; eager forwards do it
    in a hook, which compiling traces away)."""

    def run(*args):
        state.free_dropped_grads()
        return compiled(*args)

    run._boxed_call = getattr(compiled, "_boxed_call", False)
    return run


def _osp_compiled(gm, example_inputs, config: Config, state: DistributedState):
    """The compiled graph of a model with OSP. Before any forward that is not a
    training step (eval mode, or no autograd) it completes stage 2, so
    evaluation sees the synchronous-equivalent parameters; a training forward
    issues the second hop of the quantized stage-2 reductions (qgZ), which
    then runs while it computes. When the stage-2 choice changes
    (`osp_split="magnitude"`, after the measuring step) the graph is compiled
    again from a copy of dynamo's graph, at the same call on every rank."""
    pristine = _copy_graph_module(gm) if config.osp_split == "magnitude" else None
    current = [_compile_distributed(gm, example_inputs, config, state), state.osp.plan]

    def run(*args):
        model = state.model_ref()
        if not torch.is_grad_enabled() or (model is not None and not model.training):
            state.osp.synchronize()
        else:
            state.osp.advance()
        if current[1] != state.osp.plan:
            fresh = _copy_graph_module(pristine)
            current[:] = [
                _compile_distributed(fresh, example_inputs, config, state),
                state.osp.plan,
            ]
        return current[0](*args)

    run._boxed_call = getattr(current[0], "_boxed_call", False)
    return run


def _compile_distributed(gm, example_inputs, config: Config, state: DistributedState | None):
    record = CompileRecord(config=config)
    register_compile(record, state)
    dynamo = PassContext(config, "dynamo", record.passes["dynamo"], state)
    gm = run_passes(gm, dynamo)
    hpz_group = state.groups.intra_node if config.hpz else None
    partition_options = dict(
        hpz_group=hpz_group,
        keep_gathered_bytes=dynamo.kept_gathered_bytes,
        kept=record.kept_gathered,
    )
    buffer_ids = state.buffer_ids() if state is not None else set()
    buffer_inputs = tuple(i for i, t in enumerate(example_inputs) if id(t) in buffer_ids)
    fqn_of_flat = {id(f): fqn for fqn, f in state.flat_shards.items()} if state else {}
    input_fqns = tuple(fqn_of_flat.get(id(t)) for t in example_inputs)

    def passes_then(lower):
        def compiler(graph: fx.GraphModule, inputs, **kw):
            kind = "backward" if kw.get("is_backward") else "forward"
            ctx = PassContext(config, kind, record.passes[kind], state, buffer_inputs, input_fqns)
            graph = run_passes(graph, ctx)
            # The lowering rewrites the graph it is given (`gather_in_place`,
            # Inductor's post-grad passes): the record keeps zppc's final
            # graph, as the passes left it.
            record.final[kind] = _copy_graph_module(graph)
            dump_compile(record, len(records_for(state)) - 1, kind)
            what = describe(kind, graph, config)  # before Inductor rewrites the graph
            return boxed_naming_failures(lower(gather_in_place(graph), inputs, **kw), what)

        return compiler

    if config.lowering == "eager":
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._functorch.aot_autograd import make_boxed_func

        def boxed(graph, inputs, **kw):
            if is_planning():
                return make_boxed_func(partial(_empty_outputs, graph))
            # torch's aot_eager lowering: the generated code takes the argument
            # list, clears it and drops each input after its last use.
            # `make_boxed_func(graph.forward)` kept the caller's list, so the
            # backward held every saved activation to its last op (gpt-medium,
            # world 2: 49 MiB above FSDP2's peak of live tensors).
            return boxed_nop(graph, inputs)

        fw = passes_then(boxed)
        bw = passes_then(lambda g, i, **kw: boxed(g, i))
        return aot_autograd(
            fw_compiler=fw,
            bw_compiler=lambda g, i: bw(g, i, is_backward=True),
            partition_fn=partial(zppc_partition, **partition_options),
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    # aot_autograd marks saved tensors as "donated" (the backward may reuse their
    # storage) from the partitioned graph, before zppc's passes lower the IR.
    # There a ddp weight is `unshard`'s fresh output; after the `zero` pass it is
    # an alias of the parameter, whose storage the backward must never reuse
    # (rtp replicates every parameter it does not rotate, as ddp does).
    donation_is_sound = config.strategy not in ("ddp", "rtp")
    # Inductor's peak-memory reordering moves every gather down to its use and
    # every wait up to its collective, undoing the `overlap` pass; that pass's
    # order is already memory-bounded (at most prefetch + 1 gathered buckets).
    # The patch wraps each graph's own compile: the backward compiles lazily,
    # at the first backward, outside any context set up here.
    keep_overlap_order = "overlap" not in config.disable_passes
    # On CPU Inductor writes a `cat`'s inputs straight into the output buffer
    # (views of it), and lowers a gradient bucket's all-reduce in place on that
    # buffer; a kernel that still reads one of those inputs after the
    # all-reduce is issued (BatchNorm's backward reads its weight-gradient sums
    # again for the input gradient) then reads the sum over ranks, or a value
    # being written. The overlap pass issues reductions as early as their
    # inputs exist, which exposed it (rtp, BatchNorm: 1% loss gaps, varying
    # run to run). A pointwise cat copies the inputs into a buffer of its own.
    patches = dict(
        reorder_for_peak_memory=not keep_overlap_order,
        force_pointwise_cat=True,
        # Inductor keeps a dead buffer allocated until a later buffer of its
        # size takes it over, sometimes a whole block later: gradient buckets
        # held across the backward's peak (gpt-small, world 2: 67.7 MiB peak
        # of live tensors with reuse, 62.2 without; the eager lowering's is
        # 59.5). Step time was the same within noise on CPU (fake process
        # group, 3 x 40 steps each way); a GPU's caching allocator makes
        # fresh allocations cheap anyway.
        allow_buffer_reuse=False,
        # `pin_gather_issues` wraps gathers in torch's `control_deps`, which
        # Inductor's FX graph cache refuses by default (each wrapped op sits in
        # a subgraph). The key pickles those subgraphs with the graph,
        # constants included: graphs that differ inside one get other keys.
        unsafe_marked_cacheable_functions={
            **inductor_config.unsafe_marked_cacheable_functions,
            "torch.ops.higher_order.control_deps": torch.__version__,
        },
    )

    # Inductor's FX graph cache keys each graph as zppc's passes left it, with
    # Inductor's config; the tag adds what the key cannot see: zppc's own code
    # (the loop-split and GIL fixes patch Inductor's codegen, custom ops' fake
    # implementations fix output layouts). AOTAutograd's cache stays off: a hit
    # there would skip zppc's passes, which also register runtime state.
    cache_key_tag = f"{torch.compiler.config.cache_key_tag}|zppc:{zppc_source_digest()}"

    def inner_compile(graph, inputs, **kw):
        if keep_overlap_order:
            pin_gather_issues(graph, config.prefetch, dynamo.bucket_bytes)
        with (
            inductor_config.patch(**patches),
            torch.compiler.config.patch(cache_key_tag=cache_key_tag),
            cpu_loop_split_keeps_tails(),
            cpu_kernels_release_the_gil(),
        ):
            return compile_fx_inner(graph, inputs, **kw)

    with (
        inductor_config.patch(custom_partitioner_fn=_ZppcPartitioner(partition_options)),
        functorch_config.patch(enable_autograd_cache=False, donated_buffer=donation_is_sound),
    ):
        return compile_fx(gm, example_inputs, inner_compile=passes_then(inner_compile))


def _empty_outputs(gm: fx.GraphModule, *args):
    """What a plan's graph returns instead of running: empty tensors of its
    outputs' traced metadata (see `zppc.passes.planning`)."""
    (outputs,) = gm.graph.find_nodes(op="output")[0].args

    def empty(out):
        val = out.meta.get("val") if isinstance(out, fx.Node) else out
        if not isinstance(val, torch.Tensor):
            return val
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)

    return tuple(map(empty, outputs))


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new module over a copy of `gm`'s graph; nodes keep their meta (the
    traced values the schedule and the cost model read)."""
    copy = fx.GraphModule(gm, deepcopy(gm.graph))
    copy.meta.update(gm.meta)
    return copy


def describe(kind: str, gm: fx.GraphModule, config: Config) -> str:
    """What a graph communicates, for error messages: its collectives by kind
    and group (global ranks)."""
    counts: dict[str, int] = {}
    for m in find_collectives(gm.graph):
        key = f"{m.kind} over ranks {group_ranks(m.group_name)}"
        counts[key] = counts.get(key, 0) + 1
    issued = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no collective"
    return f"the compiled {kind} graph ({issued}, timeout {config.timeout_s:g} s)"


def _lower_plain(gm, example_inputs, config: Config):
    """No process group: an ordinary single-device compile."""
    if config.lowering == "eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def _wrap_parameters_for_ddp(gm: fx.GraphModule, example_inputs, config: Config) -> None:
    """An undistributed model on several ranks: route each parameter through a
    ddp `unshard` so its gradient is all-reduced, after broadcasting rank 0's
    values (every rank compiles the same graphs in the same order)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = [
        (n, t)
        for n, t in zip(placeholders, example_inputs, strict=True)
        if isinstance(t, nn.Parameter)
    ]
    world = dist.get_world_size()
    topology = Topology(world, config.node_size or default_node_size(world))
    groups = setup_groups(topology, timeout_s=config.timeout_s)
    setup_lanes(config, topology, groups)
    with torch.no_grad():
        for _, t in params:
            dist.broadcast(t.data, src=0)
    group_name = groups.world
    for node, t in params:
        with gm.graph.inserting_after(node):
            full = gm.graph.call_function(
                torch.ops.zppc.unshard.default,
                (node, list(t.shape), group_name, "ddp", config.param_dtype, config.reduce_dtype),
            )
        node.replace_all_uses_with(full)
        full.update_arg(0, node)
    gm.recompile()


@cache
def zppc_source_digest() -> str:
    """A digest of zppc's Python sources (the package and its passes, runtime
    and kernels), so a cached compile never outlives the code that made it."""
    import zppc.kernels
    import zppc.passes
    import zppc.runtime

    digest = hashlib.sha256()
    for package in (zppc, zppc.passes, zppc.runtime, zppc.kernels):
        for source in sorted(Path(package.__file__).parent.glob("*.py")):
            digest.update(source.name.encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


class _ZppcPartitioner(CustomPartitionerFn):
    """zppc_partition in the form Inductor's config accepts."""

    def __init__(self, options: dict):
        self.options = options

    def __call__(self, gm, joint_inputs, **kwargs):
        return zppc_partition(gm, joint_inputs, **self.options, **kwargs)

    def uuid(self):
        return None  # AOTAutograd's cache, the one that reads this, stays off
