"""The fused decode step: a model's layer stack run by one C++ call on the CPU.

``Llama.forward`` (decode and verification rows over the paged cache) runs its layers through
``specdec_kernels._C.DecoderStack`` (csrc/cpu/decoder_step.cpp, a pybind11 class) when the model and its cache
are on the CPU. The C++ stack is :class:`~specdec_kernels.models.block.DecoderBlock` plus
:func:`~specdec_kernels.models.block.paged_attention` with the same ATen ops and the same
specdec kernels in the same order, so it gives the same bits as the Python layers, which stay
the reference (``tests/test_decoder_step.py`` checks every weight format, Llama and Qwen2,
batches and trees). What it removes is the interpreter: ~25 torch calls per layer from Python.

Which path runs: ``SPECDEC_DECODE_STEP=python`` forces the Python layers (the reference, and
the path on CUDA, where the Triton kernels and torch's own launch overheads apply);
``fused`` (the default) uses the C++ stack wherever it can run. The EAGLE head runs its one
layer's two halves on a one-layer stack (``DecoderStack.qkv`` / ``output``: its attention, over
the draft tree's own keys, stays in Python).
"""
from __future__ import annotations

import os

import torch

from ..gguf_blocks import QuantizedWeight

PATHS = ("fused", "python")
PRODUCT_KEYS = ("wqkv", "wo", "w_gate_up", "w_down")  # the C++ stack's order
DENSE, BLOCKS, INT8 = 0, 1, 2  # decoder_step.cpp's PartKind


def default_path() -> str:
    """``SPECDEC_DECODE_STEP`` ("fused" when unset); anything else is a ValueError."""
    path = os.environ.get("SPECDEC_DECODE_STEP", "fused")
    if path not in PATHS:
        raise ValueError(f"SPECDEC_DECODE_STEP must be one of {PATHS}, got {path!r}")
    return path


def available() -> bool:
    """Whether the C++ extension registered the stack class (an extension built before it
    existed has not)."""
    try:
        from .._C import DecoderStack  # noqa: F401
    except ImportError:
        return False
    return True


def _parts(w, bias: torch.Tensor | None):
    """[(weight tensor, kind, block type, rows, bias or None)] of one product's weight (a tuple:
    row blocks whose outputs are concatenated, the bias cut at the same rows)."""
    parts = w if isinstance(w, tuple) else (w,)
    rows = [p.shape[0] for p in parts]
    biases = bias.split(rows) if bias is not None else [None] * len(parts)
    out = []
    for p, n, b in zip(parts, rows, biases):
        if isinstance(p, QuantizedWeight):
            if p.int8_packed is not None:
                out.append((p.int8_packed, INT8, p.block_type, n, b))
            else:
                out.append((p.blocks, BLOCKS, p.block_type, n, b))
        else:
            out.append((p, DENSE, 0, n, b))
    return out


def build_stack(block, layers, norm: torch.Tensor | None = None, lm_head=None):
    """The ``DecoderStack`` of ``layers`` (a model's layer weight dicts, ``models.block``) for
    ``block``'s shape (a ``DecoderBlock``: heads, head dim, eps), with the final ``norm`` and
    the ``lm_head`` where given (``forward_logits``), or None where it cannot run (a weight off
    the CPU, no C++ class)."""
    if not available():
        return None
    norms, weights, info, counts, biases = [], [], [], [], []

    def add(w, bias=None):
        parts = _parts(w, bias)
        counts.append(len(parts))
        for tensor, kind, block_type, rows, b in parts:
            weights.append(tensor)
            info.extend([kind, block_type, rows, -1 if b is None else len(biases)])
            if b is not None:
                biases.append(b)

    for L in layers:
        norms += [L["attn_norm"], L["mlp_norm"]]
        for key in PRODUCT_KEYS:
            add(L[key], L.get("bqkv") if key == "wqkv" else None)
    if norm is not None and lm_head is not None and layers:
        norms.append(norm)
        add(lm_head)
    if any(t.device.type != "cpu" for t in norms + weights + biases):
        return None
    from .._C import DecoderStack

    return DecoderStack(block.num_heads, block.num_kv_heads, block.head_dim, float(block.eps),
                                              norms, weights, info, counts, biases)


__all__ = ["PATHS", "available", "build_stack", "default_path"]
