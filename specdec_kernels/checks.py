"""Argument checks of the ``torch.ops.specdec`` ops, in one place.

Every function here takes an op's arguments exactly as the op receives them (outputs
included, already allocated) and raises a ValueError that names the argument at fault and
what was expected. The checks read only shapes, dtypes, devices, strides and data
addresses (outputs must not share memory with inputs), never values, so they never
synchronise with the device; the data-dependent faults (a token id out of
range, a non-monotone ``qo_indptr``) are the kernels' own business, as are the C++ kernels'
checks of every argument (``csrc/check.h``), which guard their memory accesses for callers
of ``torch.ops.specdec.*`` and stay.

This module imports only torch: the wrappers (``specdec_kernels.ops``) and the Triton
launchers (``specdec_kernels.triton.*``) both import it, and neither imports the other.

Who checks, once per call path:

- ``torch.ops.specdec.<op>`` on CPU tensors: the C++ kernel (RuntimeError).
- ``torch.ops.specdec.<op>`` on CUDA tensors: the Triton launcher registered for the CUDA
  key calls ``check_<op>`` first (it is the kernel there, and a caller can reach it without
  any wrapper).
- the wrapper ``specdec_kernels.<op>``: converts what it accepts beyond the op (Python
  numbers, the other integer width, a batched tree mask), allocates the outputs, then calls
  ``check_<op>`` unless ``launcher_checks(device)`` says the op is about to dispatch to a
  launcher that calls it anyway (CUDA). So a wrapper call checks once on either device: on
  CUDA the launcher's check is the only one; on CPU the wrapper's ValueError comes before
  the C++ kernel's own guards. (The alternative, a wrapper that validates and then calls an
  unchecked launcher directly, would bypass the dispatcher: no torch.compile graph node, no
  profiler entry, no fake.) The wrappers read the sizes they allocate and broadcast with
  from one leading argument after ``check_tensor`` of its rank only; the full check of that
  argument is the op check's.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def launcher_checks(device: torch.device) -> bool:
    """True when ``torch.ops.specdec.*`` on tensors of ``device`` dispatches to a Triton
    launcher, which runs its op's check itself (so the wrapper does not run it too)."""
    return device.type == "cuda"


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
        raise ValueError(f"{name} must have {dims} dimensions, got shape {list(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def check_contiguous(t: torch.Tensor, name: str, what: str = "") -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous{what}")


def check_has_data(t: torch.Tensor, name: str) -> None:
    """Launchers only (the ops' checks accept meta tensors, which the wrappers pass on to the
    fakes): a kernel that reads and writes ``t`` needs its data, which a meta tensor has not
    (Triton would fail with a message naming no argument)."""
    if t.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor: there is no data for the kernel to work on")


# ---------------------------------------------------------------------------------------
# Memory shared by two arguments.
# ---------------------------------------------------------------------------------------


def _is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its elements fill [data_ptr, data_ptr + numel * itemsize)
    exactly, in some order of the dimensions (size-1 dimensions do not count)."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted((size, stride) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _memory(t):
    """(device, first byte, end byte, dense) of a tensor whose addresses can be compared: one
    with elements and data (not meta); else None."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.numel() == 0:
        return None
    start = t.data_ptr()
    return t.device, start, start + t.numel() * t.element_size(), _is_dense(t)


def _overlap(a, b) -> bool:
    return a[0] == b[0] and (a[1] == b[1] or (a[3] and b[3] and a[1] < b[2] and b[1] < a[2]))


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` certainly share memory, judged from their layouts (as
    ``at::get_overlap_status`` in the C++ kernels' ``csrc/check.h``): both hold data on one
    device, and they start at one address, or both are dense and their byte ranges
    intersect. Strided views that interleave may share no element (the layers of a
    layer-minor cache pool) and are not reported. Inside a torch.compile trace the tensors
    are fake and nothing is reported (the kernel or launcher that runs the op checks the
    real ones)."""
    if torch.compiler.is_compiling():
        return False
    ma, mb = _memory(a), _memory(b)
    return ma is not None and mb is not None and _overlap(ma, mb)


