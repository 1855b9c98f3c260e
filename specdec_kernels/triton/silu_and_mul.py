"""Triton kernel of specdec::silu_and_mul (CUDA key): a program per (row, block of columns),
fp32 arithmetic with Triton's own exp, the result rounded once to the output dtype."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_silu_and_mul

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * 2 * I + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * I + I + cols, mask=mask, other=0.0).to(tl.float32)
    s = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + row * I + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """Launcher of specdec::silu_and_mul: out = silu(gate) * up of gate_up = gate|up."""
    check_silu_and_mul(gate_up, out)  # torch.ops on CUDA reaches this launcher directly
    if out.numel() == 0:
        return
    I = out.shape[-1]
    rows = out.numel() // I
    _silu_and_mul_kernel[(rows, triton.cdiv(I, BLOCK))](gate_up.contiguous(), out, I, BLOCK=BLOCK)


torch.library.register_kernel("specdec::silu_and_mul", "cuda", silu_and_mul)
