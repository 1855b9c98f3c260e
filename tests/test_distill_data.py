"""Self-distillation data (``training/distill_data.py``): greedy and sampled answers, the
cache key that keeps them apart, determinism of sampled data, and the combined data set the
trainers load."""
import argparse

import pytest
import torch

from specdec_kernels.models import Llama, tiny_config
from specdec_kernels.training import distill_data


class _Tok:
    """The tokenizer methods the data pipeline calls: a prompt string -> token ids, the start
    of a user turn (for prompts the model writes) and ids -> text."""

    def chat_prompt(self, text):
        return [1 + (ord(c) % 60) for c in text[:12]]

    def user_turn_prefix(self, opener=""):
        return [61, 62] + [1 + (ord(c) % 60) for c in opener[:8]]

    def encode(self, text):
        return [1 + (ord(c) % 60) for c in text]

    def decode(self, ids):
        return "".join(chr(ord("a") + t % 26) for t in ids)


PROMPTS = [{"prompt": f"prompt number {i} about {w}", "category": "qa"} for i, w in enumerate(["cats", "rain", "maps", "tea"])]


@pytest.fixture(scope="module")
def model():
    return Llama.random(tiny_config(num_layers=2), seed=0)


def _data(model, tmp_path, temperature, regenerate=False):
    return distill_data.load_or_generate(model, _Tok(), len(PROMPTS), model_name="tiny", max_new_tokens=10,
                                         layers=(1, 2), topk=4, shard_size=2, cache_dir=tmp_path,
                                         prompts=PROMPTS, temperature=temperature, regenerate=regenerate,
                                         progress=False)


def _answers(data):
    st, pl = data["seq_start"], data["prompt_len"]
    return [data["tokens"][int(st[s]) + int(pl[s]): int(st[s + 1])].tolist() for s in range(len(pl))]


def test_sampled_answers_are_cached_apart_and_reproducible(model, tmp_path):
    greedy = _data(model, tmp_path, 0.0)
    sampled = _data(model, tmp_path, 1.0)
    dirs = sorted(p.name for p in tmp_path.joinpath("tiny").iterdir())
    assert len(dirs) == 2 and any("_T1_" in d for d in dirs)
    assert _answers(greedy) != _answers(sampled)  # a random model's argmax chains vs draws at T = 1
    again = _data(model, tmp_path, 1.0, regenerate=True)  # generated anew: the same seeded draws
    assert torch.equal(again["tokens"], sampled["tokens"])
    for d in (greedy, sampled):  # features and top-k rows for every position
        n = d["tokens"].shape[0]
        assert d["features"].shape == (2, n, model.config.hidden_size) and d["topk_ids"].shape == (n, 4)
    # The top-k labels are the target's own distribution at every position, sampled or not.
    st = sampled["seq_start"]
    seq = sampled["tokens"][int(st[0]): int(st[1])]
    ref = distill_data.teacher_forced(model, [seq.tolist()], (2,), 4)
    assert torch.equal(ref["topk_ids"], sampled["topk_ids"][int(st[0]): int(st[1])])


def test_training_data_joins_greedy_and_sampled_sets(model, tmp_path, monkeypatch):
    from specdec_kernels.training import prompts

    monkeypatch.setattr(prompts, "synthetic_prompts", lambda n, seed=0: PROMPTS[seed: seed + n])
    args = argparse.Namespace(model="tiny", max_new_tokens=6, topk=4, shard_size=2, cache_dir=str(tmp_path),
                              num_prompts=3, sampled_prompts=2, answer_temperature=0.8, written_prompts=3, seed=0,
                              corpus_tokens=0)
    data = distill_data.load_training_data(model, _Tok(), args)
    assert data["seq_start"].shape[0] - 1 == 8 and data["prompt_len"].shape[0] == 8
    assert sum(c.startswith("written:") for c in data["category"]) == 3
    assert data["features"].shape[1] == data["tokens"].shape[0] == int(data["seq_start"][-1])
    args.answer_temperature = 0.0
    with pytest.raises(ValueError, match="answer-temperature"):
        distill_data.load_training_data(model, _Tok(), args)


