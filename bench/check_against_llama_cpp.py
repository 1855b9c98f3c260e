"""Teacher-forced next-token agreement with llama.cpp on the same GGUF file.

  LLAMA_CPP_LIB_PATH=/path/to/llama.cpp/build/bin \\
      python bench/check_against_llama_cpp.py --model qwen2.5-coder-1.5b --tokens 2048 --threads 2

The text is real code and prose found on this machine (the Python standard library's sources,
PSF licence: ``textwrap``, ``json.decoder``, ``heapq`` and their docstrings), tokenised once
by our tokenizer; both sides run the same token ids in one causal pass (ours: one prefill;
llama.cpp: ``llama_cpp.Llama(logits_all=True).eval``) and their top-1 next tokens are compared
at every position. Also reports the largest logit difference and how often the disagreements
fall where llama.cpp's own two best logits are within ``--close`` of each other (a rounding
tie, not an error). Needs ``llama-cpp-python`` (its library may be an own build of llama.cpp:
``LLAMA_CPP_LIB_PATH``). Results: bench/results/llama_cpp_agreement_<model>_<weights>.json.
"""
from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import write_results  # noqa: E402


def corpus_text() -> str:
    import heapq
    import json.decoder
    import textwrap

    return "\n\n".join(inspect.getsource(m) for m in (textwrap, json.decoder, heapq))


def our_logits(model, ids: list[int]) -> np.ndarray:
    """fp32 [S, V] next-token logits of one causal pass over ``ids``."""
    cache = model.new_cache(1, len(ids) + 1)
    hidden = model.prefill(torch.tensor(ids, dtype=torch.int64), cache, cache.add_request(len(ids)))
    return torch.cat([model.logits(h) for h in hidden.split(256)]).numpy()


def llama_cpp_logits(path: str, ids: list[int], threads: int) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=len(ids) + 16, n_batch=512, n_threads=threads, logits_all=True,
                verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--weights", default="native-int8act")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--close", type=float, default=0.05, help="logit gap counted as a tie (default 0.05)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from specdec_kernels.models import load_model
    from specdec_kernels.models.registry import resolve

    path = resolve(args.model)
    print(f"loading {args.model} ({args.weights}) ...", file=sys.stderr)
    model, tok = load_model(path, weights=args.weights)
    ids = tok.encode(corpus_text())[:args.tokens]
    print(f"{len(ids)} tokens: ours ...", file=sys.stderr)
    ours = our_logits(model, ids)
    del model
    print("llama.cpp ...", file=sys.stderr)
    theirs = llama_cpp_logits(path, ids, args.threads)
    agree = ours.argmax(-1) == theirs.argmax(-1)
    top2 = np.sort(theirs, axis=-1)[:, -2:]
    tie = (top2[:, 1] - top2[:, 0]) < args.close
    result = {"model": args.model, "weights": args.weights, "tokens": len(ids),
              "top1_agreement": float(agree.mean()), "disagreements": int((~agree).sum()),
              "disagreements_at_llama_cpp_ties": int((~agree & tie).sum()),
              "max_abs_logit_diff": float(np.abs(ours - theirs).max()),
              "max_abs_logit_diff_position": int(np.abs(ours - theirs).max(-1).argmax()),
              "max_abs_logit_diff_past_position_0": float(np.abs(ours[1:] - theirs[1:]).max()),
              "mean_abs_logit_diff": float(np.abs(ours - theirs).mean()),
              "command": " ".join(["python", "bench/check_against_llama_cpp.py"] + sys.argv[1:])}
    print(result)
    out = write_results(f"llama_cpp_agreement_{Path(str(args.model)).name.removesuffix('.gguf')}_{args.weights}", result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
