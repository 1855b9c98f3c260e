"""Triton kernels, registered for the CUDA dispatch key of the ``specdec`` ops.

Each area module exposes launcher functions that take the op's arguments; they also run on
CPU tensors under ``TRITON_INTERPRET=1`` (set before triton is imported), which is how the
test suite exercises every GPU kernel on a machine without a GPU.
"""
from . import kv_compaction, linear, medusa, rejection_sampling, rms_norm, silu_and_mul, tree_attention  # noqa: F401