def check_outputs_apart(outputs, inputs) -> None:
    """Raise a ValueError naming both unless no output shares memory (``shares_memory``)
    with an input or with another output (``outputs``, ``inputs``: (tensor or None, name)
    pairs). The kernels read the inputs while they write the outputs, one after another: an
    output written over an input changes what is read next (the C++ kernels check the same:
    RuntimeError)."""
    if torch.compiler.is_compiling():
        return
    named = [(_memory(t), name) for t, name in (*outputs, *inputs)]
    for i in range(len(outputs)):
        out, out_name = named[i]
        if out is None:
            continue
        for other, other_name in named[i + 1:]:
            if other is not None and _overlap(out, other):
                raise ValueError(f"{out_name} must not share memory with {other_name} (the op reads or writes "
                                 f"{other_name} while it writes {out_name}): pass a separate tensor")


# ---------------------------------------------------------------------------------------
# Random numbers.
# ---------------------------------------------------------------------------------------


def check_philox_uniform(seed, offset) -> None:
    check_tensor(seed, "seed", dtype=torch.int64, dims=1)
    check_tensor(offset, "offset", dtype=torch.int64, shape=(seed.shape[0],), device=seed.device)


# ---------------------------------------------------------------------------------------
# Rejection sampling.
# ---------------------------------------------------------------------------------------

# Rejection sampling samples at temperatures T >= MIN_SAMPLING_TEMPERATURE (compared in fp32,
# where 2^-64 is exact); smaller ones, like 0, negative and NaN ones, are greedy: the limit of
# sampling as T -> 0. Sampling computes l / T in fp32, which overflows for |l| > 3.4e38 * T:
# at T = 1e-30 already for logits of 3.4e8, at 2^-64 only beyond 1.8e19; and at such a T the
# softmax of any two logits that differ is one-hot in fp32 unless they lie within ~1e-19.
# (Here, with the checks, because the wrappers, the Triton kernels and python_ref all read it;
# the C++ kernels have the same constant, kMinSamplingTemperature.)
MIN_SAMPLING_TEMPERATURE = 2.0**-64



def _check_sampling_inputs(target_logits, draft_probs, temperature, seed, offset, batch, rows, q_rows, device):
    check_tensor(target_logits, "target_logits", dtype=FLOAT_DTYPES, dims=3, device=device)
    vocab = target_logits.shape[2]
    check_tensor(target_logits, "target_logits", shape=(batch, rows, None))
    if vocab == 0:
        raise ValueError(f"target_logits must have a non-empty vocabulary dimension, got {list(target_logits.shape)}")
    if draft_probs is not None:
        check_tensor(draft_probs, "draft_probs", dtype=torch.float32, shape=(batch, q_rows, vocab), device=device)
    check_tensor(temperature, "temperature", dtype=torch.float32, shape=(batch,), device=device)
    check_tensor(seed, "seed", dtype=torch.int64, shape=(batch,), device=device)
    check_tensor(offset, "offset", dtype=torch.int64, shape=(batch,), device=device)


def _sampling_inputs(target_logits, draft_probs, temperature, seed, offset):
    return ((target_logits, "target_logits"), (draft_probs, "draft_probs"), (temperature, "temperature"),
            (seed, "seed"), (offset, "offset"))


def check_chain_rejection_sample(draft_token_ids, num_draft_tokens, target_logits, draft_probs, temperature, seed,
                                 offset, output_token_ids, num_accepted) -> None:
    check_tensor(draft_token_ids, "draft_token_ids", dtype=torch.int64, dims=2)
    batch, max_drafts = draft_token_ids.shape
    device = draft_token_ids.device
    check_tensor(num_draft_tokens, "num_draft_tokens", dtype=torch.int32, shape=(batch,), device=device)
    _check_sampling_inputs(target_logits, draft_probs, temperature, seed, offset, batch, max_drafts + 1, max_drafts,
                           device)
    check_tensor(output_token_ids, "output_token_ids", dtype=torch.int64, shape=(batch, max_drafts + 1), device=device)
    check_tensor(num_accepted, "num_accepted", dtype=torch.int32, shape=(batch,), device=device)
    check_outputs_apart(((output_token_ids, "output_token_ids"), (num_accepted, "num_accepted")),
                        ((draft_token_ids, "draft_token_ids"), (num_draft_tokens, "num_draft_tokens"),
                         *_sampling_inputs(target_logits, draft_probs, temperature, seed, offset)))


