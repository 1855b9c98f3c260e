"""Reference of specdec::skinny_linear (tests only).

Computed in float64 from the inputs widened to float64, one dot product at a time. The
kernels compute in fp32, so tests compare with tolerances.
"""
import torch


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, H] @ weight [N, H]^T + bias [N], one dot product at a time, in float64."""
    M, H = x.shape
    N = weight.shape[0]
    xd, wd = x.double(), weight.double()
    out = torch.zeros(M, N, dtype=torch.float64)
    for m in range(M):
        for n in range(N):
            out[m, n] = torch.dot(xd[m], wd[n]) + (float(bias[n]) if bias is not None else 0.0)
    return out
