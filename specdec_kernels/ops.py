"""Typed wrappers of the ``torch.ops.specdec`` ops and their fakes.

Each op is called as ``torch.ops.specdec.<name>(..., out tensors)`` (destination-passing,
capturable in CUDA graphs, strict about dtypes and shapes). The wrappers here are the
friendlier form: they accept Python numbers for per-request parameters, either integer
width (int32/int64) for index tensors (cast on the device, no host sync), defaults for the
optional arguments, allocate the outputs and return them. Their argument checks are those
of ``specdec_kernels.checks`` (errors that name the argument), run once per call: by the
wrapper on CPU, by the Triton launcher on CUDA (see that module). The fakes
(``register_fake``) describe the ops to ``torch.compile`` and ``opcheck``: ops that only
write into their arguments return nothing, so their fakes only check that all tensors are on
one device (they are the Meta kernels too) and return None.
"""
from __future__ import annotations

import torch

from . import checks
from .checks import MIN_SAMPLING_TEMPERATURE
from .tree import qo_indptr_from_num_nodes, tree_mask_ragged

__all__ = [
    "MIN_SAMPLING_TEMPERATURE",
    "philox_uniform",
    "chain_rejection_sample",
    "chain_rejection_sample_flat",
    "tree_rejection_sample",
    "apply_top_k_top_p",
    "apply_temperature_top_k_top_p",
    "tree_attention",
    "compact_kv",
    "medusa_topk", "skinny_linear", "linear",
]


# ---------------------------------------------------------------------------------------
# Conversions: what the wrappers accept beyond the ops' strict argument types.
# (The checks themselves are in specdec_kernels.checks; see its docstring for who runs them.)
# ---------------------------------------------------------------------------------------

_INDEX_DTYPES = (torch.int32, torch.int64)


def _index(t, dtype: torch.dtype, name: str):
    """An index tensor in the integer width the op takes: the other of int32/int64 is cast
    on its device (no host sync; values are assumed to fit in int32). A tensor of another
    dtype is a ValueError naming ``name`` and both widths the wrapper accepts (the op's own
    check would name only the width the raw op takes); anything else is returned as given,
    for the op's check to report."""
    if isinstance(t, torch.Tensor) and t.dtype != dtype:
        if t.dtype not in _INDEX_DTYPES:
            other = torch.int64 if dtype == torch.int32 else torch.int32
            raise ValueError(f"{name} must have dtype {dtype} or {other}, got {t.dtype}")
        return t.to(dtype)
    return t


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _per_row(value, dtype: torch.dtype, rows: int, device):
    """A Python number broadcast to a [rows] tensor of ``dtype`` on ``device``; anything
    else as given."""
    if _is_number(value):
        return torch.full((rows,), value, dtype=dtype, device=device)
    return value


def _sampling_params(temperature, seed, offset, batch: int, device):
    """temperature fp32 [B], seed and offset int64 [B] from tensors or Python numbers;
    seed=None draws the seeds from torch's generator (``torch.manual_seed`` reproduces them)."""
    if seed is None:
        seed = torch.randint(0, 2**62, (batch,), dtype=torch.int64, device=device)
    return (_per_row(temperature, torch.float32, batch, device), _per_row(seed, torch.int64, batch, device),
            _per_row(offset, torch.int64, batch, device))


# ---------------------------------------------------------------------------------------
# Random numbers.
# ---------------------------------------------------------------------------------------


def philox_uniform(seed: torch.Tensor, offset: torch.Tensor | int, position: int, purpose: int,
                   num: int) -> torch.Tensor:
    """The package generator's uniforms (see ``specdec_kernels.rng``).

    seed: int64 [B]; offset: int64 [B] or a Python int for every request. Returns fp32
    [B, num], the uniforms for vocabulary indices 0..num-1 at ``position`` for ``purpose``.
    (The op has no Triton launcher: this wrapper always checks.)
    """
    checks.check_tensor(seed, "seed", dims=1)
    offset = _per_row(offset, torch.int64, seed.shape[0], seed.device)
    checks.check_philox_uniform(seed, offset)
    return torch.ops.specdec.philox_uniform(seed, offset, position, purpose, num)


