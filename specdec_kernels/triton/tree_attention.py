"""Triton kernels for tree_attention (to be written)."""
