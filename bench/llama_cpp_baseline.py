"""llama.cpp (``llama-cpp-python``) as an end-to-end baseline, run in a subprocess.

Greedy autoregressive decoding of the same GGUF file, the same prompt token ids (the caller
applies the chat template and passes ids, so both sides see identical prompts), the same
token budget, EOS set and thread count. Timing matches our loop's: the prompt is evaluated
("prefill") and then one token is decoded per step; total seconds = prefill + decode, and
the first generated token comes from the prefill's logits, as ours does.

Why a subprocess: llama-cpp-python's default build (``GGML_NATIVE=ON``) crashed with a
segmentation fault on an AVX-512/AMX Xeon here, which would take the whole benchmark down;
a portable build works. The interpreter that runs it is ``--llama-python`` (default: this
one), so llama-cpp-python can live in its own environment. Install it portably with

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install llama-cpp-python

This file is also the child program: ``python llama_cpp_baseline.py --child`` reads a job
(JSON) on stdin and writes results (JSON) on stdout. The child needs only numpy and
llama_cpp (not torch or this package).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

INSTALL_HINT = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" '
                "pip install llama-cpp-python")


class LlamaCppUnavailable(RuntimeError):
    """llama_cpp cannot be imported (or loaded) by the chosen interpreter."""


def probe(python: str | None = None) -> str:
    """llama_cpp's version under interpreter ``python``; LlamaCppUnavailable (with the
    install command) if it cannot be imported there."""
    python = python or sys.executable
    try:
        res = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LlamaCppUnavailable(f"cannot run {python}: {e}") from e
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise LlamaCppUnavailable(f"llama_cpp is not importable by {python} ({last}); install it with: {INSTALL_HINT}")
    return res.stdout.strip()


def run(model_path: str, prompts: list, max_new_tokens: int, eos_ids, *, threads: int = 1,
        python: str | None = None, warmup: bool = True, timeout: float = 3600) -> dict:
    """Greedy llama.cpp generation of every prompt (lists of token ids), one at a time.

    Returns {"version", "load_seconds", "runs": [{"output": ids, "prompt_tokens",
    "prefill_seconds", "decode_seconds", "seconds"}]} in prompt order. Raises
    LlamaCppUnavailable when llama_cpp cannot be imported, RuntimeError when the child fails
    (its exit status, e.g. -11 for a segmentation fault, and its last stderr lines)."""
    python = python or sys.executable
    version = probe(python)
    job = {"model_path": model_path, "prompts": [list(map(int, p)) for p in prompts],
           "max_new_tokens": int(max_new_tokens), "eos": sorted(int(e) for e in eos_ids),
           "threads": int(threads), "warmup": bool(warmup)}
    res = subprocess.run([python, os.path.abspath(__file__), "--child"], input=json.dumps(job),
                         capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        tail = "\n".join(res.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"llama.cpp child exited with status {res.returncode}:\n{tail}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["version"] = version
    return out


# ---- child ------------------------------------------------------------------------------
def _child() -> int:
    import numpy as np
    from llama_cpp import Llama

    job = json.loads(sys.stdin.read())
    prompts, N, eos = job["prompts"], job["max_new_tokens"], set(job["eos"])
    n_ctx = max(len(p) for p in prompts) + N + 8
    t0 = time.perf_counter()
    llm = Llama(model_path=job["model_path"], n_ctx=n_ctx, n_batch=512, n_threads=job["threads"],
                n_threads_batch=job["threads"], logits_all=False, verbose=False)
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def last_logits():
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))

    def generate(ids):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)  # prompt processing; its last row's logits give the first token
        t_prefill = time.perf_counter() - t
        out = []
        while True:
            tok = int(np.argmax(last_logits()))  # greedy (first maximum, as torch.argmax)
            out.append(tok)
            if tok in eos or len(out) >= N:
                break
            llm.eval([tok])
        total = time.perf_counter() - t
        return {"output": out, "prompt_tokens": len(ids), "prefill_seconds": t_prefill,
                "decode_seconds": total - t_prefill, "seconds": total}

    if job["warmup"]:
        generate(prompts[0][:16] or prompts[0])
    runs = [generate(p) for p in prompts]
    print(json.dumps({"load_seconds": load_s, "runs": runs}))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        sys.exit(_child())
    print(__doc__)
    sys.exit(2)