def check_chain_rejection_sample_flat(draft_token_ids, cu_num_draft_tokens, target_logits, draft_probs, temperature,
                                      seed, offset, output_token_ids, num_accepted) -> None:
    """The flattened ragged layout: drafts [T], cu_num_draft_tokens [B], target_logits
    [T + B, V], draft_probs [T, V]; K is output_token_ids' width [B, K + 1] minus one."""
    check_tensor(draft_token_ids, "draft_token_ids", dtype=torch.int64, dims=1)
    num_tokens = draft_token_ids.shape[0]
    device = draft_token_ids.device
    check_tensor(cu_num_draft_tokens, "cu_num_draft_tokens", dtype=torch.int32, dims=1, device=device)
    batch = cu_num_draft_tokens.shape[0]
    check_tensor(target_logits, "target_logits", dtype=FLOAT_DTYPES, dims=2, device=device)
    check_tensor(target_logits, "target_logits", shape=(num_tokens + batch, None))
    vocab = target_logits.shape[1]
    if vocab == 0:
        raise ValueError(f"target_logits must have a non-empty vocabulary dimension, got {list(target_logits.shape)}")
    if draft_probs is not None:
        check_tensor(draft_probs, "draft_probs", dtype=torch.float32, shape=(num_tokens, vocab), device=device)
    check_tensor(temperature, "temperature", dtype=torch.float32, shape=(batch,), device=device)
    check_tensor(seed, "seed", dtype=torch.int64, shape=(batch,), device=device)
    check_tensor(offset, "offset", dtype=torch.int64, shape=(batch,), device=device)
    check_tensor(output_token_ids, "output_token_ids", dtype=torch.int64, dims=2, device=device)
    if output_token_ids.shape[0] != batch or output_token_ids.shape[1] < 1:
        raise ValueError(f"output_token_ids must have shape [B = {batch}, K + 1] with K >= 0, got "
                         f"{list(output_token_ids.shape)}")
    check_tensor(num_accepted, "num_accepted", dtype=torch.int32, shape=(batch,), device=device)


def check_tree_rejection_sample(parents, tree_token_ids, num_nodes, target_logits, draft_probs, temperature, seed,
                                offset, accepted_nodes, output_token_ids, num_accepted) -> None:
    check_tensor(parents, "parents", dtype=torch.int32, dims=2)
    batch, max_nodes = parents.shape
    if max_nodes < 1:
        raise ValueError(f"parents must have at least one node per request, got shape {list(parents.shape)}")
    device = parents.device
    check_tensor(tree_token_ids, "tree_token_ids", dtype=torch.int64, shape=(batch, max_nodes), device=device)
    check_tensor(num_nodes, "num_nodes", dtype=torch.int32, shape=(batch,), device=device)
    _check_sampling_inputs(target_logits, draft_probs, temperature, seed, offset, batch, max_nodes, max_nodes, device)
    check_tensor(accepted_nodes, "accepted_nodes", dtype=torch.int32, shape=(batch, max_nodes - 1), device=device)
    check_tensor(output_token_ids, "output_token_ids", dtype=torch.int64, shape=(batch, max_nodes), device=device)
    check_tensor(num_accepted, "num_accepted", dtype=torch.int32, shape=(batch,), device=device)
    check_outputs_apart(((accepted_nodes, "accepted_nodes"), (output_token_ids, "output_token_ids"),
                         (num_accepted, "num_accepted")),
                        ((parents, "parents"), (tree_token_ids, "tree_token_ids"), (num_nodes, "num_nodes"),
                         *_sampling_inputs(target_logits, draft_probs, temperature, seed, offset)))


