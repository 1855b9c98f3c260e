"""Train a distilled draft model or a self-speculation exit head (no download).

    specdec train-draft --kind draft --out draft.safetensors        (a 2-layer distilled draft model)
    specdec train-draft --kind exit --out exit.safetensors          (an exit head; L picked by measurement)
    specdec train-draft --kind draft --out specdec_kernels/data/draft_smollm2_135m.safetensors --overwrite
    specdec train-draft --kind exit --out specdec_kernels/data/exit_smollm2_135m.safetensors --overwrite

1. **Data**: :mod:`specdec_kernels.training.distill_data` (shared with ``train-eagle``; the
   same cache): synthetic prompts (never the benchmark's) answered greedily by the target
   with the package's batched loop, and the target's top-k next-token logits at every
   position, cached and resumable.
2. **Loss**: soft cross-entropy to the target's next-token distribution (the cached top-k
   logits, renormalised over the draft vocabulary) at every position — a KL to the target
   restricted to what the draft can say. The draft vocabulary is the ``--draft-vocab-size``
   tokens the target predicts most often in the training sequences.
3. **Draft model** (``--kind draft``): a Llama of ``--layers`` decoder layers initialised from
   the target's first layers (so "before distillation" is the truncated target, the package's
   old draft), with the target's embedding and LM head rows frozen; every layer weight and
   the final norm are trained (AdamW, cosine schedule, teacher-forced, causal). Stored as
   Q8_0 blocks (``--store``).
4. **Exit head** (``--kind exit``): for each L in ``--exit-layers``, the target's features
   after L layers (computed once from the cached sequences and cached too) train a norm +
   rank-``--rank`` adapter before the frozen LM head rows. L is then picked by measured
   speed x acceptance: the expected speedup of a greedy chain, ``max_k E(a, k) / (cost(k+1) +
   k c_L)`` (``cost_model.best_chain_length``), with ``a`` the held-out top-1 agreement,
   ``cost`` the target's measured step-cost curve and ``c_L`` the measured time of one draft
   token (L layers + the folded head) relative to a target step (ties, e.g. when no L pays:
   the most agreement per unit of draft cost).
5. **Held-out acceptance** after every epoch: the draft's top-1 agreement with the target's
   greedy token on held-out answer positions (the per-token acceptance of greedy
   verification); the best epoch is kept (and written as training goes). Before training it
   is measured once (``before``). At the end, real greedy decoding of a few validation
   prompts (never the benchmark's) reports mean accepted length before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...training import distill_data
from ...training.recipe import VALIDATION_PROMPTS, decode_acceptance, draft_vocabulary, fit
from ...decoding.cost_model import best_chain_length, draft_token_seconds, relative_cost
from ...models.block import DecoderBlock, causal_attention, layer_keys, rms_norm, rope_at, rope_tables
from ...models.llama import dense


# ---- the trainable models ---------------------------------------------------------------------
class DraftLM(nn.Module):
    """Trainable twin of a Llama draft (the decode loop's plain-tensor class has no autograd):
    the same :class:`~specdec_kernels.models.block.DecoderBlock` with ``F.linear`` as its
    product and causal SDPA as its attention, over ``layers`` of the Llama layout as
    parameters (one ``nn.ParameterDict`` each), the final norm, and frozen buffers ``embed``
    [V, H] (the target's) and ``lm_head`` [Vd, H] (the target's draft-vocabulary rows)."""

    def __init__(self, config, layers: list, norm: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        self.config = config
        self.block = DecoderBlock.of(config, F.linear)
        self.layers = nn.ModuleList(
            nn.ParameterDict({k: nn.Parameter(dense(v).float().clone()) for k, v in L.items()}) for L in layers)
        self.norm = nn.Parameter(norm.float().clone())
        self.register_buffer("embed", embed.float(), persistent=False)
        self.register_buffer("lm_head", lm_head.float(), persistent=False)
        self._rope = rope_tables(config, 4096)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens int64 [B, T] -> final-normed hidden states [B, T, H] (causal)."""
        rope = rope_at(*self._rope, torch.arange(tokens.shape[1]))
        x = self.embed[tokens]
        for L in self.layers:
            x = self.block(L, x, rope, causal_attention)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens int64 [B, T] -> fp32 draft logits [B, T, Vd]."""
        return F.linear(self.hidden(tokens), self.lm_head)

    def layer_weights(self) -> list:
        return [{k: L[k].detach().clone() for k in layer_keys(self.config.attention_bias)} for L in self.layers]


class ExitHead(nn.Module):
    """norm + low-rank adapter before the frozen LM head rows: features [.., H] -> logits [.., Vd].
    ``up`` starts at zero, so the untrained head is the target's own norm + LM head (plain
    early exit); ``norm`` starts from the target's final norm."""

    def __init__(self, norm: torch.Tensor, lm_head: torch.Tensor, rank: int, eps: float, seed: int = 0):
        super().__init__()
        H = norm.shape[0]
        g = torch.Generator().manual_seed(seed)
        self.norm = nn.Parameter(norm.float().clone())
        self.down = nn.Parameter(torch.randn(rank, H, generator=g) * H ** -0.5)
        self.up = nn.Parameter(torch.zeros(H, rank))
        self.eps = eps
        self.register_buffer("lm_head", lm_head.float(), persistent=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = F.rms_norm(features.float(), (features.shape[-1],), self.norm, self.eps)
        return F.linear(x + F.linear(F.linear(x, self.down), self.up), self.lm_head)


# ---- data -------------------------------------------------------------------------------------
class Sequences:
    """Training sequences of a distillation data dict: padded token batches with the target's
    next-token distribution at each position, ids mapped into the draft vocabulary (-1
    outside), and which positions count for held-out agreement (those that predict an answer
    token: prompt_len - 1 .. S - 2)."""

    def __init__(self, data: dict, seqs: list, draft_vocab: torch.Tensor, vocab_size: int, features=None):
        self.data, self.seqs, self.features = data, list(seqs), features
        remap = torch.full((vocab_size,), -1, dtype=torch.int64)
        remap[draft_vocab] = torch.arange(draft_vocab.shape[0])
        self.remap = remap
        st = data["seq_start"]
        self.bounds = [(int(st[s]), int(st[s + 1]), int(data["prompt_len"][s])) for s in self.seqs]

    def __len__(self):
        return len(self.seqs)

    def batch(self, idx: list) -> dict:
        d = self.data
        rows = [self.bounds[i] for i in idx]
        B, T = len(rows), max(e - a for a, e, _ in rows)
        k = d["topk_ids"].shape[1]
        toks = torch.zeros(B, T, dtype=torch.int64)
        tid = torch.full((B, T, k), -1, dtype=torch.int64)
        tlog = torch.zeros(B, T, k)
        valid = torch.zeros(B, T, dtype=torch.bool)
        answer = torch.zeros(B, T, dtype=torch.bool)
        feats = None if self.features is None else torch.zeros(B, T, self.features.shape[-1])
        for b, (a, e, p) in enumerate(rows):
            n = e - a
            toks[b, :n] = d["tokens"][a:e]
            tid[b, :n] = self.remap[d["topk_ids"][a:e]]
            tlog[b, :n] = d["topk_logits"][a:e].float()
            valid[b, :n] = True
            answer[b, max(0, p - 1): n - 1] = True
            if feats is not None:
                feats[b, :n] = self.features[a:e].float()
        return {"tokens": toks, "target_ids": tid, "target_logits": tlog, "valid": valid, "answer": answer,
                "features": feats}


def distill_loss(logits: torch.Tensor, batch: dict) -> tuple:
    """(soft cross-entropy to the target's renormalised top-k over valid positions, top-1 hits
    on answer positions, answer positions). logits [B, T, Vd]."""
    tid, tlog = batch["target_ids"], batch["target_logits"]
    soft = torch.where(tid >= 0, tlog, torch.full_like(tlog, float("-inf"))).softmax(-1)
    soft = torch.nan_to_num(soft, nan=0.0)  # no top-k token in the draft vocabulary: no signal
    logp = logits.log_softmax(-1)
    ce = -(soft * logp.gather(-1, tid.clamp(min=0))).sum(-1)
    w = batch["valid"].float()
    loss = (ce * w).sum() / w.sum().clamp(min=1)
    with torch.no_grad():
        hit = (logits.argmax(-1) == tid[..., 0]) & batch["answer"]
    return loss, int(hit.sum()), int(batch["answer"].sum())


# ---- training ---------------------------------------------------------------------------------
@torch.no_grad()
def agreement(module, seqs: Sequences, batch_seqs: int = 8) -> float:
    """Held-out top-1 agreement with the target's greedy token on answer positions."""
    was = module.training
    module.eval()
    hits = count = 0
    for s in range(0, len(seqs), batch_seqs):
        b = seqs.batch(list(range(s, min(len(seqs), s + batch_seqs))))
        _, h, c = distill_loss(module(b["features"] if isinstance(module, ExitHead) else b["tokens"]), b)
        hits, count = hits + h, count + c
    module.train(was)
    return hits / max(1, count)


def train(module, train_seqs: Sequences, held: Sequences, *, epochs: int, batch_seqs: int, lr: float, seed: int,
          weight_decay: float = 0.0, max_seconds: float = 0, on_best=None, log=print, progress=True,
          desc="train draft") -> dict:
    """``recipe.fit`` over ``epochs``; held-out agreement before training and after each
    epoch, the best weights left in ``module`` (``on_best(module, agreement)`` when an epoch
    improves). Returns fit's result with ``before`` and ``best`` as agreements."""
    params = [p for p in module.parameters() if p.requires_grad]

    def step(seqs):
        b = train_seqs.batch(seqs)
        loss, h, c = distill_loss(module(b["features"] if isinstance(module, ExitHead) else b["tokens"]), b)
        return loss, {"loss": f"{loss.item():.3f}", "top1": f"{h / max(1, c):.2f}"}

    def evaluate():
        acc = agreement(module, held)
        return acc, acc, f"held-out top-1 agreement {acc:.3f}"

    result = fit(module, params, len(train_seqs), batch_seqs, step, evaluate, epochs=epochs, lr=lr, seed=seed,
                 weight_decay=weight_decay, max_seconds=max_seconds, score_before=True, desc=desc, log=log,
                 progress=progress, on_best=None if on_best is None else lambda acc: on_best(module, acc))
    result["history"] = [{"epoch": e, "held_out_top1": acc} for e, acc in enumerate(result["history"])]
    return result


# ---- command line -----------------------------------------------------------------------------
def layer_features(model, data: dict, layers: tuple, cache_path: Path, progress=True) -> dict:
    """{L: fp16 [N, H]} the target's hidden states after L layers at every position of the
    data's sequences (teacher-forced), cached at ``cache_path``."""
    from tqdm import tqdm

    if cache_path.exists():
        cached = torch.load(cache_path, weights_only=True)
        if all(L in cached for L in layers) and all(v.shape[0] == data["tokens"].shape[0] for v in cached.values()):
            return cached
    st = data["seq_start"]
    cache = model.new_cache(1, int((st[1:] - st[:-1]).max()) + 1)
    out = {L: [] for L in layers}
    for s in tqdm(range(st.shape[0] - 1), desc=f"features after layers {list(layers)}", unit="seq", disable=not progress):
        slot = cache.add_request(0)
        _, states = model.prefill(data["tokens"][int(st[s]): int(st[s + 1])], cache, slot, num_layers=max(layers),
                                  return_layers=tuple(layers))
        cache.free(slot)
        for L, h in zip(layers, states):
            out[L].append(h.to(torch.float16))
    out = {L: torch.cat(v) for L, v in out.items()}
    tmp = cache_path.with_suffix(".tmp")
    torch.save(out, tmp)
    tmp.replace(cache_path)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``specdec train-draft``: one flat list of flags."""
    p = argparse.ArgumentParser(prog="specdec train-draft", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--kind", choices=("draft", "exit"), default="draft",
                   help="draft: a distilled small draft model; exit: a self-speculation exit head")
    p.add_argument("--model", default="smollm2-135m", help="registered name, .gguf file or HF checkpoint folder")
    p.add_argument("--out", default=None,
                   help="output .safetensors (default: draft_model.safetensors / exit_head.safetensors in the working "
                        "directory; the shipped ones are specdec_kernels/data/{draft,exit}_smollm2_135m.safetensors); "
                        "an existing file is replaced only with --overwrite")
    p.add_argument("--overwrite", action="store_true", help="allow --out to replace an existing file")
    distill_data.add_data_arguments(p, num_prompts=1024)
    p.add_argument("--draft-vocab-size", type=int, default=8192, help="tokens the draft drafts from")
    p.add_argument("--layers", type=int, default=2, help="--kind draft: decoder layers of the draft model")
    p.add_argument("--store", choices=("q8_0", "q4_0", "bf16"), default="q8_0",
                   help="--kind draft: how the file stores the linear weights")
    p.add_argument("--exit-layers", default="2,4,6",
                   help="--kind exit: comma-separated candidate exit layers L; the one with the best measured "
                        "speed x acceptance is kept")
    p.add_argument("--rank", type=int, default=128, help="--kind exit: rank of the adapter")
    p.add_argument("--epochs", type=int, default=6, help="passes over the training sequences")
    p.add_argument("--batch-seqs", type=int, default=8, help="training sequences per optimiser step")
    p.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate (default 2e-4 draft, 2e-3 exit)")
    p.add_argument("--max-minutes", type=float, default=0,
                   help="wall-clock safety net per trained model (0 = off); reported if it triggers")
    p.add_argument("--held-out", type=float, default=0.08, help="fraction of sequences held out for validation")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts, split, initialisation and shuffling")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--eval-prompts", type=int, default=4, help="validation prompts decoded before/after (0: skip)")
    return p


def _prepare(args) -> SimpleNamespace:
    """Load the target and its distillation data: a namespace of the target (``model``, ``tok``),
    ``data`` (distill_data.load_training_data), the ``train_ids`` / ``held_ids`` sequence
    split, the draft ``vocab`` [Vd] and the target's lm_head rows of it ``lm_rows`` [Vd, hidden]
    (fp32), ``V`` (the target's vocabulary size), the file ``meta`` data, the target's
    ``step_cost`` curve, ``max_chain`` and the validation ``prompts``."""
    from ...decoding.cost_model import step_cost_for
    from ...models import load_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tok = load_model(args.model)
    data = distill_data.load_training_data(model, tok, args)
    train_ids, held_ids = distill_data.split_sequences(data["seq_start"], args.held_out, args.seed)
    st = data["seq_start"]
    rows = distill_data.sequence_rows(st, train_ids)
    vocab = draft_vocabulary(data["topk_ids"][rows, 0], model.config.vocab_size, args.draft_vocab_size)
    meta = {"model": args.model, "num_prompts": args.num_prompts, "sampled_prompts": args.sampled_prompts,
            "answer_temperature": args.answer_temperature, "written_prompts": args.written_prompts,
            "max_new_tokens": args.max_new_tokens,
            "positions": int(data["tokens"].shape[0]), "train_sequences": len(train_ids), "epochs": args.epochs,
            "seed": args.seed, "draft_vocab_size": int(vocab.shape[0]),
            "trained_by": f"specdec train-draft --kind {args.kind} (self-distillation on synthetic prompts)"}
    return SimpleNamespace(model=model, tok=tok, data=data, train_ids=train_ids, held_ids=held_ids, vocab=vocab,
                           V=model.config.vocab_size, lm_rows=dense(model.lm_head)[vocab].float(), meta=meta,
                           step_cost=step_cost_for(model),
                           max_chain=12,  # the longest chain the predicted speedup considers
                           prompts=VALIDATION_PROMPTS[: args.eval_prompts])


def train_draft_model(c: SimpleNamespace, args, out: str) -> None:
    """``--kind draft``: distil the target's first ``--layers`` layers into a draft model, saved to
    ``out`` at each best held-out score; then its measured draft cost, predicted chain speedup
    and (with validation prompts) real decoding acceptance go into the file's metadata."""
    from .drafter import ModelDrafter
    from .model import load_draft_model, save_draft_model, truncated_draft

    model, vocab, V = c.model, c.vocab, c.V
    lr = args.lr or 2e-4
    n = args.layers
    train_seqs, held = (Sequences(c.data, ids, vocab, V) for ids in (c.train_ids, c.held_ids))
    before_model = truncated_draft(model, n, vocab)
    lm = DraftLM(before_model.config, before_model.layers, model.norm, dense(model.embed), c.lm_rows)
    config = {"num_layers": n, "hidden_size": model.config.hidden_size, "vocab_size": V,
              "intermediate_size": model.config.intermediate_size, "num_heads": model.config.num_heads,
              "num_kv_heads": model.config.num_kv_heads, "head_dim": model.config.head_dim}
    store = None if args.store == "bf16" else args.store.upper()
    meta = c.meta
    meta.update(layers=n, lr=lr, store=args.store, init="the target's first layers")

    def save(m, acc, final=None):
        save_draft_model(m.layer_weights(), m.norm, vocab, config, out, block_type=store,
                         metadata={**meta, "held_out_top1": round(acc, 4), **(final or {})})

    result = train(lm, train_seqs, held, epochs=args.epochs, batch_seqs=args.batch_seqs, lr=lr, seed=args.seed,
                   max_seconds=args.max_minutes * 60, on_best=save)
    print(f"held-out top-1 agreement: {result['before']:.3f} before distillation -> {result['best']:.3f} after "
          f"({result['updates']} updates, {result['seconds']:.0f}s"
          f"{', stopped by --max-minutes' if result['stopped_early'] else ''})")
    final = {"held_out_top1_before": round(result["before"], 4), "updates": result["updates"],
             "train_seconds": round(result["seconds"]), "stopped_by_time_limit": result["stopped_early"],
             "best_epoch": result["best_epoch"]}
    save(lm, result["best"], final)
    trained = load_draft_model(out, model)
    cost = relative_cost(draft_token_seconds(trained), c.step_cost)
    k, speed = best_chain_length(result["best"], c.max_chain, c.step_cost, draft_cost=cost)
    final.update(draft_token_cost=round(cost, 4), predicted_chain_speedup=round(speed, 3), predicted_chain_k=k)
    print(f"one draft token costs {cost:.3f} of a target step: predicted greedy chain speedup {speed:.2f}x at k={k}")
    if c.prompts:
        b = decode_acceptance(model, c.tok, ModelDrafter(before_model), c.prompts)
        a = decode_acceptance(model, c.tok, ModelDrafter(trained), c.prompts)
        print(f"validation decoding (greedy, batch 1, chain of 4, {len(c.prompts)} prompts): mean accepted length "
              f"{b['mean_accepted_length']:.3f} before -> {a['mean_accepted_length']:.3f} after; identical to "
              f"autoregressive: {a['identical_to_autoregressive']}")
        final.update(validation_mal_before=b["mean_accepted_length"], validation_mal_after=a["mean_accepted_length"])
    save(lm, result["best"], final)


def _sweep_exit_layers(c: SimpleNamespace, args, out: str, Ls: tuple, lr: float) -> dict:
    """Train one exit head per candidate layer L of ``Ls``, each written to ``{out}.L{L}.tmp``:
    {L: its scores, costs and predicted speedup, "tmp": its file}."""
    from .model import exit_model, save_exit_head

    model = c.model
    cache_path = Path(args.cache_dir) / Path(args.model).stem / (
        f"features_s{args.seed}_n{args.num_prompts}"
        f"{f'+{args.sampled_prompts}T{args.answer_temperature:g}' if args.sampled_prompts else ''}"
        f"{f'+{args.written_prompts}W' if args.written_prompts else ''}"
        f"_t{args.max_new_tokens}_l{'-'.join(map(str, Ls))}.pt")
    feats = layer_features(model, c.data, Ls, cache_path)
    results = {}
    for L in Ls:
        train_seqs, held = (Sequences(c.data, ids, c.vocab, c.V, features=feats[L]) for ids in (c.train_ids, c.held_ids))
        head = ExitHead(model.norm, c.lm_rows, args.rank, model.config.rms_norm_eps, seed=args.seed)
        r = train(head, train_seqs, held, epochs=args.epochs, batch_seqs=args.batch_seqs, lr=lr, seed=args.seed,
                  max_seconds=args.max_minutes * 60, desc=f"exit head L={L}")
        tmp = f"{out}.L{L}.tmp"
        save_exit_head(head.norm, head.down, head.up, c.vocab, L, tmp)
        cost = relative_cost(draft_token_seconds(exit_model(model, tmp)), c.step_cost)
        k, speed = best_chain_length(r["best"], c.max_chain, c.step_cost, draft_cost=cost)
        print(f"L={L}: held-out top-1 {r['before']:.3f} untrained -> {r['best']:.3f}; one draft token costs "
              f"{cost:.3f} of a target step; predicted chain speedup {speed:.2f}x at k={k}")
        results[L] = {"top1_before": round(r["before"], 4), "top1": round(r["best"], 4), "draft_token_cost": round(cost, 4),
                      "predicted_chain_speedup": round(speed, 3), "predicted_chain_k": k, "tmp": tmp,
                      "updates": r["updates"], "train_seconds": round(r["seconds"])}
    return results


def train_exit_head(c: SimpleNamespace, args, out: str, error) -> None:
    """``--kind exit``: an exit head per ``--exit-layers`` candidate; the one of the best
    predicted speedup is kept in ``out``, with the sweep and (with validation prompts) real
    decoding acceptance in its metadata. ``error``: the parser's error (bad --exit-layers)."""
    from safetensors.torch import load_file

    from .drafter import ModelDrafter
    from .model import exit_model, save_exit_head

    model = c.model
    lr = args.lr or 2e-3
    Ls = tuple(sorted({int(x) for x in args.exit_layers.split(",")}))
    if not Ls or Ls[0] < 1 or Ls[-1] >= model.config.num_layers:
        error(f"--exit-layers must be in [1, {model.config.num_layers - 1}]")
    results = _sweep_exit_layers(c, args, out, Ls, lr)
    # Ties (e.g. no L pays on this machine's cost curve): the most acceptance per unit draft cost.
    best_L = max(Ls, key=lambda L: (results[L]["predicted_chain_speedup"],
                                    results[L]["top1"] / max(1e-9, results[L]["draft_token_cost"])))
    os.replace(results[best_L]["tmp"], out)
    for L in Ls:
        tmp = results[L].pop("tmp")
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"picked L={best_L} (best measured speed x acceptance)")
    final = {"rank": args.rank, "lr": lr, "sweep": json.dumps(results), **{
        k: v for k, v in results[best_L].items()}}
    if c.prompts:
        drafter = ModelDrafter(exit_model(model, out), share_target_cache=True, name="self-spec")
        before = model.truncated(best_L)
        b = decode_acceptance(model, c.tok, ModelDrafter(before, share_target_cache=True), c.prompts)
        a = decode_acceptance(model, c.tok, drafter, c.prompts)
        print(f"validation decoding (greedy, batch 1, chain of 4): mean accepted length {b['mean_accepted_length']:.3f} "
              f"plain early exit -> {a['mean_accepted_length']:.3f} with the exit head; identical to autoregressive: "
              f"{a['identical_to_autoregressive']}")
        final.update(validation_mal_before=b["mean_accepted_length"], validation_mal_after=a["mean_accepted_length"])
    st_ = load_file(out)
    save_exit_head(st_["norm"], st_["down"], st_["up"], st_["draft_vocab"], best_L, out, metadata={**c.meta, **final})


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    out = args.out or ("draft_model.safetensors" if args.kind == "draft" else "exit_head.safetensors")
    if os.path.exists(out) and not args.overwrite:
        p.error(f"{out} exists: pass --overwrite to replace it, or another --out")
    c = _prepare(args)
    if args.kind == "draft":
        train_draft_model(c, args, out)
    else:
        train_exit_head(c, args, out, p.error)
    print(f"wrote {out} ({os.path.getsize(out) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
