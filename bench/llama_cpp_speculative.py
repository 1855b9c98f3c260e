"""llama.cpp's own speculative decoding (``llama-speculative-simple``) as a baseline.

One subprocess per prompt: greedy (``--temp 0 --top-k 1``), or sampled at a temperature T with
nothing else in its sampler chain (``--temp T --top-k 0 --top-p 1 --min-p 0``), the same GGUF file, the
prompt's text with the chat template already applied (llama.cpp tokenizes it with special
tokens parsed, so it sees the same ids; the prompt tokens it reports are recorded to check),
the same thread count. The numbers are the tool's own: "encoded N tokens in S seconds"
(prompt processing), "decoded N tokens in S seconds" (the decode loop), "n_drafted" and
"n_accept".

``METHODS``: its lookup types at their defaults, and autoregressive decoding through the
same binary and the same loop; with a draft model (``methods(draft_path)``) also
``draft-simple`` with that GGUF file (``-md``) at its default ``--spec-draft-n-max`` (3) and
at 8 (its issue's measured setting) — ``ngram-simple`` with a lookup n-gram longer than any
context here (``--spec-ngram-simple-size-n 1024``: it never matches, so every step decodes
one token), because ``--spec-type none`` gives it no speculator to run.

Build the tool from the llama.cpp source (e.g. the one vendored in the llama-cpp-python
sdist): ``cmake -S . -B build -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
&& cmake --build build --target llama-speculative-simple``, and pass ``build/bin`` as
bench_e2e.py's ``--llama-bin``.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

BINARY = "llama-speculative-simple"
METHODS = {
    "llama-spec-ar": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1024"],
    "llama-spec-ngram-simple": ["--spec-type", "ngram-simple"],
    "llama-spec-ngram-mod": ["--spec-type", "ngram-mod"],
}
DRAFT_METHODS = {
    "llama-spec-draft": ["--spec-type", "draft-simple"],
    "llama-spec-draft-n8": ["--spec-type", "draft-simple", "--spec-draft-n-max", "8"],
}
_NUMBERS = {"prompt": r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds",
            "decode": r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds",
            "drafted": r"n_drafted\s*=\s*(\d+)", "accepted": r"n_accept\s*=\s*(\d+)"}


def methods(draft_path: str | None = None) -> dict:
    """{method: its arguments}: METHODS, and DRAFT_METHODS drafting with ``draft_path``."""
    if draft_path is None:
        return dict(METHODS)
    return {**METHODS, **{m: a + ["-md", draft_path] for m, a in DRAFT_METHODS.items()}}


def binary_path(bin_dir: str) -> str:
    """The tool in ``bin_dir``; FileNotFoundError naming it if it is not there."""
    path = os.path.join(bin_dir, BINARY)
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"{path} is not an executable: build llama.cpp's {BINARY} (see bench/llama_cpp_speculative.py)")
    return path


def sampler_args(temperature: float) -> list:
    """llama.cpp's sampler flags: greedy at 0, else softmax at ``temperature`` alone."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return ["--temp", "0", "--top-k", "1"]
    return ["--temp", f"{temperature:g}", "--top-k", "0", "--top-p", "1", "--min-p", "0"]


def run(binary: str, model_path: str, prompt_text: str, max_new_tokens: int, method: str, *, threads: int,
        timeout: float = 1800, draft_path: str | None = None, temperature: float = 0.0) -> dict:
    """One generation of ``prompt_text`` (chat template applied) with ``methods(draft_path)[method]``,
    greedy or at ``temperature`` (:func:`sampler_args`):
    {prompt_tokens, prefill_seconds, tokens, decode_seconds, drafted, accepted, text}.
    RuntimeError with the tool's last lines when it fails or prints none of its timings."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt_text)
        prompt_file = f.name
    try:
        cmd = [binary, "-m", model_path, "-f", prompt_file, "-n", str(max_new_tokens), *sampler_args(temperature),
               "--seed", "1", "-t", str(threads), "-tb", str(threads), "-c", "4096", "-b", "2048",
               *methods(draft_path)[method]]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    finally:
        os.unlink(prompt_file)
    log = res.stdout + "\n" + res.stderr
    found = {k: re.search(p, log) for k, p in _NUMBERS.items()}
    if res.returncode != 0 or found["decode"] is None or found["prompt"] is None:
        tail = "\n".join(log.strip().splitlines()[-6:])
        raise RuntimeError(f"{BINARY} ({method}) exited with status {res.returncode}:\n{tail}")
    # stdout: the prompt's pieces (its trailing newline may merge into the first output piece), then the output.
    echo = prompt_text.rstrip("\n")
    text = res.stdout.split(echo, 1)[-1] if echo in res.stdout else res.stdout
    return {"prompt_tokens": int(found["prompt"].group(1)), "prefill_seconds": float(found["prompt"].group(2)),
            "tokens": int(found["decode"].group(1)), "decode_seconds": float(found["decode"].group(2)),
            "drafted": int(found["drafted"].group(1)) if found["drafted"] else 0,
            "accepted": int(found["accepted"].group(1)) if found["accepted"] else 0, "text": text.strip()}
