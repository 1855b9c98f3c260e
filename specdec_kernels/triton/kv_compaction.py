"""Triton kernels for kv_compaction (to be written)."""
