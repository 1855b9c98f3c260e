"""Reference of specdec::silu_and_mul (tests only): in float64, gate * sigmoid(gate) * up of
gate_up = gate|up. The kernels compute in fp32, so tests compare with tolerances."""
import torch


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> float64 [..., I]."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up
