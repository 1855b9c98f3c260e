"""Reference of specdec::rms_norm (tests only): in float64, x * (mean(x^2) + eps)^-1/2 * weight
over the last dim. The kernels compute in fp32, so tests compare with tolerances."""
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> float64 [..., H]."""
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
