"""Triton kernels for medusa (to be written)."""