def test_written_prompts_are_seeded_cached_and_answered(model, tmp_path):
    kw = dict(model_name="tiny", max_new_tokens=5, layers=(2,), topk=4, shard_size=2, cache_dir=tmp_path,
              seed=2, written=True, progress=False)
    data = distill_data.load_or_generate(model, _Tok(), 3, **kw)
    assert [p.name for p in tmp_path.joinpath("tiny").iterdir()][0].startswith("written_s2_")
    assert len(data["category"]) == 3 and all(c.startswith("written:") for c in data["category"])
    # Prompt i is its own seed's draw: written again (in other shards) it is the same text.
    again = distill_data.written_prompts(model, _Tok(), range(3), seed=2)
    direct = distill_data.written_prompts(model, _Tok(), [2], seed=2)
    assert again[2] == direct[0]
    for p in again:
        opener = p["category"].split(":", 1)[1]
        assert opener == "free" or p["prompt"].startswith(opener)
    # The cached sequences are those prompts (as chat prompts), then the model's greedy answers.
    st, pl = data["seq_start"], data["prompt_len"]
    for s, p in enumerate(again):
        assert data["tokens"][int(st[s]): int(st[s]) + int(pl[s])].tolist() == _Tok().chat_prompt(p["prompt"])
    regenerated = distill_data.load_or_generate(model, _Tok(), 3, regenerate=True, **kw)
    assert torch.equal(regenerated["tokens"], data["tokens"])
    with pytest.raises(ValueError, match="not both"):
        distill_data.load_or_generate(model, _Tok(), 3, prompts=PROMPTS, **kw)


def test_corpus_sequences_are_seeded_spread_and_extend():
    few = distill_data.corpus_sequences(_Tok(), 5, seq_len=64, seed=0)
    more = distill_data.corpus_sequences(_Tok(), 9, seq_len=64, seed=0)
    assert len(few) == 5 and more[:5] == few  # a larger corpus extends a smaller one
    assert all(len(s) == 64 for s in more)
    other = distill_data.corpus_sequences(_Tok(), 5, seq_len=64, seed=1)
    assert other != few  # another seed, other files
    # One sequence a file: each file's start, in the same seeded order.
    starts = distill_data.corpus_sequences(_Tok(), 9, seq_len=64, seed=0, per_file=1)
    assert len(starts) == 9 and starts[0] == few[0] and len({tuple(s) for s in starts}) == 9
    with pytest.raises(ValueError, match="at least 8"):
        distill_data.corpus_sequences(_Tok(), 2, seq_len=4, seed=0)


def test_corpus_data_is_teacher_forced_cached_and_resumed(model, tmp_path):
    kw = dict(model_name="tiny", seq_len=16, layers=(1, 2), topk=4, shard_size=2, cache_dir=tmp_path, progress=False)
    data = distill_data.load_corpus(model, _Tok(), 80, **kw)  # 5 sequences in 3 shards
    assert data["seq_start"].tolist() == [0, 16, 32, 48, 64, 80] and data["prompt_len"].tolist() == [0] * 5
    assert data["category"] == ["corpus"] * 5
    seqs = distill_data.corpus_sequences(_Tok(), 5, seq_len=16, seed=0)
    assert data["tokens"].tolist() == [t for s in seqs for t in s]
    ref = distill_data.teacher_forced(model, seqs[3:4], (1, 2), 4)
    assert torch.equal(ref["features"], data["features"][:, 48:64]) and torch.equal(ref["topk_ids"], data["topk_ids"][48:64])
    (folder,) = tmp_path.joinpath("tiny").iterdir()
    assert folder.name.startswith("python-stdlib") and len(list(folder.glob("shard_*.pt"))) == 3
    folder.joinpath("shard_0001.pt").unlink()  # an interrupted run: the missing shard is made again
    again = distill_data.load_corpus(model, _Tok(), 80, **kw)
    assert torch.equal(again["features"], data["features"]) and torch.equal(again["tokens"], data["tokens"])


def test_training_data_can_be_corpus_only(model, tmp_path):
    args = argparse.Namespace(model="tiny", weights="native-int8act", max_new_tokens=6, topk=4, shard_size=2,
                              cache_dir=str(tmp_path), num_prompts=0, sampled_prompts=0, answer_temperature=0.8,
                              written_prompts=0, seed=0, corpus_tokens=32, corpus_seq_len=16)
    data = distill_data.load_training_data(model, _Tok(), args)
    assert data["seq_start"].tolist() == [0, 16, 32]
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-native-int8act"]  # features differ by weight format
    args.corpus_tokens = 0
    with pytest.raises(ValueError, match="no training data"):
        distill_data.load_training_data(model, _Tok(), args)
