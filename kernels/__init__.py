"""zppc's kernels: Triton kernels, each with a pure-torch reference and a custom op."""
