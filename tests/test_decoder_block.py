"""The one decoder block (``specdec_kernels.models.block``): each training twin (autograd,
``F.linear``) against the decode path (the model's linear, ``tree_attention`` over a paged
cache), for a Llama and a Qwen2 layer (q/k/v biases), in fp32; and the RoPE rotation against
the rotate-half formula, bit for bit."""

import pytest
import torch
import torch.nn.functional as F

from specdec_kernels.drafting.eagle.head import EagleHead
from specdec_kernels.kv_cache import PagedKVCache
from specdec_kernels.models import Llama, tiny_config
from specdec_kernels.models.block import DecoderBlock, apply_rope, causal_attention, paged_attention, rope_at, rope_tables
from specdec_kernels.models.llama import Batch, dense
from specdec_kernels.drafting.draft_model.training import DraftLM
from specdec_kernels.drafting.eagle.training import unrolled

ATOL = RTOL = 1e-5  # fp32: the same arithmetic, up to the order of the products' sums

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=[False, True], ids=["llama", "qwen2"])
def model(request):
    return Llama.random(tiny_config(num_layers=3, attention_bias=request.param), seed=0)


def decode_token_by_token(model: Llama, ids: torch.Tensor, num_layers=None) -> torch.Tensor:
    """Hidden states [S, H] of ``ids`` [S] from ``Llama.forward``, one token a step (the decode
    path: paged cache in blocks of 4, so the sequence spans blocks)."""
    cache = model.new_cache(1, ids.shape[0], block_size=4)
    slot = cache.add_request(0)
    out = []
    for p in range(ids.shape[0]):
        new = cache.append_slots([slot], [1])
        bt, pl = cache.batch_view([slot])
        out.append(model.forward(ids[p: p + 1], torch.tensor([p]), cache, Batch(bt, pl, new.qo_indptr, new.slot_mapping),
                                 num_layers=num_layers))
        cache.commit([slot], [1])
    return torch.cat(out)


def test_draft_twin_matches_the_decode_path(model):
    """DraftLM (the draft trainer's twin: batched, causal SDPA, F.linear) gives the hidden
    states and logits of decoding the same tokens with the plain-tensor Llama."""
    vocab = torch.arange(model.config.vocab_size)
    twin = DraftLM(model.config, model.layers, model.norm, dense(model.embed), dense(model.lm_head)[vocab].float())
    assert all(("bqkv" in L) == model.config.attention_bias for L in twin.layers)
    toks = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = twin(toks)
    for b in range(2):
        ref = model.logits(decode_token_by_token(model, toks[b]))
        torch.testing.assert_close(got[b], ref, atol=ATOL, rtol=RTOL)


def test_draft_twin_trains_every_weight(model):
    """The twin's block is differentiable in every layer weight, the bias included."""
    twin = DraftLM(model.config, model.layers[:1], model.norm, dense(model.embed), dense(model.lm_head).float())
    twin(torch.randint(0, model.config.vocab_size, (1, 6))).logsumexp(-1).sum().backward()
    for name, p in twin.named_parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), name


def test_autograd_block_matches_the_decode_block(model):
    """One layer, the same weights: the block with F.linear and causal SDPA over a batch of
    sequences equals the model's block (its linear, tree_attention over the paged cache)."""
    c = model.config
    S, H = 9, c.hidden_size
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(3))
    L = model.layers[1]
    twin = DecoderBlock.of(c, F.linear)
    rope = rope_at(*rope_tables(c, S), torch.arange(S))
    got = twin(L, x[None], rope, causal_attention)[0]
    cache = PagedKVCache(1, c.num_kv_heads, c.head_dim, num_blocks=4, block_size=4, max_batch=1, max_blocks_per_seq=4)
    slot = cache.add_request(0)
    new = cache.append_slots([slot], [S])
    bt, pl = cache.batch_view([slot])
    q, k, v = model.block.qkv(L, x, rope)
    ref = model.block.output(L, x, paged_attention(cache, 0, Batch(bt, pl, new.qo_indptr, new.slot_mapping), q, k, v))
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


def eagle_decode(head: EagleHead, feats: torch.Tensor, toks: torch.Tensor):
    """The EAGLE drafter's decode path over one sequence of true entries (feats [S, H], next
    tokens [S]), one entry a step: decode_inputs, decode_qkv, K/V written into a paged cache,
    tree_attention, decode_output -> (g [S, H], draft log-probs [S, Vd])."""
    S = feats.shape[0]
    cache = PagedKVCache(1, head.num_kv_heads, head.head_dim, num_blocks=4, block_size=4, max_batch=1,
                         max_blocks_per_seq=4)
    slot = cache.add_request(0)
    gs, lps = [], []
    for t in range(S):
        new = cache.append_slots([slot], [1])
        bt, pl = cache.batch_view([slot])
        x = head.decode_inputs(feats[t: t + 1], toks[t: t + 1])
        q, k, v = head.decode_qkv(x, torch.tensor([t]))
        attn = paged_attention(cache, 0, Batch(bt, pl, new.qo_indptr, new.slot_mapping), q, k, v)
        g, lp = head.decode_output(x, attn)
        cache.commit([slot], [1])
        gs.append(g)
        lps.append(lp)
    return torch.cat(gs), torch.cat(lps)


def test_eagle_trainer_matches_the_decode_path(model):
    """The EAGLE trainer's forward (``unrolled`` step 1: the head's F.linear block, causal
    SDPA, teacher-forced features) and its draft log-probs equal the drafter's decode path
    entry by entry; a Qwen2 target's head has (and uses) q/k/v biases."""
    torch.manual_seed(1)
    head = EagleHead.for_target(model, torch.arange(model.config.vocab_size)).eval().requires_grad_(False)
    assert hasattr(head, "bqkv") == model.config.attention_bias
    if model.config.attention_bias:
        assert torch.equal(head.bqkv, model.layers[-1]["bqkv"])
    S, H = 10, model.config.hidden_size
    g = torch.Generator().manual_seed(4)
    feats, toks = torch.randn(S, H, generator=g), torch.randint(0, model.config.vocab_size, (S,), generator=g)
    with torch.no_grad():
        (train_g,) = unrolled(head, feats[None], toks[None], 1)
        train_logp = head.logits(train_g[0]).log_softmax(-1)
    dec_g, dec_logp = eagle_decode(head, feats, toks)
    torch.testing.assert_close(train_g[0], dec_g, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(train_logp, dec_logp, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_the_rotate_half_formula_bit_for_bit(dtype):
    """apply_rope (roll, sign folded into the sin table) equals x*cos + cat(-x2, x1)*sin exactly."""
    c = tiny_config()
    cos, sin = rope_tables(c, 32)
    positions = torch.tensor([0, 3, 31, 7])
    x = torch.randn(4, c.num_heads + c.num_kv_heads, c.head_dim).to(dtype)
    half = c.head_dim // 2
    plain_sin = torch.cat([-sin[:, :half], sin[:, half:]], -1)  # the table without the folded sign
    ref_cos, ref_sin = cos[positions].to(dtype)[:, None], plain_sin[positions].to(dtype)[:, None]
    ref = x * ref_cos + torch.cat([-x[..., half:], x[..., :half]], -1) * ref_sin
    assert torch.equal(apply_rope(x, *rope_at(cos, sin, positions, dtype)), ref)
    assert torch.equal(plain_sin[:, :half], plain_sin[:, half:])  # rotate-half: both halves rotate by the same angle
