"""Triton kernels for rejection_sampling (to be written)."""
