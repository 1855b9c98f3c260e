"""The Python API a new user meets: the typed wrappers take Python numbers, either integer
width for index tensors, sensible defaults and tree.tree_mask's batched mask; errors name
the argument at fault; the package namespace is the API and lists its ops."""
import subprocess
import sys

import pytest
import torch

import specdec_kernels
from specdec_kernels import tree

i16, i32, i64 = torch.int16, torch.int32, torch.int64


def _tree_batch(vocab=32, seed=0):
    """Two requests: a 5-node tree and a 3-node chain, N = 5 node slots."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.tensor([[-1, 0, 0, 1, 1], [-1, 0, 1, -1, -1]], dtype=i32)
    num_nodes = torch.tensor([5, 3], dtype=i32)
    tokens = torch.randint(0, vocab, (2, 5), generator=gen)
    logits = torch.randn(2, 5, vocab, generator=gen) * 3
    return parents, tokens, num_nodes, logits


def _chain_batch(vocab=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.randint(0, vocab, (3, 4), generator=gen)
    num_drafts = torch.tensor([4, 2, 0], dtype=i32)
    logits = torch.randn(3, 5, vocab, generator=gen) * 3
    return drafts, num_drafts, logits


def _same(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------
# Python numbers for per-request parameters.
# ---------------------------------------------------------------------------------------


def test_rejection_samplers_take_python_numbers():
    parents, tokens, num_nodes, logits = _tree_batch()
    as_tensors = specdec_kernels.tree_rejection_sample(
        parents, tokens, num_nodes, logits, None, torch.full((2,), 0.7), torch.full((2,), 11, dtype=i64),
        torch.full((2,), 5, dtype=i64))
    _same(specdec_kernels.tree_rejection_sample(parents, tokens, num_nodes, logits, None, 0.7, 11, 5), as_tensors)
    drafts, num_drafts, clogits = _chain_batch()
    as_tensors = specdec_kernels.chain_rejection_sample(
        drafts, num_drafts, clogits, None, torch.zeros(3), torch.full((3,), 3, dtype=i64), torch.zeros(3, dtype=i64))
    _same(specdec_kernels.chain_rejection_sample(drafts, num_drafts, clogits, None, 0, 3, 0), as_tensors)


def test_numbers_are_broadcast_on_the_device_of_the_tensors():
    # On meta tensors (the fake kernels run): a number made on another device would fail
    # the device check.
    parents, tokens, num_nodes, logits = (t.to("meta") for t in _tree_batch())
    accepted, out, count = specdec_kernels.tree_rejection_sample(parents, tokens, num_nodes, logits, None, 1.0, 3, 0)
    assert accepted.device.type == out.device.type == count.device.type == "meta"
    masked = specdec_kernels.apply_top_k_top_p(torch.randn(2, 3, 8, device="meta"), 4, 0.9, 0.05)
    assert masked.device.type == "meta"


@pytest.mark.parametrize("shape", [(6, 40), (2, 3, 40)])
def test_top_k_top_p_take_python_numbers(shape):
    logits = torch.randn(*shape)
    rows = logits.numel() // shape[-1]
    expected = specdec_kernels.apply_top_k_top_p(
        logits.view(rows, shape[-1]).clone(), torch.full((rows,), 7, dtype=i32), torch.full((rows,), 0.8),
        torch.full((rows,), 0.01))
    got = specdec_kernels.apply_top_k_top_p(logits, top_k=7, top_p=0.8, min_p=0.01, inplace=False)
    assert torch.equal(got.view(rows, shape[-1]), expected)
    assert (got.isneginf().sum(-1) >= shape[-1] - 7).all(), "top_k=7 masked nothing"


def test_bools_are_not_numbers():
    parents, tokens, num_nodes, logits = _tree_batch()
    with pytest.raises(ValueError, match="temperature must be a torch.Tensor"):
        specdec_kernels.tree_rejection_sample(parents, tokens, num_nodes, logits, None, True)


# ---------------------------------------------------------------------------------------
# Either integer width for index tensors (the raw ops stay strict).
# ---------------------------------------------------------------------------------------


def _other_width(t):
    return t.to(i64 if t.dtype == i32 else i32)


def test_rejection_samplers_take_either_index_width():
    parents, tokens, num_nodes, logits = _tree_batch()
    expected = specdec_kernels.tree_rejection_sample(parents, tokens, num_nodes, logits, None, 1.0, 7)
    got = specdec_kernels.tree_rejection_sample(_other_width(parents), _other_width(tokens), _other_width(num_nodes),
                                                logits, None, 1.0, 7)
    _same(got, expected)
    drafts, num_drafts, clogits = _chain_batch()
    expected = specdec_kernels.chain_rejection_sample(drafts, num_drafts, clogits, None, 1.0, 7)
    _same(specdec_kernels.chain_rejection_sample(_other_width(drafts), _other_width(num_drafts), clogits, None, 1.0,
                                                 7), expected)
    with pytest.raises(RuntimeError, match="parents"):
        torch.ops.specdec.tree_rejection_sample(
            parents.long(), tokens, num_nodes, logits, None, torch.ones(2), torch.zeros(2, dtype=i64),
            torch.zeros(2, dtype=i64), torch.empty(2, 4, dtype=i32), torch.empty(2, 5, dtype=i64),
            torch.empty(2, dtype=i32))


def test_top_k_takes_int64():
    logits = torch.randn(4, 16)
    top_k = torch.tensor([1, 2, 3, 0])
    expected = specdec_kernels.apply_top_k_top_p(logits.clone(), top_k.to(i32))
    assert torch.equal(specdec_kernels.apply_top_k_top_p(logits.clone(), top_k), expected)
    with pytest.raises(RuntimeError, match="top_k"):
        torch.ops.specdec.apply_top_k_top_p(logits.clone(), top_k, None, None)


def _attention_case(seed=0):
    """Requests of 5 and 3 nodes (a tree and a chain) over a paged cache, prefixes 6 and 2."""
    gen = torch.Generator().manual_seed(seed)
    parents, _, num_nodes, _ = _tree_batch()
    built = tree.build_tree(parents, num_nodes)
    block_size, Hq, Hkv, D = 4, 4, 2, 16
    k_cache = torch.randn(8, block_size, Hkv, D, generator=gen)
    v_cache = torch.randn(8, block_size, Hkv, D, generator=gen)
    block_table = torch.tensor([[3, 0, 5], [1, 6, -1]], dtype=i32)
    prefix_lens = torch.tensor([6, 2], dtype=i32)
    q = torch.randn(8, Hq, D, generator=gen)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, prefix_lens=prefix_lens,
                num_nodes=num_nodes, batched_mask=built.tree_mask, qo_indptr=built.qo_indptr())


def test_attention_and_compaction_take_either_index_width():
    c = _attention_case()
    ragged = tree.tree_mask_ragged(c["batched_mask"], c["qo_indptr"], 8)
    base = (c["q"], c["k_cache"], c["v_cache"])
    expected = specdec_kernels.tree_attention(*base, c["block_table"], c["prefix_lens"], c["qo_indptr"], ragged)
    # qo_indptr as torch.cumsum gives it (int64), block table and prefix lengths as int64
    qo_indptr = torch.cat([torch.zeros(1, dtype=i64), torch.cumsum(c["num_nodes"], 0)])
    assert qo_indptr.dtype == i64
    got = specdec_kernels.tree_attention(*base, c["block_table"].long(), c["prefix_lens"].long(), qo_indptr, ragged)
    assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="qo_indptr"):
        torch.ops.specdec.tree_attention(*base, c["block_table"], c["prefix_lens"], qo_indptr, ragged, 0.25,
                                         torch.empty_like(c["q"]), None)

    caches = [[t.clone() for t in (c["k_cache"], c["k_cache"])], [t.clone() for t in (c["v_cache"], c["v_cache"])]]
    moved = [[t.clone() for t in layer] for layer in caches]
    accepted, counts = torch.tensor([[1, 3, -1, -1], [1, 2, -1, -1]], dtype=i32), torch.tensor([2, 2], dtype=i32)
    specdec_kernels.compact_kv(*caches, c["block_table"], c["prefix_lens"], accepted, counts)
    specdec_kernels.compact_kv(*moved, c["block_table"].long(), c["prefix_lens"].long(), accepted.long(),
                               counts.long())
    assert all(torch.equal(a, b) for a, b in zip(caches[0] + caches[1], moved[0] + moved[1]))
    assert not torch.equal(caches[0][0], c["k_cache"]), "nothing was moved"


def _step(c, parents, tokens, logits):
    """One verification step through the wrappers with int64 index tensors, an int32 token
    tensor, Python numbers and the batched mask."""
    def step(q, block_table, prefix_lens, num_nodes_i64, batched_mask, parents_i64, tokens_i32, logits):
        attn = specdec_kernels.tree_attention(q, c["k_cache"].to(q.device), c["v_cache"].to(q.device), block_table,
                                              prefix_lens, tree_mask=batched_mask, num_nodes=num_nodes_i64)
        sampled = specdec_kernels.tree_rejection_sample(parents_i64, tokens_i32, num_nodes_i64, logits, None, 0.8,
                                                        5, 2)
        return attn, sampled
    return step


def _step_args(c, parents, tokens, num_nodes, logits, device):
    return tuple(t.to(device) for t in (c["q"], c["block_table"].long(), c["prefix_lens"].long(), num_nodes.long(),
                                        c["batched_mask"], parents.long(), tokens.int(), logits))


def test_conversions_read_no_values():
    # Meta tensors have no values: any host read (.item(), .tolist(), a data-dependent
    # shape) in the casts, broadcasts or mask conversion would raise here.
    c = _attention_case()
    parents, tokens, num_nodes, logits = _tree_batch()
    attn, (accepted, out, count) = _step(c, parents, tokens, logits)(
        *_step_args(c, parents, tokens, num_nodes, logits, "meta"))
    assert attn.shape == (8, 4, 16) and attn.device.type == "meta"
    assert accepted.shape == (2, 4) and count.device.type == "meta"


def test_conversions_trace_with_torch_compile_fullgraph():
    c = _attention_case()
    parents, tokens, num_nodes, logits = _tree_batch()
    step = _step(c, parents, tokens, logits)
    args = _step_args(c, parents, tokens, num_nodes, logits, "cpu")
    got, expected = torch.compile(step, fullgraph=True, backend="eager")(*args), step(*args)
    assert torch.equal(got[0], expected[0])
    _same(got[1], expected[1])


# ---------------------------------------------------------------------------------------
# Defaults: draft_probs=None, temperature=1.0, seed from torch's generator, offset=0.
# ---------------------------------------------------------------------------------------


def test_sampler_defaults():
    parents, tokens, num_nodes, logits = _tree_batch()
    explicit = specdec_kernels.tree_rejection_sample(parents, tokens, num_nodes, logits, None, 1.0, 42, 0)
    _same(specdec_kernels.tree_rejection_sample(parents, tokens, num_nodes, logits, seed=42), explicit)
    drafts, num_drafts, clogits = _chain_batch()
    explicit = specdec_kernels.chain_rejection_sample(drafts, num_drafts, clogits, None, 1.0, 42, 0)
    _same(specdec_kernels.chain_rejection_sample(drafts, num_drafts, clogits, seed=42), explicit)


def test_default_seed_follows_torch_manual_seed():
    drafts, num_drafts, logits = _chain_batch(vocab=1000)
    logits = torch.zeros_like(logits)  # uniform: the emitted tokens are all random
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        runs.append(specdec_kernels.chain_rejection_sample(drafts, num_drafts, logits)[0])
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


# ---------------------------------------------------------------------------------------
# tree_attention: the batched mask of tree.tree_mask, num_nodes instead of qo_indptr.
# ---------------------------------------------------------------------------------------


def test_tree_attention_takes_the_batched_mask():
    c = _attention_case()
    base = (c["q"], c["k_cache"], c["v_cache"], c["block_table"], c["prefix_lens"])
    ragged = tree.tree_mask_ragged(c["batched_mask"], c["qo_indptr"], 8)
    expected, expected_lse = specdec_kernels.tree_attention(*base, c["qo_indptr"], ragged, return_lse=True)
    for kwargs in (dict(qo_indptr=c["qo_indptr"]), dict(num_nodes=c["num_nodes"])):
        out, lse = specdec_kernels.tree_attention(*base, tree_mask=c["batched_mask"], return_lse=True, **kwargs)
        assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    # The tree matters: with the causal default the tree request attends differently.
    assert not torch.equal(specdec_kernels.tree_attention(*base, num_nodes=c["num_nodes"]), expected)


def test_tree_attention_index_argument_errors():
    c = _attention_case()
    base = (c["q"], c["k_cache"], c["v_cache"], c["block_table"], c["prefix_lens"])
    with pytest.raises(ValueError, match="qo_indptr or num_nodes, not both"):
        specdec_kernels.tree_attention(*base, c["qo_indptr"], num_nodes=c["num_nodes"])
    with pytest.raises(ValueError, match=r"needs qo_indptr \(int32 \[B \+ 1\]\) or num_nodes"):
        specdec_kernels.tree_attention(*base)
    with pytest.raises(ValueError, match=r"num_nodes must have shape \[2\]"):
        specdec_kernels.tree_attention(*base, num_nodes=c["num_nodes"][:1])
    with pytest.raises(ValueError, match=r"tree_mask \[B, N, W\] must have one row block per request, B = 2"):
        specdec_kernels.tree_attention(*base, c["qo_indptr"], c["batched_mask"][:1])


# ---------------------------------------------------------------------------------------
# Shape errors name the argument at fault.
# ---------------------------------------------------------------------------------------


def test_q_in_head_major_layout_is_reported_as_q():
    c = _attention_case()
    ragged = tree.tree_mask_ragged(c["batched_mask"], c["qo_indptr"], 8)
    q_head_major = c["q"].transpose(0, 1).contiguous()  # [Hq, T, D] = [4, 8, 16]
    with pytest.raises(ValueError, match=r"q must have shape \[T, Hq, D\] with T = 8 .*\[4, 8, 16\].*transpose"):
        specdec_kernels.tree_attention(q_head_major, c["k_cache"], c["v_cache"], c["block_table"], c["prefix_lens"],
                                       c["qo_indptr"], ragged)
    # As the hint says, the transposed view is accepted (only the last dim must be contiguous).
    expected = specdec_kernels.tree_attention(c["q"], c["k_cache"], c["v_cache"], c["block_table"], c["prefix_lens"],
                                              c["qo_indptr"], ragged)
    got = specdec_kernels.tree_attention(q_head_major.transpose(0, 1), c["k_cache"], c["v_cache"], c["block_table"],
                                         c["prefix_lens"], c["qo_indptr"], ragged)
    assert torch.equal(got, expected)


def test_mask_with_too_few_rows_is_reported_as_tree_mask():
    c = _attention_case()
    ragged = tree.tree_mask_ragged(c["batched_mask"], c["qo_indptr"], 8)
    with pytest.raises(ValueError, match=r"tree_mask must have shape \[8, W\]"):
        specdec_kernels.tree_attention(c["q"], c["k_cache"], c["v_cache"], c["block_table"], c["prefix_lens"],
                                       c["qo_indptr"], ragged[:5])


def test_too_few_query_rows_name_q_and_the_node_count():
    """With num_nodes the caller never saw a qo_indptr: the message is about q's rows."""
    c = _attention_case()
    says = r"q must have a row for every node: the requests have 8 nodes in all .*num_nodes.* has T = 6 rows"
    with pytest.raises(RuntimeError, match=says):
        specdec_kernels.tree_attention(c["q"][:6], c["k_cache"], c["v_cache"], c["block_table"], c["prefix_lens"],
                                       num_nodes=c["num_nodes"])