@torch.library.register_fake("specdec::philox_uniform")
def _philox_uniform_fake(seed, offset, position, purpose, num):
    checks.check_one_device("philox_uniform", locals())
    return seed.new_empty((seed.shape[0], num), dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# Rejection sampling: chain_rejection_sample, tree_rejection_sample, apply_top_k_top_p.
# ---------------------------------------------------------------------------------------

def chain_rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    temperature: torch.Tensor | float = 1.0,
    seed: torch.Tensor | int | None = None,
    offset: torch.Tensor | int = 0,
    *,
    output_token_ids: torch.Tensor | None = None,
    num_accepted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless verification of a chain of drafted tokens per request (docs/design.md).

    Args:
        draft_token_ids: int64 (or int32) [B, K], the drafted tokens (entries beyond
            ``num_draft_tokens[b]`` are ignored).
        num_draft_tokens: int32 (or int64) [B], values in 0..K (ragged).
        target_logits: fp32/bf16/fp16 [B, K+1, V]; row k = the target's logits after the
            first k drafts (rows beyond ``num_draft_tokens[b]`` are not read).
        draft_probs: fp32 [B, K, V], the draft distributions q the drafts were drawn from,
            or None (the default) for deterministic drafters (q = one-hot on the drafted
            token: accept with probability p(x), residual = p with x zeroed).
        temperature: fp32 [B], or a Python number for every request (default 1.0);
            T >= ``MIN_SAMPLING_TEMPERATURE`` (2^-64, ~5.4e-20) samples from
            softmax(logits / T); anything else (smaller, 0, negative, NaN) is greedy, the
            limit of sampling as T -> 0: accept while the draft equals the first argmax of
            the raw logits, then emit that argmax.
        seed, offset: int64 [B] or Python ints for every request, the Philox key and
            counter base of each request. seed=None (the default) draws seeds from
            torch's generator (``torch.manual_seed`` reproduces them); offset defaults to 0.
        output_token_ids, num_accepted: optional destinations (int64 [B, K+1], int32 [B]).

    Returns ``(output_token_ids, num_accepted)``: accepted drafts, then one recovered or
    bonus token, then -1; ``num_accepted[b]`` drafts were accepted. A request whose rows
    0..num_draft_tokens[b] hold a NaN or +inf, or a row that is entirely -inf, gets
    ``num_accepted = -1`` and an all -1 row; for a sampled request this holds for l / T as
    computed in fp32 (l times 1/T), so l / T overflowing fp32 (|l| > 3.4e38 * T) or a -inf
    logit at T = +inf (NaN) also give -1. The outputs must not share memory with the
    inputs or with each other (a ValueError naming both; the CPU kernel, called through
    ``torch.ops``, raises a RuntimeError).

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
    checks.check_tensor(draft_token_ids, "draft_token_ids", dims=2)
    batch, max_drafts = draft_token_ids.shape
    device = draft_token_ids.device
    draft_token_ids = _index(draft_token_ids, torch.int64, "draft_token_ids")
    num_draft_tokens = _index(num_draft_tokens, torch.int32, "num_draft_tokens")
    temperature, seed, offset = _sampling_params(temperature, seed, offset, batch, device)
    if output_token_ids is None:
        output_token_ids = torch.empty((batch, max_drafts + 1), dtype=torch.int64, device=device)
    if num_accepted is None:
        num_accepted = torch.empty((batch,), dtype=torch.int32, device=device)
    if not checks.launcher_checks(device):
        checks.check_chain_rejection_sample(draft_token_ids, num_draft_tokens, target_logits, draft_probs,
                                            temperature, seed, offset, output_token_ids, num_accepted)
    torch.ops.specdec.chain_rejection_sample(
        draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature, seed, offset,
        output_token_ids, num_accepted,
    )
    return output_token_ids, num_accepted


def chain_rejection_sample_flat(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    temperature: torch.Tensor | float = 1.0,
    seed: torch.Tensor | int | None = None,
    offset: torch.Tensor | int = 0,
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
        temperature, seed, offset: [B] or Python numbers, as for ``chain_rejection_sample``.
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
    checks.check_tensor(cu_num_draft_tokens, "cu_num_draft_tokens", dims=1)
    batch = cu_num_draft_tokens.shape[0]
    device = cu_num_draft_tokens.device
    draft_token_ids = _index(draft_token_ids, torch.int64, "draft_token_ids")
    cu_num_draft_tokens = _index(cu_num_draft_tokens, torch.int32, "cu_num_draft_tokens")
    temperature, seed, offset = _sampling_params(temperature, seed, offset, batch, device)
    if output_token_ids is None:
        if max_num_draft_tokens is None:
            checks.check_tensor(cu_num_draft_tokens, "cu_num_draft_tokens", dtype=torch.int32)
            cu = cu_num_draft_tokens.tolist()
            max_num_draft_tokens = max((b - a for a, b in zip([0] + cu[:-1], cu)), default=0)
        if isinstance(max_num_draft_tokens, bool) or not isinstance(max_num_draft_tokens, int) \
                or max_num_draft_tokens < 0:
            raise ValueError(f"max_num_draft_tokens must be an int >= 0, got {max_num_draft_tokens!r}")
        output_token_ids = torch.empty((batch, max_num_draft_tokens + 1), dtype=torch.int64, device=device)
    if num_accepted is None:
        num_accepted = torch.empty((batch,), dtype=torch.int32, device=device)
    if not checks.launcher_checks(device):
        checks.check_chain_rejection_sample_flat(draft_token_ids, cu_num_draft_tokens, target_logits, draft_probs,
                                                 temperature, seed, offset, output_token_ids, num_accepted)
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
    draft_probs: torch.Tensor | None = None,
    temperature: torch.Tensor | float = 1.0,
    seed: torch.Tensor | int | None = None,
    offset: torch.Tensor | int = 0,
    *,
    accepted_nodes: torch.Tensor | None = None,
    output_token_ids: torch.Tensor | None = None,
    num_accepted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless verification of a tree of drafted tokens per request (docs/design.md).

    Args:
        parents: int32 (or int64) [B, N]; node 0 is the root (the last verified token),
            parents[b, 0] = -1, 0 <= parents[b, i] < i for 0 < i < num_nodes[b].
        tree_token_ids: int64 (or int32) [B, N], the token of every node (node 0's is
            not read).
        num_nodes: int32 (or int64) [B], values in 0..N (0: nothing is emitted,
            num_accepted = 0).
        target_logits: fp32/bf16/fp16 [B, N, V]; row i = logits for the token after node i.
        draft_probs: fp32 [B, N, V] or None (the default); row i = the q the children of
            node i were drawn from i.i.d.; None = deterministic children (e.g. top-k of a
            drafter).
        temperature, seed, offset: as for ``chain_rejection_sample`` (tensors [B] or
            Python numbers; defaults 1.0, None = drawn from torch's generator, 0).
        accepted_nodes, output_token_ids, num_accepted: optional destinations (int32
            [B, N-1], int64 [B, N], int32 [B]).

    Returns ``(accepted_nodes, output_token_ids, num_accepted)``: the accepted path (root
    excluded, -1 padded), its tokens followed by the recovered/bonus token (-1 padded) and
    the path length. The walk: at node i try its children in index order with a residual
    p' (initially softmax(row i / T)); with draft_probs accept child x iff
    u <= p'(x) / q(x) else p' <- normalize(max(p' - q, 0)); without, accept iff
    u <= p'(x) else p'(x) <- 0 and renormalise (if p' has no mass left, which only
    rounding can cause, p' <- p_i). After the last rejection or at a leaf the last token
    is drawn from p'. Greedy requests (T < ``MIN_SAMPLING_TEMPERATURE``, 0, negative, NaN)
    follow the first argmax. NaN rows and memory shared by outputs and inputs: as for
    chains (rows 0..num_nodes-1).

    Randomness: the acceptance of node c uses position c (PURPOSE_ACCEPT, index 0), the
    token drawn at node i uses position i (PURPOSE_SAMPLE, index v). A call consumes
    positions 0..N-1: the caller advances ``offset`` by N (``parents.shape[1]``). A chain
    is the tree parents = [-1, 0, 1, ...] and gives the same tokens with the same seeds.

    Data-dependent faults: on CPU an invalid parent, a token id outside [0, V) or a
    num_nodes outside 0..N raises RuntimeError; the Triton kernel clamps num_nodes,
    never visits a node whose parent is not an earlier node, and treats an out-of-range
    token as rejected with p(x) = 0 (it never reads out of bounds).
    """
    checks.check_tensor(parents, "parents", dims=2)
    batch, max_nodes = parents.shape
    device = parents.device
    parents = _index(parents, torch.int32, "parents")
    tree_token_ids = _index(tree_token_ids, torch.int64, "tree_token_ids")
    num_nodes = _index(num_nodes, torch.int32, "num_nodes")
    temperature, seed, offset = _sampling_params(temperature, seed, offset, batch, device)
    if accepted_nodes is None:
        accepted_nodes = torch.empty((batch, max(max_nodes - 1, 0)), dtype=torch.int32, device=device)
    if output_token_ids is None:
        output_token_ids = torch.empty((batch, max_nodes), dtype=torch.int64, device=device)
    if num_accepted is None:
        num_accepted = torch.empty((batch,), dtype=torch.int32, device=device)
    if not checks.launcher_checks(device):
        checks.check_tree_rejection_sample(parents, tree_token_ids, num_nodes, target_logits, draft_probs,
                                           temperature, seed, offset, accepted_nodes, output_token_ids, num_accepted)
    torch.ops.specdec.tree_rejection_sample(
        parents, tree_token_ids, num_nodes, target_logits, draft_probs, temperature, seed, offset,
        accepted_nodes, output_token_ids, num_accepted,
    )
    return accepted_nodes, output_token_ids, num_accepted


def _row_param(value, name: str, dtype: torch.dtype, batch: int, seq: int | None, device):
    """A per-row parameter in the op's [R] form: a Python number is broadcast; for 3-D
    logits [B, S, V] a [B] tensor is repeated over S and a [B, S] one flattened."""
    if value is None:
        return None
    rows = batch if seq is None else batch * seq
    if _is_number(value):
        return torch.full((rows,), value, dtype=dtype, device=device)
    if dtype == torch.int32:
        value = _index(value, dtype, name)
    if seq is None or not isinstance(value, torch.Tensor):
        return value  # the op's form already (or not a tensor): the op's check reports
    if tuple(value.shape) == (batch,):
        return value.repeat_interleave(seq)
    if tuple(value.shape) == (batch, seq):
        return value.reshape(rows)
    raise ValueError(f"{name} must have shape [{batch}] or [{batch}, {seq}] (logits are [B, S, V] = "
                     f"[{batch}, {seq}, *]), got {list(value.shape)}")


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | int | None = None,
    top_p: torch.Tensor | float | None = None,
    min_p: torch.Tensor | float | None = None,
    *,
    inplace: bool = True,
) -> torch.Tensor:
    """Mask logits outside the top-k / top-p / min-p sets to -inf; returns the logits.

    Args:
        logits: fp32/bf16/fp16 [R, V], or [B, S, V] (e.g. the K+1 verification rows of B
            requests), contiguous; modified in place unless ``inplace=False``.
        top_k: int32 (or int64) [R] (for 3-D logits [B] or [B, S]), or a Python int for
            every row; 0 (or <= 0, or >= V) = off.
        top_p: fp32, same shapes, or a Python number; >= 1 = off.
        min_p: fp32, same shapes, or a Python number; <= 0 = off.

    Per row, on the values as given (temperature 1: divide by T first to apply them at
    temperature T), in this order: top-k keeps l_v >= the k-th largest value (ties at
    the k-th value are all kept, so more than k may survive); top-p, on the softmax of
    the top-k survivors, keeps v iff the mass of survivors with a strictly larger value
    is < top_p (the largest value and ties at the threshold are always kept); min-p keeps
    v iff exp(l_v - max) >= min(min_p, 1). Rows holding a NaN are left unchanged (the
    sampler then reports them). The Triton kernel finds the thresholds by bisection on
    the ordered float bits instead of sorting, with the same result.
    """
    checks.check_tensor(logits, "logits")
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must have 2 or 3 dimensions ([R, V] or [B, S, V]), got shape {list(logits.shape)}")
    if not inplace:
        logits = logits.clone()
    device = logits.device
    if logits.dim() == 3:
        checks.check_contiguous(logits, "logits", " (the op works in place)")  # for the view
        batch, seq, vocab = logits.shape
        flat = logits.view(batch * seq, vocab)
    else:
        batch, seq = logits.shape[0], None
        flat = logits
    top_k = _row_param(top_k, "top_k", torch.int32, batch, seq, device)
    top_p = _row_param(top_p, "top_p", torch.float32, batch, seq, device)
    min_p = _row_param(min_p, "min_p", torch.float32, batch, seq, device)
    if not checks.launcher_checks(device):
        checks.check_apply_top_k_top_p(flat, top_k, top_p, min_p)
    torch.ops.specdec.apply_top_k_top_p(flat, top_k, top_p, min_p)
    return logits


def apply_temperature_top_k_top_p(logits: torch.Tensor, temperature: torch.Tensor,
                                  top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None) -> torch.Tensor:
    """The logits to sample from at temperature T with top-k / top-p, as vLLM and Hugging Face
    define them (top-p on softmax(logits / T)): in place, each sampled row (T >=
    MIN_SAMPLING_TEMPERATURE) divided by its T, then every row masked by
    ``apply_top_k_top_p``; returns the logits. Sample the result at temperature 1 (its
    softmax is the distribution); greedy rows (smaller T, 0, NaN) keep their values (the
    masks always keep the largest one), so their argmax is unchanged.

    logits: fp32 [R, V], contiguous; temperature: fp32 [R]; top_k: int32 [R] or None; top_p:
    fp32 [R] or None (per row; 0 / 1 are off). The one implementation the decode loop, the
    drafters and the vLLM sampler use.
    """
    checks.check_tensor(logits, "logits", dtype=torch.float32, dims=2)
    checks.check_tensor(temperature, "temperature", shape=(logits.shape[0],), device=logits.device)
    greedy = ~(temperature >= MIN_SAMPLING_TEMPERATURE)  # the samplers' rule (NaN too)
    logits.div_(torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32).unsqueeze(1))
    if top_k is not None or top_p is not None:
        apply_top_k_top_p(logits, top_k, top_p)
    return logits


@torch.library.register_fake("specdec::chain_rejection_sample")
def _chain_rejection_sample_fake(draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature, seed,
                                 offset, output_token_ids, num_accepted):
    checks.check_one_device("chain_rejection_sample", locals())
    return None


@torch.library.register_fake("specdec::chain_rejection_sample_flat")
def _chain_rejection_sample_flat_fake(draft_token_ids, cu_num_draft_tokens, target_logits, draft_probs, temperature,
                                      seed, offset, output_token_ids, num_accepted):
    checks.check_one_device("chain_rejection_sample_flat", locals())
    return None


@torch.library.register_fake("specdec::tree_rejection_sample")
def _tree_rejection_sample_fake(parents, tree_token_ids, num_nodes, target_logits, draft_probs, temperature, seed,
                                offset, accepted_nodes, output_token_ids, num_accepted):
    checks.check_one_device("tree_rejection_sample", locals())
    return None


@torch.library.register_fake("specdec::apply_top_k_top_p")
def _apply_top_k_top_p_fake(logits, top_k, top_p, min_p):
    checks.check_one_device("apply_top_k_top_p", locals())
    return None



# ---------------------------------------------------------------------------------------
# Tree attention: tree_attention.
# ---------------------------------------------------------------------------------------


def _ragged_tree_mask(tree_mask, qo_indptr, num_rows: int, device):
    """The op's ragged mask [T, W] from tree.tree_mask's batched [B, N, W] (a gather on the
    device: no host sync; T is q's first dimension)."""
    checks.check_tensor(tree_mask, "tree_mask", dtype=torch.int64, dims=3, device=device)
    checks.check_tensor(qo_indptr, "qo_indptr", dims=1)
    if tree_mask.shape[0] + 1 != qo_indptr.shape[0]:
        raise ValueError(f"tree_mask [B, N, W] must have one row block per request, B = {qo_indptr.shape[0] - 1} "
                         f"(qo_indptr is [B + 1]), got {list(tree_mask.shape)}")
    return tree_mask_ragged(tree_mask, qo_indptr, num_rows)


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    qo_indptr: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
    sm_scale: float | None = None,
    *,
    num_nodes: torch.Tensor | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
):
    """Attention of all tree nodes of a batch over their prefix and their tree ancestors.

    q: [T, Hq, D] fp32/bf16/fp16; request b owns rows qo_indptr[b]:qo_indptr[b+1] in node
    order. k_cache, v_cache: [num_blocks, block_size, Hkv, D] (paged; a contiguous cache is
    one block of max_len per request), Hq a multiple of Hkv. block_table: int32
    [B, max_blocks]. prefix_lens: int32 [B]; node j of request b has its K/V at cache
    position prefix_lens[b] + j (written before the call). qo_indptr: int32 [B + 1]; or,
    instead, num_nodes: int32 [B] (the rows of each request, qo_indptr = [0, cumsum]).
    The index tensors may also be int64 (cast on the device).
    tree_mask: int64 [T, W], or the batched [B, N, W] of ``specdec_kernels.tree.tree_mask``
    / ``build_tree(...).tree_mask`` (converted here with ``tree.tree_mask_ragged``: a few
    small device ops per call, so a decode loop converts once per step and passes [T, W]),
    or None; bit j (word j // 64, little-endian) of row t set iff node j is visible to the
    node of row t (its own bit set); None = causal among the new tokens (plain decoding,
    chains). sm_scale: default 1 / sqrt(D).

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
    checks.check_tensor(q, "q", dims=3)
    device = q.device
    block_table = _index(block_table, torch.int32, "block_table")
    prefix_lens = _index(prefix_lens, torch.int32, "prefix_lens")
    if num_nodes is not None:
        if qo_indptr is not None:
            raise ValueError("pass qo_indptr or num_nodes, not both")
        checks.check_tensor(num_nodes, "num_nodes", dtype=_INDEX_DTYPES, dims=1, device=device)
        if isinstance(block_table, torch.Tensor) and block_table.dim() == 2 and len(num_nodes) != len(block_table):
            raise ValueError(f"num_nodes must have shape [{len(block_table)}] (one per row of block_table), "
                             f"got {list(num_nodes.shape)}")
        qo_indptr = qo_indptr_from_num_nodes(num_nodes)
    elif qo_indptr is None:
        raise ValueError("tree_attention needs qo_indptr (int32 [B + 1]) or num_nodes (int32 [B])")
    qo_indptr = _index(qo_indptr, torch.int32, "qo_indptr")
    if isinstance(tree_mask, torch.Tensor) and tree_mask.dim() == 3:
        tree_mask = _ragged_tree_mask(tree_mask, qo_indptr, q.shape[0], device)
    if sm_scale is None:
        sm_scale = float(q.shape[-1]) ** -0.5
    if out is None:
        out = torch.empty_like(q)
    if return_lse and lse is None:
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=device)
    if not checks.launcher_checks(device):
        checks.check_tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, out, lse)
    torch.ops.specdec.tree_attention(
        q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, float(sm_scale), out, lse
    )
    return (out, lse) if return_lse else out


@torch.library.register_fake("specdec::tree_attention")
def _tree_attention_fake(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, sm_scale, out, lse):
    checks.check_one_device("tree_attention", locals())
    return None



# ---------------------------------------------------------------------------------------
# KV-cache compaction: compact_kv.
# ---------------------------------------------------------------------------------------


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
        head_dim, each its own memory (a tensor given twice, e.g. k_caches[l] as
        v_caches[l], would have its rows moved twice: a ValueError naming both, from the
        CPU kernel through ``torch.ops`` a RuntimeError); a contiguous cache is
        block_size = max_len with one block per request.
    block_table: int32 [B, max_blocks] (cache position p of request b is in block
        block_table[b, p // block_size] at offset p % block_size; -1 padded).
    prefix_lens: int32 [B], cache position of tree node 0 (the root).
    accepted_nodes: int32 [B, D], accepted node indices, strictly increasing, >= 1,
        -1 padded (``tree_rejection_sample``'s output).
    num_accepted: int32 [B]; a negative count (a NaN row) moves nothing.
    The index tensors may also be int64 (cast on the device).

    For i < num_accepted[b]: position prefix_lens[b] + 1 + i <- position prefix_lens[b] +
    accepted_nodes[b, i] (K and V, every layer and head). Sources are read before
    destinations are written; identity moves (a chain) are skipped. Entries at other
    positions are unchanged. Data-dependent faults (node order, positions outside the block
    table, block ids out of range) raise on CPU; the Triton kernel skips such moves.

    The op only mutates the caches, so this wrapper returns None (a functional form that
    copied every layer's cache would defeat the purpose).
    """
    block_table = _index(block_table, torch.int32, "block_table")
    prefix_lens = _index(prefix_lens, torch.int32, "prefix_lens")
    accepted_nodes = _index(accepted_nodes, torch.int32, "accepted_nodes")
    num_accepted = _index(num_accepted, torch.int32, "num_accepted")
    first = k_caches[0] if isinstance(k_caches, (list, tuple)) and len(k_caches) > 0 else None
    if not (isinstance(first, torch.Tensor) and checks.launcher_checks(first.device)):
        checks.check_compact_kv(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted)
    torch.ops.specdec.compact_kv(list(k_caches), list(v_caches), block_table, prefix_lens, accepted_nodes, num_accepted)


@torch.library.register_fake("specdec::compact_kv")
def _compact_kv_fake(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted):
    checks.check_one_device("compact_kv", locals())
    return None



# ---------------------------------------------------------------------------------------
# Medusa heads and the skinny GEMM: medusa_topk, skinny_linear.
# ---------------------------------------------------------------------------------------



def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, out=None) -> torch.Tensor:
    """``x @ weight.T + bias`` streaming the weight once for all rows (CPU, few rows).

    x: [M, H] fp32/bf16/fp16; weight: [N, H] fp32/bf16/fp16, contiguous (bf16/fp16 weights
    are widened on the fly, so they stream half the bytes); bias: [N] or None; out: [M, N]
    of x's dtype (allocated when None), not sharing memory with x, the weight or the bias (it
    is written while they are read: a ValueError, from the CPU kernel through ``torch.ops``
    a RuntimeError). Accumulates in fp32. Designed for M <= 64; any M is correct (the CPU
    kernel just stops beating MKL). Returns out.
    """
    checks.check_tensor(x, "x", dims=2)
    checks.check_tensor(weight, "weight", dims=2)
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    if not checks.launcher_checks(x.device):
        checks.check_skinny_linear(x, weight, bias, out)
    torch.ops.specdec.skinny_linear(x, weight, bias, out)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           skinny_rows: tuple[int, int] | None = None) -> torch.Tensor:
    """``F.linear`` that uses ``skinny_linear`` for the row counts the caller names.

    x: [..., H]; weight: [N, H] tensor; bias: [N] or None. skinny_linear is used when the
    flattened row count lies in ``skinny_rows`` (min, max), inclusive — the caller's choice
    (the model's rule is ``models.skinny_rows.skinny_linear_rows``: which kernel is faster at
    which row count was measured on a machine, which is model policy, not an op-layer fact)
    — and x, weight (and bias) are all fp32 or all bf16 on CPU, the weight is contiguous and
    no gradient is needed (skinny_linear has no autograd formula); otherwise, and always with
    ``skinny_rows=None``, this is exactly ``F.linear``. (skinny_linear accumulates in fp32
    and rounds once, so bf16 results can differ from F.linear's in the last bit.)

    GGUF block weights (``gguf_blocks.QuantizedWeight``) are not taken here: they multiply
    with ``QuantizedWeight.linear``, their one product (the model's ``linear`` picks it with
    an isinstance check; this module cannot import gguf_blocks, which imports it).
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"ops.linear takes a tensor weight, got {type(weight).__name__} "
                        "(a gguf_blocks.QuantizedWeight multiplies with its .linear)")
    rows = x.numel() // x.shape[-1] if x.dim() > 0 and x.shape[-1] > 0 else 0
    use_skinny = (
        skinny_rows is not None
        and skinny_rows[0] <= rows <= skinny_rows[1]
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
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
    checks.check_tensor(hidden, "hidden", dims=2)
    checks.check_tensor(res_weight, "res_weight", dims=4)
    hidden = hidden.contiguous()
    if out is None:
        # A bad top_k allocates nothing here (top_k = 2^40 would fail to allocate, with a
        # message naming no argument): the check below (or the launcher's) names it.
        vocab = lm_head.shape[-2] if isinstance(lm_head, torch.Tensor) and lm_head.dim() >= 2 else 0
        size = (hidden.shape[0], res_weight.shape[0], top_k if isinstance(top_k, int) and 0 < top_k <= vocab else 0)
        topk_ids = torch.empty(size, dtype=torch.int64, device=hidden.device)
        topk_logprobs = torch.empty(size, dtype=torch.float32, device=hidden.device)
    else:
        topk_ids, topk_logprobs = out
    if not checks.launcher_checks(hidden.device):
        checks.check_medusa_topk(hidden, res_weight, res_bias, lm_head, top_k, topk_ids, topk_logprobs)
    torch.ops.specdec.medusa_topk(hidden, res_weight, res_bias, lm_head, top_k, topk_ids, topk_logprobs)
    return topk_ids, topk_logprobs


@torch.library.register_fake("specdec::medusa_topk")
def _medusa_topk_fake(hidden, res_weight, res_bias, lm_head, top_k, topk_ids, topk_logprobs):
    checks.check_one_device("medusa_topk", locals())
    return None


@torch.library.register_fake("specdec::skinny_linear")
def _skinny_linear_fake(x, weight, bias, out):
    checks.check_one_device("skinny_linear", locals())
    return None


# ---------------------------------------------------------------------------------------
# Linear layers on raw GGUF blocks: quantized_linear.
# ---------------------------------------------------------------------------------------

__all__ += ["quantized_linear", "GGUF_BLOCK_FORMATS"]

GGUF_BLOCK_FORMATS = checks.GGUF_BLOCK_FORMATS


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, block_type: int, bias: torch.Tensor | None = None, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with W [N, H] stored as raw GGUF blocks, streamed once for all rows.

    Args:
        x: [M, H] fp32/bf16/fp16 (widened to fp32); M <= 64 is the design point, any M works.
        weight: uint8 [N, H / block_size * block_bytes], contiguous: each row's GGUF blocks,
            as a GGUF file stores them (``gguf.ReaderTensor.data``; the file lists the
            shape reversed, [H, N]). See specdec_kernels.gguf_blocks.
        block_type: the GGML type id (``gguf.GGMLQuantizationType``): Q4_0 = 2, Q4_1 = 3,
            Q5_0 = 6, Q5_1 = 7, Q8_0 = 8 (blocks of 32 weights, H a multiple of 32), Q4_K = 12,
            Q5_K = 13, Q6_K = 14 (super-blocks of 256 weights, H a multiple of 256), F32 = 0,
            F16 = 1, BF16 = 30.
        bias: [N] fp32/bf16/fp16 or None.
        out: optional fp32 [M, N] destination, contiguous.

    Returns fp32 [M, N]. Every weight has exactly the value ``gguf.dequantize`` gives (Q4_0:
    d * (q - 8); Q4_1: d * q + m, rounded once; Q5_0: d * (q - 16); Q5_1: d * q + m; Q8_0:
    q * d; d, m the block's fp16 scales; Q4_K / Q5_K: (d * sc) * q - dmin * m, rounded once,
    sc, m the sub-block's 6-bit scale and min; Q6_K: (d * scale) * (q - 32), exact);
    accumulation is fp32, in one order that depends on H only: per output, 16 lane sums, lane
    l accumulating (fused multiply-add) x[k] * w[k] for k = 32c + l, then k = 32c + 16 + l,
    over the chunks c = 0, 1, ... of 32 weights (a K-quant super-block is 8 chunks; the float
    types' last chunk zero-padded); then
    the lanes summed as a tree (l + 8, + 4, + 2, + 1); then + bias. So a row's result is
    bit-identical whatever M is and whatever the other rows hold (batch invariance), on every
    CPU path (AVX-512, AVX2, portable). The Triton kernel (CUDA) sums in its own fixed order,
    the same for every row and M, equal to the CPU result within rounding.
    """
    checks.check_tensor(x, "x", dims=2)
    checks.check_tensor(weight, "weight", dims=2)
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)
    if not checks.launcher_checks(x.device):
        checks.check_quantized_linear(x, weight, block_type, bias, out)
    torch.ops.specdec.quantized_linear(x, weight, int(block_type), bias, out)
    return out


@torch.library.register_fake("specdec::quantized_linear")
def _quantized_linear_fake(x, weight, block_type, bias, out):
    checks.check_one_device("quantized_linear", locals())
    return None


__all__ += ["int8_activation_linear"]


def int8_activation_linear(x: torch.Tensor, packed_weight: torch.Tensor, block_type: int, N: int,
                           bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with x quantised to int8 (one scale per GGUF block) and integer dot
    products (llama.cpp's way), W [N, H] GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
    Q6_K) repacked 16 rows at a time.

    Args:
        x: [M, H] fp32/bf16/fp16, H a multiple of the block size (32; 256 for the K-quants).
        packed_weight: uint8 [ceil(N / 16), H / block size, record bytes] (Q4_0 288, Q4_1 320,
            Q5_0 352, Q5_1 384, Q8_0 544, Q4_K 2368, Q5_K 2880, Q6_K 3360), contiguous:
            ``gguf_blocks.pack_int8_activation(blocks, block_type)`` of the weight's GGUF blocks.
        block_type: GGML type id of the blocks: Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7,
            Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14.
        N: output features (the packing pads N to a multiple of 16).
        bias: [N] fp32/bf16/fp16 or None.
        out: optional fp32 [M, N] destination, contiguous.

    Returns fp32 [M, N]. Each activation block of A values (A = the GGUF block size: 256 for
    the K-quants, as llama.cpp's Q8_K; 32 otherwise, as its Q8_0) is quantised as d_x = max|x| /
    127, q = round_half_even(x / d_x) (x times fp32 1 / d_x); per 32, s_x = d_x * sum(q); a
    block with max|x| < 2^-96 counts as zero; a block holding NaN or inf makes its row's outputs
    NaN. Per output, over the GGUF blocks in order:
        I = the exact integer dot product of the weight integers and q: c = nibble - 8 (Q4_0),
            q5 - 16 (Q5_0), q (Q8_0), the unsigned integer (Q4_1, Q5_1); Q4_K / Q5_K: I = sum
            over the 8 sub-blocks of sc * (unsigned integers . q) (sc the 6-bit scale); Q6_K:
            I = sum over the 16 halves of sc * sum (q6_j - 32) q_j (sc the int8 scale);
        acc = fma(float(I), d_w * d_x, acc), d_w the block's fp16 d, d_w * d_x rounded to fp32;
        Q4_1 / Q5_1: acc = fma(m, s_x, acc); Q4_K / Q5_K: acc = fma(-float(Mn), dmin * d_x,
            acc), Mn = sum over sub-blocks of mn * sum(q) (mn the 6-bit min);
    then + bias. So a row's result is bit-identical whatever M and the other rows are, on
    every CPU path (AMX, AVX-512 VNNI, AVX2, portable); the Triton kernel (CUDA) computes the
    same integers and combines them in the same order (its FMAs may be contracted differently:
    equal within rounding). The result differs from ``quantized_linear`` by the activation
    rounding (relative error ~1e-3 of a typical output), as llama.cpp's does.
    """
    checks.check_tensor(x, "x", dims=2)
    if out is None:
        out = torch.empty((x.shape[0], N), dtype=torch.float32, device=x.device)
    if not checks.launcher_checks(x.device):
        checks.check_int8_activation_linear(x, packed_weight, block_type, bias, out)
    torch.ops.specdec.int8_activation_linear(x, packed_weight, int(block_type), bias, out)
    return out


@torch.library.register_fake("specdec::int8_activation_linear")
def _int8_activation_linear_fake(x, packed_weight, block_type, bias, out):
    checks.check_one_device("int8_activation_linear", locals())
    return None


# ---------------------------------------------------------------------------------------
# RMSNorm: rms_norm.
# ---------------------------------------------------------------------------------------

__all__ += ["rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, in one pass.

    x: [..., H] fp32/bf16/fp16; weight: [H] of x's dtype; eps >= 0; out: x's shape and
    dtype, contiguous, not sharing memory with x or the weight (allocated when None).
    Arithmetic in fp32: s = the sum of x_i^2 in 16 interleaved partial sums (lane i mod 16)
    combined pairwise (8, 4, 2, 1), r = 1 / sqrt(s / H + eps), out_i = x_i * r * w_i
    rounded once to x's dtype. A row's result depends on that row only (batch-invariant,
    the same at every thread count); the Triton kernel (CUDA) sums in its own order (equal
    within rounding). Returns out.
    """
    checks.check_tensor(x, "x")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not checks.launcher_checks(x.device):
        checks.check_rms_norm(x, weight, eps, out)
    torch.ops.specdec.rms_norm(x, weight, float(eps), out)
    return out


@torch.library.register_fake("specdec::rms_norm")
def _rms_norm_fake(x, weight, eps, out):
    checks.check_one_device("rms_norm", locals())
    return None


# ---------------------------------------------------------------------------------------
# The MLP activation: silu_and_mul.
# ---------------------------------------------------------------------------------------

__all__ += ["silu_and_mul"]


def silu_and_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = gate|up``, in one pass.

    gate_up: [..., 2I] fp32/bf16/fp16; out: [..., I] of gate_up's dtype, contiguous, not
    sharing memory with gate_up (allocated when None). Arithmetic in fp32 (CPU): e = exp(-g)
    by the package's own range reduction and polynomial (-g clamped to [-87.3, 88.9]; past
    exp's range e = inf and s = -0),
    s = g / (1 + e), out = s * u rounded once to out's dtype; every value's result depends on
    that value only (batch-invariant, the same at every thread count and on every CPU). The
    Triton kernel (CUDA) uses its own exp (equal within rounding). NaN propagates. Returns out.
    """
    checks.check_tensor(gate_up, "gate_up")
    if out is None:
        out = torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2) if gate_up.dim() else (),
                          dtype=gate_up.dtype, device=gate_up.device)
    if not checks.launcher_checks(gate_up.device):
        checks.check_silu_and_mul(gate_up, out)
    torch.ops.specdec.silu_and_mul(gate_up, out)
    return out


@torch.library.register_fake("specdec::silu_and_mul")
def _silu_and_mul_fake(gate_up, out):
    checks.check_one_device("silu_and_mul", locals())
    return None
