"""Our model against transformers on a real GGUF file, and speculative = autoregressive.

    python bench/check_against_transformers.py --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b

1. Logits: our model (``--weights``, fp32 by default) and transformers' AutoModelForCausalLM
   reading the same GGUF file itself (gguf_file=, dequantised fp32) on a short real chat
   prompt; prints the largest absolute difference and whether every argmax agrees. The two
   models are loaded one after the other (a 1.5B model in fp32 is ~6 GB).
2. Tokenizer: ours and transformers' GGUF tokenizer on the prompt and a few code lines.
3. Greedy decoding: ``--max-new-tokens`` tokens autoregressively and with the ``draft``
   drafter (``--draft-model``, a model of the same vocabulary) and ``ngram-tree``; the
   outputs must be identical.
Writes bench/results/<--out-name>.json.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import write_results  # noqa: E402

PROMPT = "Write a Python function that checks whether a string is a palindrome."
CODE = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n\tprint(i ** 2, end=' ')\n",
        "x = {'key': [1, 22, 333]}  # 日本語 ✓"]


def our_logits(model, ids):
    cache = model.new_cache(1, len(ids) + 1, block_size=64)
    slot = cache.add_request(len(ids))
    return model.logits(model.prefill(torch.tensor(ids), cache, slot))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    p.add_argument("--weights", default="fp32", help="our weight format for the logits comparison")
    p.add_argument("--decode-weights", default="fp32", help="weight format of target and draft while decoding")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out-name", default="check_against_transformers")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec_kernels.decoding import Generator, SpecSchedule, make_drafter
    from specdec_kernels.models import load_model
    from specdec_kernels.models.registry import resolve

    path = resolve(args.model)
    result = {"model": args.model, "weights": args.weights}
    t0 = time.perf_counter()
    model, tok = load_model(path, weights=args.weights)
    ids = tok.chat_prompt(PROMPT)
    ours = our_logits(model, ids)
    print(f"ours: {model.weights_format}, loaded and run in {time.perf_counter() - t0:.0f} s", flush=True)
    del model
    gc.collect()

    t0 = time.perf_counter()
    htok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    print(f"transformers: loaded and run in {time.perf_counter() - t0:.0f} s", flush=True)
    del hf
    gc.collect()
    diff = (ours - ref).abs().max().item()
    result.update(positions=len(ids), max_abs_logit_diff=diff, max_abs_logit=ref.abs().max().item(),
                  argmax_agree=float((ours.argmax(-1) == ref.argmax(-1)).float().mean()))
    texts = [tok.apply_chat_template([{"role": "user", "content": PROMPT}])] + CODE
    result["tokenizer_agrees"] = all(tok.encode(t) == htok.encode(t, add_special_tokens=False) for t in texts)
    result["chat_template_agrees"] = tok.apply_chat_template([{"role": "user", "content": PROMPT}]) == \
        htok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    print(f"logits: largest difference {diff:.3g} (largest logit {result['max_abs_logit']:.1f}), argmax agree "
          f"{result['argmax_agree']:.3f}; tokenizer agrees: {result['tokenizer_agrees']}; chat template agrees: "
          f"{result['chat_template_agrees']}", flush=True)

    model, _ = load_model(path, weights=args.decode_weights)
    prompts = [ids]
    t0 = time.perf_counter()
    ar = [r.output for r in Generator(model).generate(prompts, args.max_new_tokens)]
    result["decode"] = {"none": {"seconds": time.perf_counter() - t0, "text": tok.decode(ar[0])}}
    for name, kw in (("ngram-tree", {}), ("draft", {"draft_model": args.draft_model})):
        drafter = make_drafter(name, model, **kw)
        t0 = time.perf_counter()
        reqs = Generator(model, drafter, SpecSchedule("max")).generate(prompts, args.max_new_tokens)
        result["decode"][name] = {"seconds": time.perf_counter() - t0, "identical": [r.output for r in reqs] == ar,
                                  "mean_accepted_length": reqs[0].stats.mean_accepted_length}
    for name, r in result["decode"].items():
        print(f"{name}: {r['seconds']:.1f} s" + (f", identical to autoregressive: {r['identical']}, mean accepted "
                                                  f"length {r['mean_accepted_length']:.2f}" if name != "none" else
                                                  f", {r['text']!r}"))
    print(write_results(args.out_name, result))
    ok = diff < 1e-2 and result["tokenizer_agrees"] and all(r.get("identical", True) for r in result["decode"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
