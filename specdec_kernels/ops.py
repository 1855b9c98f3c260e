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
    "chain_rejection_sample_flat",
    "tree_rejection_sample",
    "apply_top_k_top_p",
    "tree_attention",
    "compact_kv",
    "medusa_topk", "skinny_linear", "linear",
    "skinny_linear_rows",
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


def output_tensor(t, name: str, *, dtype, shape, device) -> torch.Tensor:
    """An op's destination: ``t`` checked against dtype/shape/device, or a new empty tensor."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(t, name, dtype=dtype, shape=shape, device=device)
    return t


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


def check_chain_rejection_args(draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature, seed,
                               offset, output_token_ids=None, num_accepted=None):
    """Validates ``chain_rejection_sample``'s arguments (also called by the Triton launcher,
    which ``torch.ops`` reaches without this wrapper); returns the destinations, allocated
    where None."""
    check_tensor(draft_token_ids, "draft_token_ids", dtype=torch.int64, dims=2)
    batch, max_drafts = draft_token_ids.shape
    device = draft_token_ids.device
    check_tensor(num_draft_tokens, "num_draft_tokens", dtype=torch.int32, shape=(batch,), device=device)
    _check_sampling_common(target_logits, draft_probs, temperature, seed, offset, batch, max_drafts + 1, max_drafts,
                           device)
    output_token_ids = output_tensor(output_token_ids, "output_token_ids", dtype=torch.int64,
                                     shape=(batch, max_drafts + 1), device=device)
    num_accepted = output_tensor(num_accepted, "num_accepted", dtype=torch.int32, shape=(batch,), device=device)
    return output_token_ids, num_accepted


def check_chain_flat_rejection_args(draft_token_ids, cu_num_draft_tokens, target_logits, draft_probs, temperature,
                                    seed, offset, output_token_ids, num_accepted=None):
    """Validates ``chain_rejection_sample_flat``'s arguments (also called by the Triton
    launcher); ``output_token_ids`` [B, K+1] is required (it gives K); returns the
    destinations, ``num_accepted`` allocated when None."""
    check_tensor(draft_token_ids, "draft_token_ids", dtype=torch.int64, dims=1)
    num_tokens = draft_token_ids.shape[0]
    device = draft_token_ids.device
    check_tensor(cu_num_draft_tokens, "cu_num_draft_tokens", dtype=torch.int32, dims=1, device=device)
    batch = cu_num_draft_tokens.shape[0]
    check_tensor(target_logits, "target_logits", dtype=_LOGIT_DTYPES, dims=2, device=device)
    check_tensor(target_logits, "target_logits", shape=(num_tokens + batch, None))
    vocab = target_logits.shape[1]
    if vocab == 0:
        raise ValueError(f"target_logits must have a non-empty vocabulary dimension, got {list(target_logits.shape)}")
    if draft_probs is not None:
        check_tensor(draft_probs, "draft_probs", dtype=torch.float32, shape=(num_tokens, vocab), device=device)
    for t, name, dtype in ((temperature, "temperature", torch.float32), (seed, "seed", torch.int64),
                           (offset, "offset", torch.int64)):
        check_tensor(t, name, dtype=dtype, shape=(batch,), device=device)
    check_tensor(output_token_ids, "output_token_ids", dtype=torch.int64, dims=2, device=device)
    if output_token_ids.shape[0] != batch or output_token_ids.shape[1] < 1:
        raise ValueError(f"output_token_ids must have shape [B = {batch}, K + 1] with K >= 0, got "
                         f"{list(output_token_ids.shape)}")
    num_accepted = output_tensor(num_accepted, "num_accepted", dtype=torch.int32, shape=(batch,), device=device)
    return output_token_ids, num_accepted


def check_tree_rejection_args(parents, tree_token_ids, num_nodes, target_logits, draft_probs, temperature, seed,
                              offset, accepted_nodes=None, output_token_ids=None, num_accepted=None):
    """Validates ``tree_rejection_sample``'s arguments (as ``check_chain_rejection_args``)."""
    check_tensor(parents, "parents", dtype=torch.int32, dims=2)
    batch, max_nodes = parents.shape
    if max_nodes < 1:
        raise ValueError(f"parents must have at least one node per request, got shape {list(parents.shape)}")
    device = parents.device
    check_tensor(tree_token_ids, "tree_token_ids", dtype=torch.int64, shape=(batch, max_nodes), device=device)
    check_tensor(num_nodes, "num_nodes", dtype=torch.int32, shape=(batch,), device=device)
    _check_sampling_common(target_logits, draft_probs, temperature, seed, offset, batch, max_nodes, max_nodes, device)
    accepted_nodes = output_tensor(accepted_nodes, "accepted_nodes", dtype=torch.int32,
                                   shape=(batch, max_nodes - 1), device=device)
    output_token_ids = output_tensor(output_token_ids, "output_token_ids", dtype=torch.int64,
                                     shape=(batch, max_nodes), device=device)
    num_accepted = output_tensor(num_accepted, "num_accepted", dtype=torch.int32, shape=(batch,), device=device)
    return accepted_nodes, output_token_ids, num_accepted


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
    output_token_ids, num_accepted = check_chain_rejection_args(
        draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature, seed, offset,
        output_token_ids, num_accepted)
    torch.ops.specdec.chain_rejection_sample(
        draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature, seed, offset,
        output_token_ids, num_accepted,
    )
    return output_token_ids, num_accepted