@pytest.mark.parametrize("raw", [False, True], ids=["wrapper", "torch.ops"])
def test_head_dim_mismatch_names_q_and_k_cache(raw):
    """Either may be the wrong one: a q of head dimension 32 over a cache of 16 names both."""
    c = _attention_case()
    q = torch.randn(8, 4, 32)
    says = r"q and k_cache must have the same head dimension D, got q \[T, Hq, D\] = \[8, 4, 32\] and k_cache"
    if raw:
        with pytest.raises(RuntimeError, match=says):
            torch.ops.specdec.tree_attention(q, c["k_cache"], c["v_cache"], c["block_table"], c["prefix_lens"],
                                             c["qo_indptr"], None, 0.25, torch.empty_like(q), None)
    else:
        with pytest.raises(ValueError, match=says):
            specdec_kernels.tree_attention(q, c["k_cache"], c["v_cache"], c["block_table"], c["prefix_lens"],
                                           c["qo_indptr"])


def test_an_index_tensor_of_another_dtype_names_both_widths():
    """The wrappers take int32 or int64: a float count says so (the raw op takes int32 only)."""
    drafts, num_drafts, logits = _chain_batch()
    with pytest.raises(ValueError, match=r"num_draft_tokens must have dtype torch.int32 or torch.int64, "
                                         r"got torch.float32"):
        specdec_kernels.chain_rejection_sample(drafts, num_drafts.float(), logits, temperature=0.0)
    with pytest.raises(ValueError, match=r"draft_token_ids must have dtype torch.int64 or torch.int32, got torch.float32"):
        specdec_kernels.chain_rejection_sample(drafts.float(), num_drafts, logits, temperature=0.0)
    parents, tokens, num_nodes, tlogits = _tree_batch()
    with pytest.raises(ValueError, match=r"num_nodes must have dtype torch.int32 or torch.int64, got torch.bool"):
        specdec_kernels.tree_rejection_sample(parents, tokens, num_nodes.bool(), tlogits, temperature=0.0)


