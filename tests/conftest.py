import os
import sys

import pytest

# Triton kernels run on CPU tensors through the interpreter; the switch is read
# when a kernel is defined, so it must be set before zppc.kernels is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)

# The repository root's folders `kernels/`, `passes/`, `runtime/` are zppc's
# subpackages, installed as `zppc.kernels` etc. With the root on sys.path
# (`python -m pytest` puts the working directory there) they also import as
# top-level `kernels`, which shadows Hugging Face's `kernels` package that
# transformers >= 5.25 imports, and every Hugging Face model fails to build, here
# and in the ranks a test spawns (they inherit this path).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != REPO]
# Spawned ranks import the test helpers by module name.
sys.path.insert(0, TESTS)
# Tests import the benchmark scripts by module name too, appended so that an
# installed package of the same name still wins.
sys.path.append(os.path.join(REPO, "benchmarks"))


@pytest.fixture
def fake_rank(request):
    """A fake process group of 4 ranks, one process, this one rank `request.param`
    (parametrize with indirect=True); dynamo's caches reset around it."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=request.param, world_size=4)
    torch._dynamo.reset()
    yield request.param
    torch._dynamo.reset()
    dist.destroy_process_group()