def chain_rejection_sample_flat(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    *,
    max_num_draft_tokens: int | None = None,
    output_token_ids: torch.Tensor | None = None,
    num_accepted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chain_rejection_sample`` on the flattened ragged layout of inference engines (vLLM's
    ``RejectionSampler``): nothing is padded or copied.

    A separate op rather than a flag on ``chain_rejection_sample``: every tensor but the
    per-request ones changes rank, and a schema per layout keeps each one checkable and
    ``opcheck``-able. Both run the same kernels (CPU: the same driver, each request's rows
    where they are; Triton: the same four launches with per-request row offsets).

    Args:
        draft_token_ids: int64 [T], every request's drafts, request after request.
        cu_num_draft_tokens: int32 [B], inclusive prefix sums of the draft counts: request b
            owns drafts start_b .. cu[b] - 1 with start_b = cu[b - 1] (0 for b = 0).
        target_logits: fp32/bf16/fp16 [T + B, V]; request b's rows start_b + b ..
            start_b + b + n_b: the logits after each of its n_b drafts' prefixes, then the
            bonus row (vLLM's ``logits`` argument as it is).
        draft_probs: fp32 [T, V] (row of each draft), or None (deterministic drafters).
        temperature, seed, offset: [B], as for ``chain_rejection_sample``.
        max_num_draft_tokens: K, the width of the outputs minus one (>= every n_b); None
            reads it from ``cu_num_draft_tokens`` (a host synchronisation) unless
            ``output_token_ids`` is given.
        output_token_ids, num_accepted: optional destinations (int64 [B, K + 1], int32 [B]).

    Returns ``(output_token_ids, num_accepted)`` exactly as ``chain_rejection_sample`` on the
    same requests padded to K drafts: the same tokens for the same seeds and offsets (a call
    consumes positions 0..K: advance ``offset`` by K + 1).

    A negative draft id is padding (vLLM pads some decodes to its speculation length with
    -1 drafts, vllm/v1/core/sched/scheduler.py): the request's drafts end at the first one,
    and the token at that position is drawn from p as a bonus token would be (never from a
    residual of the padding's q row).

    Data-dependent faults: on CPU, cu_num_draft_tokens that is not a non-decreasing
    sequence ending at T with steps <= K, or a draft id >= V, raises RuntimeError; the
    Triton kernel clamps each request's range into [0, T] and its count into 0..K and
    rejects drafts >= V (never reading out of bounds).
    """
    if output_token_ids is None:
        if max_num_draft_tokens is None:
            check_tensor(cu_num_draft_tokens, "cu_num_draft_tokens", dtype=torch.int32, dims=1)
            cu = cu_num_draft_tokens.tolist()
            max_num_draft_tokens = max((b - a for a, b in zip([0] + cu[:-1], cu)), default=0)
        if isinstance(max_num_draft_tokens, bool) or not isinstance(max_num_draft_tokens, int) \
                or max_num_draft_tokens < 0:
            raise ValueError(f"max_num_draft_tokens must be an int >= 0, got {max_num_draft_tokens!r}")
        check_tensor(cu_num_draft_tokens, "cu_num_draft_tokens", dtype=torch.int32, dims=1)
        output_token_ids = torch.empty((cu_num_draft_tokens.shape[0], max_num_draft_tokens + 1), dtype=torch.int64,
                                       device=cu_num_draft_tokens.device)
    output_token_ids, num_accepted = check_chain_flat_rejection_args(
        draft_token_ids, cu_num_draft_tokens, target_logits, draft_probs, temperature, seed, offset,
        output_token_ids, num_accepted)
    torch.ops.specdec.chain_rejection_sample_flat(
        draft_token_ids, cu_num_draft_tokens, target_logits, draft_probs, temperature, seed, offset,
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
    accepted_nodes, output_token_ids, num_accepted = check_tree_rejection_args(
        parents, tree_token_ids, num_nodes, target_logits, draft_probs, temperature, seed, offset,
        accepted_nodes, output_token_ids, num_accepted)
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


@torch.library.register_fake("specdec::chain_rejection_sample_flat")
def _chain_rejection_sample_flat_fake(draft_token_ids, cu_num_draft_tokens, target_logits, draft_probs, temperature,
                                      seed, offset, output_token_ids, num_accepted):
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


_ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, out, lse):
    """Shape/dtype/device checks of tree_attention (no data-dependent checks: no host sync)."""
    check_tensor(q, "q", dtype=_ATTENTION_DTYPES, dims=3)
    T, Hq, D = q.shape
    dev = q.device
    check_tensor(k_cache, "k_cache", dtype=q.dtype, dims=4, device=dev)
    num_blocks, block_size, Hkv, _ = k_cache.shape
    check_tensor(k_cache, "k_cache", shape=(None, None, None, D))
    check_tensor(v_cache, "v_cache", dtype=q.dtype, shape=tuple(k_cache.shape), device=dev)
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"q's number of heads ({Hq}) must be a multiple of k_cache's ({Hkv})")
    if block_size < 1:
        raise ValueError(f"k_cache must have block_size >= 1, got shape {list(k_cache.shape)}")
    for t, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    check_tensor(block_table, "block_table", dtype=torch.int32, dims=2, device=dev)
    B = block_table.shape[0]
    check_tensor(prefix_lens, "prefix_lens", dtype=torch.int32, shape=(B,), device=dev)
    check_tensor(qo_indptr, "qo_indptr", dtype=torch.int32, shape=(B + 1,), device=dev)
    if tree_mask is not None:
        check_tensor(tree_mask, "tree_mask", dtype=torch.int64, shape=(T, None), device=dev)
        if tree_mask.shape[1] < 1:
            raise ValueError(f"tree_mask must have at least one word per row, got shape {list(tree_mask.shape)}")
        if not tree_mask.is_contiguous():
            raise ValueError("tree_mask must be contiguous")
    if out is not None:
        check_tensor(out, "out", dtype=q.dtype, shape=tuple(q.shape), device=dev)
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last dimension")
    if lse is not None:
        check_tensor(lse, "lse", dtype=torch.float32, shape=(T, Hq), device=dev)
        if not lse.is_contiguous():
            raise ValueError("lse must be contiguous")


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    sm_scale: float | None = None,
    *,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
):
    """Attention of all tree nodes of a batch over their prefix and their tree ancestors.

    q: [T, Hq, D] fp32/bf16/fp16; request b owns rows qo_indptr[b]:qo_indptr[b+1] in node
    order. k_cache, v_cache: [num_blocks, block_size, Hkv, D] (paged; a contiguous cache is
    one block of max_len per request), Hq a multiple of Hkv. block_table: int32
    [B, max_blocks]. prefix_lens: int32 [B]; node j of request b has its K/V at cache
    position prefix_lens[b] + j (written before the call). qo_indptr: int32 [B + 1].
    tree_mask: int64 [T, W] or None; bit j (word j // 64, little-endian) of row t set iff
    node j is visible to the node of row t (its own bit set); None = causal among the new
    tokens (plain decoding, chains). sm_scale: default 1 / sqrt(D).

    Returns out [T, Hq, D] (dtype of q), or (out, lse) with ``return_lse``: lse fp32
    [T, Hq], natural log-sum-exp of the scaled scores. ``out``/``lse`` may be given to
    write into (``lse`` given is always filled). Rows owned by no request, and rows that
    see no key, get out = 0 and lse = -inf.

    Data-dependent faults: on CPU, block ids out of range, a non-monotone qo_indptr, a
    prefix_lens + n beyond the block table, or more nodes than 64 * W raise RuntimeError;
    the Triton kernel skips the keys whose block id or table slot is out of range.

    The checks here cost some microseconds of Python per call; a hot loop on CPU may call
    ``torch.ops.specdec.tree_attention(..., sm_scale, out, lse)`` directly, whose C++
    kernel checks every argument too (RuntimeError).
    """
    _check_tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, out, lse)
    if sm_scale is None:
        sm_scale = float(q.shape[-1]) ** -0.5
    if out is None:
        out = torch.empty_like(q)
    if return_lse and lse is None:
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    torch.ops.specdec.tree_attention(
        q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, float(sm_scale), out, lse
    )
    return (out, lse) if return_lse else out


@torch.library.register_fake("specdec::tree_attention")
def _tree_attention_fake(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, sm_scale, out, lse):
    return None



# ---------------------------------------------------------------------------------------
# KV-cache compaction: compact_kv.
# ---------------------------------------------------------------------------------------


import weakref  # noqa: E402  (kept inside this section: it is only used here)


class _CacheLists:
    """K/V cache lists that passed the layer checks, remembered while all their tensors
    live (a weakref callback forgets the entry when any of them is freed, so a remembered
    id always names the tensor that was checked). With 30-60 layers the full check costs
    ~0.1-0.4 ms of Python per call, more than the kernel itself; a hit costs one tuple of
    ids. ``pointer_tables`` is where the Triton launcher keeps the layers' data pointers."""

    __slots__ = ("refs", "signature", "pointer_tables")

    def __init__(self, refs, signature):
        self.refs = refs
        self.signature = signature
        self.pointer_tables = None


_CHECKED_CACHE_LISTS: dict[tuple, _CacheLists] = {}


def _check_cache_lists(k_caches, v_caches) -> _CacheLists | None:
    """Raise a ValueError unless k_caches/v_caches are equal-length, non-empty lists of
    4-d tensors of one shape, dtype, device and strides, contiguous in the last dim.
    (Resizing a layer tensor in place between calls is not noticed on a remembered list;
    the C++ kernel checks every layer on each call anyway.)"""
    for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
        if not isinstance(caches, (list, tuple)):
            raise ValueError(f"{name} must be a list of tensors (one per layer), got {type(caches).__name__}")
    compiling = torch.compiler.is_compiling()  # under torch.compile: plain checks, no memo
    key = None if compiling else (tuple(map(id, k_caches)), tuple(map(id, v_caches)))
    entry = None if compiling else _CHECKED_CACHE_LISTS.get(key)
    if entry is not None:
        first = k_caches[0]
        if (first.shape, first.dtype, first.device, first.stride()) == entry.signature:
            return entry
    if len(k_caches) == 0:
        raise ValueError("k_caches must hold at least one layer tensor, got an empty list")
    if len(k_caches) != len(v_caches):
        raise ValueError(f"k_caches and v_caches must have the same length, got {len(k_caches)} and {len(v_caches)}")
    first = k_caches[0]
    check_tensor(first, "k_caches[0]", dims=4)
    for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
        for layer, t in enumerate(caches):
            check_tensor(t, f"{name}[{layer}]", dtype=first.dtype, shape=tuple(first.shape), device=first.device)
            if t.stride() != first.stride():
                raise ValueError(
                    f"{name}[{layer}] must have the strides of k_caches[0] {first.stride()}, got {t.stride()}"
                )
    if first.stride(3) != 1:
        raise ValueError(f"k_caches/v_caches must be contiguous in head_dim (stride 1), got strides {first.stride()}")

    if compiling:
        return None

    def forget(_ref, key=key):
        _CHECKED_CACHE_LISTS.pop(key, None)

    refs = tuple(weakref.ref(t, forget) for t in (*k_caches, *v_caches))
    entry = _CacheLists(refs, (first.shape, first.dtype, first.device, first.stride()))
    _CHECKED_CACHE_LISTS[key] = entry
    return entry


def _check_compact_kv_args(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted):
    """Shape/dtype/device checks of compact_kv (ValueError naming the argument); the
    data-dependent checks (node order, positions, block ids) are the kernels' job."""
    entry = _check_cache_lists(k_caches, v_caches)
    device = k_caches[0].device
    check_tensor(block_table, "block_table", dtype=torch.int32, dims=2, device=device)
    batch = block_table.shape[0]
    check_tensor(prefix_lens, "prefix_lens", dtype=torch.int32, shape=(batch,), device=device)
    check_tensor(accepted_nodes, "accepted_nodes", dtype=torch.int32, shape=(batch, None), device=device)
    check_tensor(num_accepted, "num_accepted", dtype=torch.int32, shape=(batch,), device=device)
    return entry


def compact_kv(
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Move the accepted tree nodes' K/V next to the root, in place, for every layer.

    k_caches, v_caches: one tensor per layer, each [num_blocks, block_size, num_kv_heads,
        head_dim], all of one shape, dtype (any, uint8 included) and device, contiguous in
        head_dim; a contiguous cache is block_size = max_len with one block per request.
    block_table: int32 [B, max_blocks] (cache position p of request b is in block
        block_table[b, p // block_size] at offset p % block_size; -1 padded).
    prefix_lens: int32 [B], cache position of tree node 0 (the root).
    accepted_nodes: int32 [B, D], accepted node indices, strictly increasing, >= 1,
        -1 padded (``tree_rejection_sample``'s output).
    num_accepted: int32 [B]; a negative count (a NaN row) moves nothing.

    For i < num_accepted[b]: position prefix_lens[b] + 1 + i <- position prefix_lens[b] +
    accepted_nodes[b, i] (K and V, every layer and head). Sources are read before
    destinations are written; identity moves (a chain) are skipped. Entries at other
    positions are unchanged. Data-dependent faults (node order, positions outside the block
    table, block ids out of range) raise on CPU; the Triton kernel skips such moves.

    The op only mutates the caches, so this wrapper returns None (a functional form that
    copied every layer's cache would defeat the purpose).
    """
    _check_compact_kv_args(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted)
    torch.ops.specdec.compact_kv(list(k_caches), list(v_caches), block_table, prefix_lens, accepted_nodes, num_accepted)


@torch.library.register_fake("specdec::compact_kv")
def _compact_kv_fake(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted):
    return None



# ---------------------------------------------------------------------------------------
# Medusa heads and the skinny GEMM: medusa_topk, skinny_linear.
# ---------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Largest number of rows for which `linear` uses skinny_linear instead of F.linear on CPU.
# Measured with `python bench/bench_medusa.py --threads 1` (its skinny_linear part is now
# bench/bench_linear.py) on the 2-core dev machine (torch 2.13, MKL/oneDNN, a CPU with
# AVX-512 and AMX) over the SmolLM2 layer shapes [1536, 576], [576, 1536], [576, 576],
# [192, 576], [49152, 576], with "cold" weights (each call takes the next of a pool of
# copies larger than the 300 MB L3, as in a decode step where the other layers evicted
# this one; bench/results/linear.json). fp32: F.linear time / skinny_linear time =
# 1.1-1.8x at M = 4 and 8 on every shape, 0.84-1.03x at M = 1-2 on the small shapes but
# 1.0-1.7x on the LM head, mixed from M = 16 (MKL's AVX-512 GEMM wins once the kernel is
# compute bound). bf16: oneDNN's bf16 GEMM (AMX) wins from M = 4 (skinny_linear 1.1-1.5x
# faster at M = 1-2). With the weight hot in L2 (a microbenchmark calling one small layer
# in a loop) F.linear wins on [576, 576] and [192, 576] at every M. (2-thread wall-clock
# medians on the shared machine were dominated by preemption.)
SKINNY_LINEAR_MAX_ROWS = 8
SKINNY_LINEAR_MAX_ROWS_BF16 = 2


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, out=None) -> torch.Tensor:
    """``x @ weight.T + bias`` streaming the weight once for all rows (CPU, few rows).

    x: [M, H] fp32/bf16/fp16; weight: [N, H] fp32/bf16/fp16, contiguous (bf16/fp16 weights
    are widened on the fly, so they stream half the bytes); bias: [N] or None; out: [M, N]
    of x's dtype (allocated when None). Accumulates in fp32. Designed for M <= 64; any M is
    correct (the CPU kernel just stops beating MKL). Returns out.
    """
    check_tensor(x, "x", dtype=_FLOAT_DTYPES, dims=2)
    check_tensor(weight, "weight", dtype=_FLOAT_DTYPES, dims=2, device=x.device)
    M, H = x.shape
    N = weight.shape[0]
    if weight.shape[1] != H:
        raise ValueError(f"weight must have shape [N, {H}] (x is [{M}, {H}]), got {list(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if bias is not None:
        check_tensor(bias, "bias", dtype=_FLOAT_DTYPES, shape=(N,), device=x.device)
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    else:
        check_tensor(out, "out", dtype=x.dtype, shape=(M, N), device=x.device)
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    torch.ops.specdec.skinny_linear(x, weight, bias, out)
    return out


def skinny_linear_rows(dtype: torch.dtype, num_threads: int | None = None) -> tuple[int, int]:
    """(min_rows, max_rows): ``linear`` uses skinny_linear for min_rows <= rows <= max_rows,
    for ``dtype`` and ``num_threads`` torch threads (default: torch.get_num_threads()).

    fp32 with one thread, measured on the whole SmolLM2-135M forward (30 layers + LM head,
    fresh weights each product as in decoding; one process, medians of 5, 2-core shared
    machine, torch 2.13): F.linear / skinny_linear time = 0.90 at T = 1 row (55 vs 61 ms),
    0.94 at 2, 1.00 at 3, 1.54 at 5 (100 vs 65 ms), 1.52-1.65 at 8 (114 vs 69 ms), 1.68 at
    12 (143 vs 85 ms), 0.92 at 20 (121 vs 131 ms) — MKL's single-threaded GEMV is the best
    at 1-2 rows but its small-M GEMM is not, so skinny for 3..15 rows. (Greedy
    autoregressive decoding alone: 32 vs 26 tokens/s with F.linear.) Re-measured for 8-24
    rows (linears only, quiet machine): F.linear / skinny = 89/58 ms at 8, 105/64 at 12,
    109/71 at 13, 115/85 at 14, 91/90 at 16, 92/99 at 20, 100/129 at 24 — the range ended at
    12 before, which made a 13-row verification step 2x slower than a 12-row one.
    Otherwise (bf16, or several threads): 1..SKINNY_LINEAR_MAX_ROWS (fp32) /
    SKINNY_LINEAR_MAX_ROWS_BF16, the per-shape measurement in the comment above them.
    """
    max_rows = SKINNY_LINEAR_MAX_ROWS if dtype == torch.float32 else SKINNY_LINEAR_MAX_ROWS_BF16
    threads = num_threads if num_threads is not None else torch.get_num_threads()
    if threads <= 1 and dtype == torch.float32:
        return 3, 15
    return 1, max_rows


def _in_range(rows: int, bounds: tuple[int, int]) -> bool:
    return bounds[0] <= rows <= bounds[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that uses ``skinny_linear`` where it was measured to be faster.

    x: [..., H]; weight: [N, H]; bias: [N] or None. skinny_linear is used on CPU when the
    flattened row count is within skinny_linear_rows(x.dtype) (which depends on the torch
    thread count: 3..15 rows for fp32 with one thread, 1..SKINNY_LINEAR_MAX_ROWS(_BF16)
    otherwise; the measurements are in its docstring), x, weight (and bias) are all fp32 or
    all bf16, the weight is contiguous and no gradient is needed (skinny_linear has no
    autograd formula); otherwise this is exactly ``F.linear``. (skinny_linear accumulates
    in fp32 and rounds once, so bf16 results can differ from F.linear's in the last bit.)
    This is the one place the choice is made: the model and the Medusa heads call it.
    """
    rows = x.numel() // x.shape[-1] if x.dim() > 0 and x.shape[-1] > 0 else 0
    use_skinny = (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and _in_range(rows, skinny_linear_rows(x.dtype))
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.is_contiguous()
        and (bias is None or (bias.dim() == 1 and bias.device.type == "cpu" and bias.dtype == x.dtype))
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                              or (bias is not None and bias.requires_grad)))
    )
    if not use_skinny:
        return torch.nn.functional.linear(x, weight, bias)
    out = skinny_linear(x.reshape(rows, x.shape[-1]), weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def medusa_topk(
    hidden: torch.Tensor,
    res_weight: torch.Tensor,
    res_bias: torch.Tensor,
    lm_head: torch.Tensor,
    top_k: int,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k candidates of K Medusa heads, fused: the [M, K, V] logits are never written.

    hidden: [M, H]; res_weight: [K, L, H, H] and res_bias: [K, L, H] (L ResBlocks per head,
    x <- x + SiLU(x W^T + b); L may be 0); lm_head: [V, H] shared by all heads or [K, V, H]
    per head; all fp32/bf16/fp16 (arithmetic in fp32), weights contiguous; 1 <= top_k <= V.
    Returns (topk_ids int64 [M, K, top_k], topk_logprobs fp32 [M, K, top_k]): per row and
    head, the top_k vocabulary ids by descending logit (ties to the lower id) and their
    log-softmax values. ``out`` = (topk_ids, topk_logprobs) to write into.
    Non-finite logits raise on CPU (RuntimeError); on GPU they give NaN log-probs.
    """
    check_tensor(hidden, "hidden", dtype=_FLOAT_DTYPES, dims=2)
    M, H = hidden.shape
    dev = hidden.device
    check_tensor(res_weight, "res_weight", dtype=_FLOAT_DTYPES, dims=4, device=dev)
    K, L = res_weight.shape[0], res_weight.shape[1]
    if K < 1:
        raise ValueError(f"res_weight must have at least one head (K >= 1), got shape {list(res_weight.shape)}")
    check_tensor(res_weight, "res_weight", shape=(K, L, H, H))
    check_tensor(res_bias, "res_bias", dtype=_FLOAT_DTYPES, shape=(K, L, H), device=dev)
    check_tensor(lm_head, "lm_head", dtype=_FLOAT_DTYPES, device=dev)
    if lm_head.dim() == 2 and lm_head.shape[1] == H:
        V = lm_head.shape[0]
    elif lm_head.dim() == 3 and lm_head.shape[0] == K and lm_head.shape[2] == H:
        V = lm_head.shape[1]
    else:
        raise ValueError(
            f"lm_head must have shape [V, {H}] (shared) or [{K}, V, {H}] (per head), got {list(lm_head.shape)}"
        )
    if V < 1:
        raise ValueError(f"lm_head must have at least one vocabulary row, got shape {list(lm_head.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= V:
        raise ValueError(f"top_k must be an int in [1, V = {V}], got {top_k!r}")
    for t, name in ((res_weight, "res_weight"), (res_bias, "res_bias"), (lm_head, "lm_head")):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if out is None:
        topk_ids = torch.empty((M, K, top_k), dtype=torch.int64, device=dev)
        topk_logprobs = torch.empty((M, K, top_k), dtype=torch.float32, device=dev)
    else:
        topk_ids, topk_logprobs = out
        check_tensor(topk_ids, "topk_ids", dtype=torch.int64, shape=(M, K, top_k), device=dev)
        check_tensor(topk_logprobs, "topk_logprobs", dtype=torch.float32, shape=(M, K, top_k), device=dev)
        if not (topk_ids.is_contiguous() and topk_logprobs.is_contiguous()):
            raise ValueError("topk_ids and topk_logprobs must be contiguous")
    torch.ops.specdec.medusa_topk(hidden.contiguous(), res_weight, res_bias, lm_head, top_k, topk_ids, topk_logprobs)
    return topk_ids, topk_logprobs


@torch.library.register_fake("specdec::medusa_topk")
def _medusa_topk_fake(hidden, res_weight, res_bias, lm_head, top_k, topk_ids, topk_logprobs):
    return None


@torch.library.register_fake("specdec::skinny_linear")
def _skinny_linear_fake(x, weight, bias, out):
    return None
