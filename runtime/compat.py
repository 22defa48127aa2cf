"""What zppc needs from torch under the names torch 2.13 gave it, also on the
older torch (2.11) of the lent GPU machine's image, where
benchmarks/device_check.py runs. zppc supports torch 2.13-2.14 (pyproject);
this module is the whole of what an older torch needs."""

from __future__ import annotations

import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def preserve_node_ordering(graph, deps) -> None:
    """torch's `preserve_node_ordering`, with `control_deps` runnable on
    tensors that carry autograd state (torch 2.11 has no Autograd kernel for
    it: the compiled graph fails on CUDA; 2.13 registers the same one)."""
    from torch._C import DispatchKey
    from torch._inductor.fx_passes import control_dependencies

    control_deps = control_dependencies.control_deps
    if DispatchKey.Autograd not in control_deps.py_kernels:

        @control_deps.py_impl(DispatchKey.Autograd)
        def _(additional_deps, subgraph, *args, **kwargs):
            return subgraph(*args, **kwargs)

    control_dependencies.preserve_node_ordering(graph, deps)