def check_apply_top_k_top_p(logits, top_k, top_p, min_p) -> None:
    """The op's form: logits [R, V] contiguous (modified in place), parameters [R] or None."""
    check_tensor(logits, "logits", dtype=FLOAT_DTYPES)
    if logits.dim() != 2 or not logits.is_contiguous():
        raise ValueError(f"logits must be a contiguous [R, V] tensor (the op works in place), got shape "
                         f"{list(logits.shape)} (contiguous: {logits.is_contiguous()})")
    rows = logits.shape[0]
    for t, name, dtype in ((top_k, "top_k", torch.int32), (top_p, "top_p", torch.float32),
                           (min_p, "min_p", torch.float32)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.dtype != dtype or tuple(t.shape) != (rows,) or t.device != logits.device:
            raise ValueError(f"{name} must be a {dtype} tensor of shape [{rows}] (one per row of logits) on "
                             f"{logits.device}, got {t.dtype} {list(t.shape)} on {t.device}")


# ---------------------------------------------------------------------------------------
# Tree attention.
# ---------------------------------------------------------------------------------------


def check_tree_attention(q, k_cache, v_cache, block_table, prefix_lens, qo_indptr, tree_mask, out, lse) -> None:
    """q [T, Hq, D] first: the other arguments are checked against its sizes, so a q in the
    wrong layout is reported as q's fault, not as a mismatch of the next argument."""
    check_tensor(q, "q", dtype=FLOAT_DTYPES, dims=3)
    T, Hq, D = q.shape
    dev = q.device
    check_tensor(k_cache, "k_cache", dtype=q.dtype, dims=4, device=dev)
    num_blocks, block_size, Hkv, k_dim = k_cache.shape
    if k_dim != D:  # either may be the wrong one: name both
        raise ValueError(f"q and k_cache must have the same head dimension D, got q [T, Hq, D] = {list(q.shape)} "
                         f"and k_cache [num_blocks, block_size, Hkv, D] = {list(k_cache.shape)}")
    check_tensor(v_cache, "v_cache", dtype=q.dtype, shape=tuple(k_cache.shape), device=dev)
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"q's number of heads ({Hq}, q is [T, Hq, D] = {list(q.shape)}) must be a multiple of "
                         f"k_cache's ({Hkv})")
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
        check_tensor(tree_mask, "tree_mask", dtype=torch.int64, dims=2, device=dev)
        rows = tree_mask.shape[0]
        if rows != T and q.shape[1] == rows:
            raise ValueError(f"q must have shape [T, Hq, D] with T = {rows} (the rows of tree_mask), got "
                             f"{list(q.shape)}: is it [Hq, T, D]? Pass q.transpose(0, 1)")
        if rows != T:
            raise ValueError(f"tree_mask must have shape [{T}, W] (one row per row of q, which is [T, Hq, D] = "
                             f"{list(q.shape)}), got {list(tree_mask.shape)}")
        if tree_mask.shape[1] < 1:
            raise ValueError(f"tree_mask must have at least one word per row, got shape {list(tree_mask.shape)}")
        check_contiguous(tree_mask, "tree_mask")
    check_tensor(out, "out", dtype=q.dtype, shape=tuple(q.shape), device=dev)
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous in its last dimension")
    if lse is not None:
        check_tensor(lse, "lse", dtype=torch.float32, shape=(T, Hq), device=dev)
        check_contiguous(lse, "lse")


# ---------------------------------------------------------------------------------------
# KV-cache compaction.
# ---------------------------------------------------------------------------------------


