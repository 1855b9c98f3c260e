"""Typed wrappers of the ``torch.ops.specdec`` ops, their input validation and fakes.

Each op is called as ``torch.ops.specdec.<name>(..., out tensors)`` (destination-passing,
capturable in CUDA graphs); the wrappers here validate the inputs with errors that name
the argument, allocate the outputs for the functional form and return them. The fakes
(``register_fake``) describe the ops to ``torch.compile`` and ``opcheck``: ops that only
write into their arguments return nothing, so their fakes check nothing and return None.
"""
from __future__ import annotations

import torch

__all__ = [
    "philox_uniform",
    "chain_rejection_sample",
    "tree_rejection_sample",
    "apply_top_k_top_p",
]


# ---------------------------------------------------------------------------------------
# Validation helpers, shared by every wrapper.
# ---------------------------------------------------------------------------------------


def check_tensor(t, name: str, *, dtype=None, dims=None, device=None, shape=None) -> None:
    """Raise a ValueError naming ``name`` unless ``t`` is a tensor as described.

    ``dtype`` may be one dtype or a tuple; ``shape`` entries of None are not checked.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise ValueError(f"{name} must have dtype {want}, got {t.dtype}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


# ---------------------------------------------------------------------------------------
# Random numbers.
# ---------------------------------------------------------------------------------------


def philox_uniform(seed: torch.Tensor, offset: torch.Tensor, position: int, purpose: int, num: int) -> torch.Tensor:
    """The package generator's uniforms (see ``specdec_kernels.rng``).

    seed, offset: int64 [B]. Returns fp32 [B, num], the uniforms for vocabulary indices
    0..num-1 at ``position`` for ``purpose``.
    """
    check_tensor(seed, "seed", dtype=torch.int64, dims=1)
    check_tensor(offset, "offset", dtype=torch.int64, shape=(seed.shape[0],), device=seed.device)
    return torch.ops.specdec.philox_uniform(seed, offset, position, purpose, num)


@torch.library.register_fake("specdec::philox_uniform")
def _philox_uniform_fake(seed, offset, position, purpose, num):
    return seed.new_empty((seed.shape[0], num), dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# Rejection sampling: chain_rejection_sample, tree_rejection_sample, apply_top_k_top_p.
# ---------------------------------------------------------------------------------------

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_sampling_common(target_logits, draft_probs, temperature, seed, offset, batch, rows, q_rows, device):
    check_tensor(target_logits, "target_logits", dtype=_LOGIT_DTYPES, dims=3, device=device)
    vocab = target_logits.shape[2]
    check_tensor(target_logits, "target_logits", shape=(batch, rows, None))
    if vocab == 0:
        raise ValueError(f"target_logits must have a non-empty vocabulary dimension, got {list(target_logits.shape)}")
    if draft_probs is not None:
        check_tensor(draft_probs, "draft_probs", dtype=torch.float32, shape=(batch, q_rows, vocab), device=device)
    check_tensor(temperature, "temperature", dtype=torch.float32, shape=(batch,), device=device)
    check_tensor(seed, "seed", dtype=torch.int64, shape=(batch,), device=device)
    check_tensor(offset, "offset", dtype=torch.int64, shape=(batch,), device=device)


def chain_rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    *,
    output_token_ids: torch.Tensor | None = None,
    num_accepted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless verification of a chain of drafted tokens per request (DESIGN.md).

    Args:
        draft_token_ids: int64 [B, K], the drafted tokens (entries beyond
            ``num_draft_tokens[b]`` are ignored).
        num_draft_tokens: int32 [B], values in 0..K (ragged).
        target_logits: fp32/bf16/fp16 [B, K+1, V]; row k = the target's logits after the
            first k drafts (rows beyond ``num_draft_tokens[b]`` are not read).
        draft_probs: fp32 [B, K, V], the draft distributions q the drafts were drawn from,
            or None for deterministic drafters (q = one-hot on the drafted token: accept
            with probability p(x), residual = p with x zeroed).
        temperature: fp32 [B]; > 0 samples from softmax(logits / T), anything else
            (0, negative, NaN) is greedy: accept while the draft equals the first argmax
            of the raw logits, then emit that argmax.
        seed, offset: int64 [B], the Philox key and counter base of each request.
        output_token_ids, num_accepted: optional destinations (int64 [B, K+1], int32 [B]).

    Returns ``(output_token_ids, num_accepted)``: accepted drafts, then one recovered or
    bonus token, then -1; ``num_accepted[b]`` drafts were accepted. A request whose rows
    0..num_draft_tokens[b] hold a NaN or +inf, or a row that is entirely -inf, gets
    ``num_accepted = -1`` and an all -1 row.

    Randomness (``specdec_kernels.rng``): the acceptance of draft k uses the uniform u at
    position k + 1 (PURPOSE_ACCEPT, index 0) and is accepted iff u <= p(x) / q(x) (so
    p(x) = 0 is never accepted); the token drawn at row k uses position k (PURPOSE_SAMPLE,
    index v) through the exponential race. A call consumes positions 0..K, so the caller
    advances ``offset`` by K + 1 (``draft_token_ids.shape[1] + 1``) for the next call.

    Data-dependent faults: on CPU a draft id outside [0, V) (including -1) within
    ``num_draft_tokens`` or a count outside 0..K raises RuntimeError; the Triton kernel
    clamps the count into 0..K and treats an out-of-range draft as rejected with
    p(x) = 0 (never reading out of bounds).
    """
    check_tensor(draft_token_ids, "draft_token_ids", dtype=torch.int64, dims=2)
    batch, max_drafts = draft_token_ids.shape
    device = draft_token_ids.device
    check_tensor(num_draft_tokens, "num_draft_tokens", dtype=torch.int32, shape=(batch,), device=device)
    _check_sampling_common(target_logits, draft_probs, temperature, seed, offset, batch, max_drafts + 1, max_drafts,
                           device)
    if output_token_ids is None:
        output_token_ids = torch.empty((batch, max_drafts + 1), dtype=torch.int64, device=device)
    else:
        check_tensor(output_token_ids, "output_token_ids", dtype=torch.int64, shape=(batch, max_drafts + 1), device=device)
    if num_accepted is None:
        num_accepted = torch.empty((batch,), dtype=torch.int32, device=device)
    else:
        check_tensor(num_accepted, "num_accepted", dtype=torch.int32, shape=(batch,), device=device)
    torch.ops.specdec.chain_rejection_sample(
        draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature, seed, offset,
        output_token_ids, num_accepted,
    )
    return output_token_ids, num_accepted