# ---------------------------------------------------------------------------------------
# The namespace: the API only, __all__, the op listing.
# ---------------------------------------------------------------------------------------


def test_namespace_is_the_api():
    public = {name for name in dir(specdec_kernels) if not name.startswith("_")}
    assert not public & {"os", "platform", "importlib", "torch", "weakref"}
    for name in specdec_kernels.__all__:
        assert hasattr(specdec_kernels, name), name
    assert set(specdec_kernels.ops.__all__) <= set(specdec_kernels.__all__)
    assert {"list_ops", "tree_attention", "tree_rejection_sample", "compact_kv"} <= set(specdec_kernels.__all__)


def test_list_ops_and_torch_ops_namespace_after_import():
    expected = ["apply_top_k_top_p", "chain_rejection_sample", "chain_rejection_sample_flat", "compact_kv",
                "int8_activation_linear", "medusa_topk", "philox_uniform", "quantized_linear", "rms_norm", "silu_and_mul", "skinny_linear",
                "tree_attention", "tree_rejection_sample"]
    assert specdec_kernels.list_ops() == expected
    # In a fresh interpreter, before any op is called: dir(torch.ops.specdec) lists them all.
    code = ("import specdec_kernels, torch; "
            "print(' '.join(n for n in dir(torch.ops.specdec) if n in specdec_kernels.list_ops()))")
    listed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert listed == expected