def _check_cache_lists(k_caches, v_caches) -> None:
    """Equal-length, non-empty lists of 4-d tensors of one shape, dtype, device and strides,
    contiguous in the last dim. One tuple comparison per layer when they are (~0.3 us per
    tensor); the per-attribute checks only to word the error."""
    for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
        if not isinstance(caches, (list, tuple)):
            raise ValueError(f"{name} must be a list of tensors (one per layer), got {type(caches).__name__}")
    if len(k_caches) == 0:
        raise ValueError("k_caches must hold at least one layer tensor, got an empty list")
    if len(k_caches) != len(v_caches):
        raise ValueError(f"k_caches and v_caches must have the same length, got {len(k_caches)} and {len(v_caches)}")
    first = k_caches[0]
    check_tensor(first, "k_caches[0]", dims=4)
    signature = (first.shape, first.stride(), first.dtype, first.device)
    for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
        for layer, t in enumerate(caches):
            if isinstance(t, torch.Tensor) and (t.shape, t.stride(), t.dtype, t.device) == signature:
                continue
            where = f"{name}[{layer}]"
            check_tensor(t, where, dtype=first.dtype, shape=tuple(first.shape), device=first.device)
            raise ValueError(f"{where} must have the strides of k_caches[0] {first.stride()}, got {t.stride()}")
    if first.stride(3) != 1:
        raise ValueError(f"k_caches/v_caches must be contiguous in head_dim (stride 1), got strides {first.stride()}")
    _check_caches_apart(k_caches, v_caches)


def _check_caches_apart(k_caches, v_caches) -> None:
    """Every layer's K and V must be memory of its own: a tensor given twice (k_caches[l] as
    v_caches[l], a layer twice, a view of another layer's memory) would have its rows moved
    twice (on CPU by two threads at once). The tensors share one layout here, so sorted by
    address each needs comparing with the next only (as ``shares_memory`` would: one start
    address, or dense byte ranges that intersect; the C++ kernel checks the same)."""
    if torch.compiler.is_compiling():
        return
    first = _memory(k_caches[0])
    if first is None:
        return
    _, start, end, dense = first
    nbytes = end - start if dense else 1
    # (address, i): i < L is k_caches[i], else v_caches[i - L] (named only on error).
    layers = len(k_caches)
    starts = sorted([(t.data_ptr(), i) for i, t in enumerate(k_caches)]
                    + [(t.data_ptr(), layers + i) for i, t in enumerate(v_caches)])
    for (address, i), (next_address, j) in zip(starts, starts[1:]):
        if next_address < address + nbytes:
            a, b = (f"k_caches[{n}]" if n < layers else f"v_caches[{n - layers}]" for n in (i, j))
            raise ValueError(f"{a} and {b} share memory: every layer's K and V must be a tensor of its own (its "
                             "rows would be moved twice)")


def check_compact_kv(k_caches, v_caches, block_table, prefix_lens, accepted_nodes, num_accepted) -> None:
    _check_cache_lists(k_caches, v_caches)
    device = k_caches[0].device
    check_tensor(block_table, "block_table", dtype=torch.int32, dims=2, device=device)
    batch = block_table.shape[0]
    check_tensor(prefix_lens, "prefix_lens", dtype=torch.int32, shape=(batch,), device=device)
    check_tensor(accepted_nodes, "accepted_nodes", dtype=torch.int32, shape=(batch, None), device=device)
    check_tensor(num_accepted, "num_accepted", dtype=torch.int32, shape=(batch,), device=device)


# ---------------------------------------------------------------------------------------
# Medusa heads and the skinny GEMM.
# ---------------------------------------------------------------------------------------


def check_skinny_linear(x, weight, bias, out) -> None:
    check_tensor(x, "x", dtype=FLOAT_DTYPES, dims=2)
    check_tensor(weight, "weight", dtype=FLOAT_DTYPES, dims=2, device=x.device)
    M, H = x.shape
    N = weight.shape[0]
    if weight.shape[1] != H:
        raise ValueError(f"weight must have shape [N, {H}] (x is [{M}, {H}]), got {list(weight.shape)}")
    check_contiguous(weight, "weight")
    if bias is not None:
        check_tensor(bias, "bias", dtype=FLOAT_DTYPES, shape=(N,), device=x.device)
    check_tensor(out, "out", dtype=x.dtype, shape=(M, N), device=x.device)
    check_contiguous(out, "out")
    # out over x (an in-place square layer) gave wrong rows: out is written while x is read.
    check_outputs_apart(((out, "out"),), ((x, "x"), (weight, "weight"), (bias, "bias")))


