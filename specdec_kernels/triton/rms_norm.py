"""Triton kernel of specdec::rms_norm (CUDA key): one program per row, the whole row in one
block (H up to 65536), fp32 arithmetic, the result rounded once to the output dtype."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_rms_norm


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    tl.store(out_ptr + row * H + cols, (x * scale * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """Launcher of specdec::rms_norm: out = x * rsqrt(mean(x^2) + eps) * weight over the last dim."""
    check_rms_norm(x, weight, eps, out)  # torch.ops on CUDA reaches this launcher directly
    H = x.shape[-1]
    if x.numel() == 0:
        return
    if H > 65536:
        raise ValueError(f"rms_norm on the GPU takes rows of at most 65536 elements, got {H}")
    rows = x.numel() // H
    _rms_norm_kernel[(rows,)](x.contiguous(), weight.contiguous(), out, H, float(eps), BLOCK=triton.next_power_of_2(H))


torch.library.register_kernel("specdec::rms_norm", "cuda", rms_norm)