def tree_rejection_sample(
    parents: torch.Tensor,
    tree_token_ids: torch.Tensor,
    num_nodes: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    *,
    accepted_nodes: torch.Tensor | None = None,
    output_token_ids: torch.Tensor | None = None,
    num_accepted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless verification of a tree of drafted tokens per request (DESIGN.md).

    Args:
        parents: int32 [B, N]; node 0 is the root (the last verified token),
            parents[b, 0] = -1, 0 <= parents[b, i] < i for 0 < i < num_nodes[b].
        tree_token_ids: int64 [B, N], the token of every node (node 0's is not read).
        num_nodes: int32 [B], values in 0..N (0: nothing is emitted, num_accepted = 0).
        target_logits: fp32/bf16/fp16 [B, N, V]; row i = logits for the token after node i.
        draft_probs: fp32 [B, N, V] or None; row i = the q the children of node i were
            drawn from i.i.d.; None = deterministic children (e.g. top-k of a drafter).
        temperature, seed, offset: as for ``chain_rejection_sample``.
        accepted_nodes, output_token_ids, num_accepted: optional destinations (int32
            [B, N-1], int64 [B, N], int32 [B]).

    Returns ``(accepted_nodes, output_token_ids, num_accepted)``: the accepted path (root
    excluded, -1 padded), its tokens followed by the recovered/bonus token (-1 padded) and
    the path length. The walk: at node i try its children in index order with a residual
    p' (initially softmax(row i / T)); with draft_probs accept child x iff
    u <= p'(x) / q(x) else p' <- normalize(max(p' - q, 0)); without, accept iff
    u <= p'(x) else p'(x) <- 0 and renormalise (if p' has no mass left, which only
    rounding can cause, p' <- p_i). After the last rejection or at a leaf the last token
    is drawn from p'. Greedy requests follow the first argmax. NaN rows: as for chains
    (rows 0..num_nodes-1).

    Randomness: the acceptance of node c uses position c (PURPOSE_ACCEPT, index 0), the
    token drawn at node i uses position i (PURPOSE_SAMPLE, index v). A call consumes
    positions 0..N-1: the caller advances ``offset`` by N (``parents.shape[1]``). A chain
    is the tree parents = [-1, 0, 1, ...] and gives the same tokens with the same seeds.

    Data-dependent faults: on CPU an invalid parent, a token id outside [0, V) or a
    num_nodes outside 0..N raises RuntimeError; the Triton kernel clamps num_nodes,
    never visits a node whose parent is not an earlier node, and treats an out-of-range
    token as rejected with p(x) = 0 (it never reads out of bounds).
    """
    check_tensor(parents, "parents", dtype=torch.int32, dims=2)
    batch, max_nodes = parents.shape
    if max_nodes < 1:
        raise ValueError(f"parents must have at least one node per request, got shape {list(parents.shape)}")
    device = parents.device
    check_tensor(tree_token_ids, "tree_token_ids", dtype=torch.int64, shape=(batch, max_nodes), device=device)
    check_tensor(num_nodes, "num_nodes", dtype=torch.int32, shape=(batch,), device=device)
    _check_sampling_common(target_logits, draft_probs, temperature, seed, offset, batch, max_nodes, max_nodes, device)
    if accepted_nodes is None:
        accepted_nodes = torch.empty((batch, max_nodes - 1), dtype=torch.int32, device=device)
    else:
        check_tensor(accepted_nodes, "accepted_nodes", dtype=torch.int32, shape=(batch, max_nodes - 1), device=device)
    if output_token_ids is None:
        output_token_ids = torch.empty((batch, max_nodes), dtype=torch.int64, device=device)
    else:
        check_tensor(output_token_ids, "output_token_ids", dtype=torch.int64, shape=(batch, max_nodes), device=device)
    if num_accepted is None:
        num_accepted = torch.empty((batch,), dtype=torch.int32, device=device)
    else:
        check_tensor(num_accepted, "num_accepted", dtype=torch.int32, shape=(batch,), device=device)
    torch.ops.specdec.tree_rejection_sample(
        parents, tree_token_ids, num_nodes, target_logits, draft_probs, temperature, seed, offset,
        accepted_nodes, output_token_ids, num_accepted,
    )
    return accepted_nodes, output_token_ids, num_accepted


def _expand_row_param(t, name, dtype, batch, seq, device):
    """A per-row parameter: [R] as is; for 3-D logits [B] is repeated over S, [B, S] flattened."""
    if t is None:
        return None
    check_tensor(t, name, dtype=dtype, device=device)
    if seq is None:
        check_tensor(t, name, shape=(batch,))
        return t
    if t.dim() == 1:
        check_tensor(t, name, shape=(batch,))
        return t.repeat_interleave(seq)
    check_tensor(t, name, shape=(batch, seq))
    return t.reshape(batch * seq)


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    *,
    inplace: bool = True,
) -> torch.Tensor:
    """Mask logits outside the top-k / top-p / min-p sets to -inf; returns the logits.

    Args:
        logits: fp32/bf16/fp16 [R, V], or [B, S, V] (e.g. the K+1 verification rows of B
            requests), contiguous; modified in place unless ``inplace=False``.
        top_k: int32 [R] (for 3-D logits [B] or [B, S]); 0 (or <= 0, or >= V) = off.
        top_p: fp32, same shapes; >= 1 = off.
        min_p: fp32, same shapes; <= 0 = off.

    Per row, on the values as given (temperature 1: divide by T first to apply them at
    temperature T), in this order: top-k keeps l_v >= the k-th largest value (ties at
    the k-th value are all kept, so more than k may survive); top-p, on the softmax of
    the top-k survivors, keeps v iff the mass of survivors with a strictly larger value
    is < top_p (the largest value and ties at the threshold are always kept); min-p keeps
    v iff exp(l_v - max) >= min(min_p, 1). Rows holding a NaN are left unchanged (the
    sampler then reports them). The Triton kernel finds the thresholds by bisection on
    the ordered float bits instead of sorting, with the same result.
    """
    check_tensor(logits, "logits", dtype=_LOGIT_DTYPES)
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must have 2 or 3 dimensions ([R, V] or [B, S, V]), got shape {list(logits.shape)}")
    if not inplace:
        logits = logits.clone()
    if not logits.is_contiguous():
        raise ValueError("logits must be contiguous (the op works in place)")
    device = logits.device
    if logits.dim() == 3:
        batch, seq, vocab = logits.shape
        flat = logits.view(batch * seq, vocab)
    else:
        batch, seq = logits.shape[0], None
        flat = logits
    top_k = _expand_row_param(top_k, "top_k", torch.int32, batch, seq, device)
    top_p = _expand_row_param(top_p, "top_p", torch.float32, batch, seq, device)
    min_p = _expand_row_param(min_p, "min_p", torch.float32, batch, seq, device)
    torch.ops.specdec.apply_top_k_top_p(flat, top_k, top_p, min_p)
    return logits


@torch.library.register_fake("specdec::chain_rejection_sample")
def _chain_rejection_sample_fake(draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature, seed,
                                 offset, output_token_ids, num_accepted):
    return None


@torch.library.register_fake("specdec::tree_rejection_sample")
def _tree_rejection_sample_fake(parents, tree_token_ids, num_nodes, target_logits, draft_probs, temperature, seed,
                                offset, accepted_nodes, output_token_ids, num_accepted):
    return None


@torch.library.register_fake("specdec::apply_top_k_top_p")
def _apply_top_k_top_p_fake(logits, top_k, top_p, min_p):
    return None



# ---------------------------------------------------------------------------------------
# Tree attention: tree_attention.
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# KV-cache compaction: compact_kv.
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# Medusa heads and the skinny GEMM: medusa_topk, skinny_linear.
# ---------------------------------------------------------------------------------------