def check_rms_norm(x, weight, eps, out) -> None:
    check_tensor(x, "x", dtype=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    check_tensor(weight, "weight", dtype=x.dtype, shape=(x.shape[-1],), device=x.device)
    if not isinstance(eps, (int, float)) or not -float("inf") < eps < float("inf") or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    check_tensor(out, "out", dtype=x.dtype, shape=tuple(x.shape), device=x.device)
    check_contiguous(out, "out")
    check_outputs_apart(((out, "out"),), ((x, "x"), (weight, "weight")))


def check_silu_and_mul(gate_up, out) -> None:
    check_tensor(gate_up, "gate_up", dtype=FLOAT_DTYPES)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2I] (gate|up, an even last dim), got shape {list(gate_up.shape)}")
    check_tensor(out, "out", dtype=gate_up.dtype, shape=(*gate_up.shape[:-1], gate_up.shape[-1] // 2),
                 device=gate_up.device)
    check_contiguous(out, "out")
    check_outputs_apart(((out, "out"),), ((gate_up, "gate_up"),))


def check_medusa_topk(hidden, res_weight, res_bias, lm_head, top_k, topk_ids, topk_logprobs) -> None:
    check_tensor(hidden, "hidden", dtype=FLOAT_DTYPES, dims=2)
    M, H = hidden.shape
    dev = hidden.device
    check_tensor(res_weight, "res_weight", dtype=FLOAT_DTYPES, dims=4, device=dev)
    K, L = res_weight.shape[0], res_weight.shape[1]
    if K < 1:
        raise ValueError(f"res_weight must have at least one head (K >= 1), got shape {list(res_weight.shape)}")
    check_tensor(res_weight, "res_weight", shape=(K, L, H, H))
    check_tensor(res_bias, "res_bias", dtype=FLOAT_DTYPES, shape=(K, L, H), device=dev)
    check_tensor(lm_head, "lm_head", dtype=FLOAT_DTYPES, device=dev)
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
        check_contiguous(t, name)
    for t, name, dtype in ((topk_ids, "topk_ids", torch.int64), (topk_logprobs, "topk_logprobs", torch.float32)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype or tuple(t.shape) != (M, K, top_k) or not t.is_contiguous() or t.device != dev:
            raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape [{M}, {K}, {top_k}] on {dev}, "
                             f"got {t.dtype} {list(t.shape)} on {t.device} (contiguous: {t.is_contiguous()})")


def check_one_device(op: str, args: dict) -> None:
    """Raise a ValueError unless every tensor argument of ``op`` (lists included) is on one
    device. The fakes below are also the ops' Meta kernels: a call through ``torch.ops``
    with one meta tensor among CPU tensors dispatches to them, and would otherwise return
    without writing anything."""
    devices = {}
    for name, value in args.items():
        for i, t in enumerate(value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(t, torch.Tensor):
                devices.setdefault(t.device, f"{name}[{i}]" if isinstance(value, (list, tuple)) else name)
    if len(devices) > 1:
        got = ", ".join(f"{name} on {device}" for device, name in devices.items())
        raise ValueError(f"{op}: every tensor argument must be on one device, got {got}")


# The weight formats quantized_linear reads: GGML type id (gguf.GGMLQuantizationType) ->
# (name, weights per block, bytes per block). The same table is in csrc/cpu/gguf_blocks.h;
# ops.GGUF_BLOCK_FORMATS and specdec_kernels.gguf_blocks build on it (quantize, dequantize, QuantizedWeight).
# The K-quants (Q4_K, Q5_K, Q6_K) are super-blocks of 256 weights.
GGUF_BLOCK_FORMATS = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}


def gguf_block_types_text() -> str:
    """'F32 = 0, F16 = 1, ...': the block types quantized_linear reads, for error messages."""
    return ", ".join(f"{name} = {tid}" for tid, (name, _, _) in GGUF_BLOCK_FORMATS.items())


def check_quantized_linear(x, weight, block_type, bias, out) -> None:
    if isinstance(block_type, bool) or not isinstance(block_type, int) or block_type not in GGUF_BLOCK_FORMATS:
        raise ValueError(f"block_type must be a GGML type id among {gguf_block_types_text()}, got {block_type!r}")
    name, size, nbytes = GGUF_BLOCK_FORMATS[int(block_type)]
    check_tensor(x, "x", dtype=FLOAT_DTYPES, dims=2)
    M, H = x.shape
    if H % size != 0:
        raise ValueError(f"x.shape[1] (H = {H}) must be a multiple of the {name} block size {size}")
    check_tensor(weight, "weight", dtype=torch.uint8, dims=2, device=x.device)
    N = weight.shape[0]
    row_bytes = H // size * nbytes
    if weight.shape[1] != row_bytes:
        raise ValueError(f"weight must have shape [N, {row_bytes}] ({H // size} {name} blocks of {nbytes} bytes per "
                         f"row, x is [{M}, {H}]), got {list(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if bias is not None:
        check_tensor(bias, "bias", dtype=FLOAT_DTYPES, shape=(N,), device=x.device)
    check_tensor(out, "out", dtype=torch.float32, shape=(M, N), device=x.device)
    check_contiguous(out, "out")


# int8_activation_linear's block types: GGML type id -> (name, weights per GGUF block, bytes per GGUF
# block, bytes of one packed record: that block of 16 rows, repacked; csrc/cpu/int8_activation_linear.h).
# Kept apart from GGUF_BLOCK_FORMATS (the formats quantized_linear reads).
INT8_ACTIVATION_FORMATS = {
    2: ("Q4_0", 32, 18, 32 + 256),
    3: ("Q4_1", 32, 20, 64 + 256),
    6: ("Q5_0", 32, 22, 32 + 256 + 64),
    7: ("Q5_1", 32, 24, 64 + 256 + 64),
    8: ("Q8_0", 32, 34, 32 + 512),
    12: ("Q4_K", 256, 144, 64 + 256 + 8 * 256),
    13: ("Q5_K", 256, 176, 64 + 256 + 8 * (256 + 64)),
    14: ("Q6_K", 256, 210, 32 + 256 + 8 * (256 + 128)),
}
INT8_ACTIVATION_GROUP_BYTES = {tid: f[3] for tid, f in INT8_ACTIVATION_FORMATS.items()}
INT8_ACTIVATION_GROUP_ROWS = 16


def int8_activation_types_text() -> str:
    """'Q4_0 = 2, Q4_1 = 3, ...': the block types int8_activation_linear reads, for error messages."""
    return ", ".join(f"{name} = {tid}" for tid, (name, *_) in INT8_ACTIVATION_FORMATS.items())


def check_int8_activation_linear(x, packed_weight, block_type, bias, out) -> None:
    if isinstance(block_type, bool) or not isinstance(block_type, int) or block_type not in INT8_ACTIVATION_FORMATS:
        raise ValueError(f"block_type must be one of {int8_activation_types_text()}, got {block_type!r}")
    check_tensor(x, "x", dtype=FLOAT_DTYPES, dims=2)
    M, H = x.shape
    name, size, _, bb = INT8_ACTIVATION_FORMATS[block_type]
    check_tensor(packed_weight, "packed_weight", dtype=torch.uint8, dims=3, device=x.device)
    G = packed_weight.shape[0]
    if H % size != 0 or tuple(packed_weight.shape[1:]) != (H // size, bb):
        raise ValueError(f"packed_weight must have shape [ceil(N / 16), {H // size}, {bb}] (x is [{M}, {H}], H a "
                         f"multiple of the {name} block size {size}), got {list(packed_weight.shape)}")
    if not packed_weight.is_contiguous():
        raise ValueError("packed_weight must be contiguous")
    check_tensor(out, "out", dtype=torch.float32, dims=2, device=x.device)
    N = out.shape[1]
    rows = INT8_ACTIVATION_GROUP_ROWS
    if out.shape[0] != M or not (G - 1) * rows < N <= G * rows:
        raise ValueError(f"out must have shape [{M}, N] with ceil(N / 16) = {G} (packed_weight is "
                         f"{list(packed_weight.shape)}), got {list(out.shape)}")
    check_contiguous(out, "out")
    if bias is not None:
        check_tensor(bias, "bias", dtype=FLOAT_DTYPES, shape=(N,), device=x.device)
