import os
import sys

# Triton kernels run on CPU tensors through the interpreter; the switch is read
# when a kernel is defined, so it must be set before zppc.kernels is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Spawned ranks import the test helpers by module name.
sys.path.insert(0, os.path.dirname(__file__))
