"""The soak's short CI variant (bench/soak.py runs 2,000 tokens x 8 requests on SmolLM2):
every drafter that needs no trained file on a tiny random model, batch 4, EOS ignored — outputs equal autoregressive,
no request fails, resident size stable after the warm-up, every cache block returned."""
import pytest
import torch

from bench.soak import check, run_soak
from specdec_kernels.decoding import DRAFTERS, make_drafter
from specdec_kernels.models import Llama, tiny_config


@pytest.fixture(scope="module")
def model():
    return Llama.random(tiny_config(vocab_size=64, max_position_embeddings=2048), seed=1)


def test_soak_every_drafter(model):
    g = torch.Generator().manual_seed(0)
    # Repetitive prompts so that the n-gram drafters find matches and accept.
    prompts = [(torch.randint(0, 64, (6,), generator=g).tolist() * 4)[: 10 + 3 * i] for i in range(4)]
    runnable = []  # a random model ships no trained file: those drafters say so and are left out
    for name in DRAFTERS:
        try:
            make_drafter(name, model, self_spec_layers=1)
        except ValueError as e:
            assert "ships for model" in str(e), (name, e)
            continue
        runnable.append(name)
    assert {"ngram", "ngram-tree", "self-spec-plain", "medusa-untrained", "draft-untrained",
            "eagle-untrained"} <= set(runnable)
    results = run_soak(model, runnable, prompts, 300, rss_growth_mb=64.0, self_spec_layers=1, show_progress=False)
    assert set(results) == set(runnable) | {"none"}
    for name, r in results.items():
        assert r["failures"] == [], f"{name}: {r['failures']}"
        assert r["caches"]["target"]["num_blocks"] > 0


def test_soak_check_catches_each_failure():
    ok = {"errors": [], "tokens": 4, "expected_tokens": 4, "outputs": [[1, 2], [3, 4]], "rss_after_warmup_mb": 100.0,
          "rss_end_mb": 110.0, "caches": {"target": {"free_blocks": 8, "scratch_blocks": 0, "num_blocks": 8, "active_slots": 0},
                     "drafter": {"free_blocks": 6, "scratch_blocks": 2, "num_blocks": 8, "active_slots": 0}}}
    assert check(ok, [[1, 2], [3, 4]], 64.0) == []  # blocks held as scratch are not lost
    cases = {
        "differ": dict(outputs=[[1, 2], [3, 5]]),
        "failed": dict(errors=["request 1: NaN"]),
        "tokens generated": dict(tokens=3),
        "resident size": dict(rss_end_mb=200.0),
        "not returned": dict(caches={"target": {"free_blocks": 7, "scratch_blocks": 0, "num_blocks": 8,
                                                "active_slots": 0}}),
    }
    for words, change in cases.items():
        failures = check({**ok, **change}, [[1, 2], [3, 4]], 64.0)
        assert len(failures) == 1 and words in failures[0], (words, failures)
