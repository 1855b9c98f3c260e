"""Reference of specdec::medusa_topk (tests only).

Everything is computed in float64 from the inputs widened to float64, the plain way:
full logits, log_softmax, then a sort with an explicit tie order. The kernels compute in
fp32, so tests compare with tolerances (and exactly where inputs make fp32 exact).
"""
import torch


def medusa_head_states(hidden, res_weight, res_bias) -> torch.Tensor:
    """The input of each head's LM head: [M, K, H] float64, x <- x + SiLU(W x + b) per block."""
    M, H = hidden.shape
    K, L = res_weight.shape[:2]
    states = torch.zeros(M, K, H, dtype=torch.float64)
    for k in range(K):
        x = hidden.double().clone()
        for layer in range(L):
            z = x @ res_weight[k, layer].double().T + res_bias[k, layer].double()
            x = x + z * torch.sigmoid(z)
        states[:, k] = x
    return states


def medusa_logits(hidden, res_weight, res_bias, lm_head) -> torch.Tensor:
    """Full logits [M, K, V] float64 (lm_head [V, H] shared or [K, V, H] per head)."""
    states = medusa_head_states(hidden, res_weight, res_bias)
    K = states.shape[1]
    heads = [lm_head if lm_head.dim() == 2 else lm_head[k] for k in range(K)]
    return torch.stack([states[:, k] @ heads[k].double().T for k in range(K)], dim=1)


def topk_stable(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim by descending value, ties to the lower index."""
    flat = logits.reshape(-1, logits.shape[-1])
    ids = torch.empty(flat.shape[0], top_k, dtype=torch.int64)
    vals = torch.empty(flat.shape[0], top_k, dtype=logits.dtype)
    for r in range(flat.shape[0]):
        row = flat[r].tolist()
        order = sorted(range(len(row)), key=lambda v: (-row[v], v))[:top_k]
        ids[r] = torch.tensor(order)
        vals[r] = flat[r, order]
    return ids.reshape(*logits.shape[:-1], top_k), vals.reshape(*logits.shape[:-1], top_k)


def medusa_topk(hidden, res_weight, res_bias, lm_head, top_k):
    """(topk_ids int64 [M, K, top_k], topk_logprobs float64 [M, K, top_k]) of the op."""
    logits = medusa_logits(hidden, res_weight, res_bias, lm_head)
    logprobs = torch.log_softmax(logits, dim=-1)
    # Ties are decided on the logits (log_softmax keeps their order and equalities).
    ids, _ = topk_stable(logits, top_k)
    return ids, torch.gather(logprobs, -1, ids)
