"""Train the EAGLE draft head for a model of the package by self-distillation (no download).

    specdec train-eagle --model smollm2-135m --out eagle.safetensors
    specdec train-eagle --out specdec_kernels/data/eagle_smollm2_135m.safetensors --overwrite  (the shipped file)

1. **Data** (:mod:`specdec_kernels.training.distill_data`): synthetic prompts answered
   greedily by the target with the package's batched loop; the features after every
   position (teacher-forced) and the target's top-k next-token logits, cached and resumable.
2. **Examples.** In each sequence, position t gives the head the feature f_t and token
   t+1; it must predict the target's next-token distribution at position t+1 (soft
   targets: the cached top-k logits, renormalised over the draft vocabulary — the target's
   argmax is what greedy verification accepts) and regress f_{t+1} (smooth L1, scaled by
   the features' standard deviation).
3. **Training-time test** (EAGLE-3's idea, ``--unroll U``): at decode time the head's depth-j
   draft reads its own depth-(j-1) output instead of the target's feature. Step j of the
   unrolled forward does exactly that at every position at once: the input at t is
   (g^{(j-1)}_{t-1}, token t+1), attending to the step-1 (true feature) keys up to t-j+1 and
   to the step-i keys at t-(j-i) for 1 < i <= j — the attention pattern of a depth-j draft
   node. Losses of step j are weighted ``decay^(j-1)``.
4. **Held-out acceptance** after every epoch on the answers of held-out sequences: the
   top-1 agreement of each unrolled step with the target (the acceptance rate at that draft
   depth, given the shallower ones were right) and the chain's expected accepted length
   1 + sum_j prod_i acc_i; the epoch with the best one is kept. AdamW, cosine learning rate, fixed seeds.
5. The head (decoder layer + fc, bf16) and its draft vocabulary (the most frequent target
   predictions of the training data) are saved; ``--out`` never overwrites an existing file
   unless ``--overwrite`` is given.

Feature choice (module docstring of ``drafting.eagle.head``): ``--features fused`` trains
the same head on a learned projection (``EagleHead.fuse``) of the data's layers low / middle /
last instead of the last layer alone, as EAGLE-3 does; the decode loop then hands the head
those layers' states (``EagleHead.feature_layers``). ``--init-from`` a last-layer head with
``--features fused`` starts the projection at the last layer alone, so the run starts from
that head's drafts.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from ... import _platform
from ...decoding.cost_model import chain_tokens
from .head import EagleHead, load_eagle_head, save_eagle_head
from ...models.registry import WEIGHT_FORMATS
from ...training import distill_data
from ...training.recipe import VALIDATION_PROMPTS, decode_acceptance, draft_vocabulary, fit

PRECISIONS = ("fp32", "bf16")


class Examples:
    """Sequences of a data dict as padded training batches.

    For a sequence of S positions: feats [S-1, H] (f_0..f_{S-2}), tokens [S-1] (x_1..x_{S-1}),
    next_feats [S-1, H] (f_1..f_{S-1}), target ids / logits [S-1, k] (the target's top-k at
    positions 1..S-1, ids mapped into the draft vocabulary, -1 outside it)."""

    def __init__(self, data: dict, seqs: list[int], layer_index, draft_vocab: torch.Tensor, vocab_size: int):
        self.data, self.seqs = data, list(seqs)
        self.layer_index = layer_index  # int (one feature) or list (fused)
        remap = torch.full((vocab_size,), -1, dtype=torch.int64)
        remap[draft_vocab] = torch.arange(draft_vocab.shape[0])
        self.remap = remap
        st = data["seq_start"]
        self.bounds = [(int(st[s]), int(st[s + 1])) for s in self.seqs]

    def __len__(self):
        return len(self.seqs)

    def batch(self, idx: list[int]) -> dict:
        d = self.data
        rows = [self.bounds[i] for i in idx]
        T = max(b - a for a, b in rows) - 1
        B = len(rows)
        H = d["features"].shape[-1]
        nf = 1 if isinstance(self.layer_index, int) else len(self.layer_index)
        feats = torch.zeros(B, T, nf, H)
        nxt = torch.zeros(B, T, H)
        toks = torch.zeros(B, T, dtype=torch.int64)
        k = d["topk_ids"].shape[1]
        tid = torch.full((B, T, k), -1, dtype=torch.int64)
        tlog = torch.zeros(B, T, k)
        lens = torch.zeros(B, dtype=torch.int64)
        answer_from = torch.zeros(B, dtype=torch.int64)
        top = d["layers"].shape[0] - 1  # the last requested layer: the regression target
        li = [self.layer_index] if isinstance(self.layer_index, int) else list(self.layer_index)
        for b, (a, e) in enumerate(rows):
            n = e - a - 1
            lens[b] = n
            answer_from[b] = max(0, int(d["prompt_len"][self.seqs[idx[b]]]) - 2)  # predicts the first answer token
            feats[b, :n] = d["features"][li, a: e - 1].float().transpose(0, 1)
            nxt[b, :n] = d["features"][top, a + 1: e].float()
            toks[b, :n] = d["tokens"][a + 1: e]
            tid[b, :n] = self.remap[d["topk_ids"][a + 1: e]]
            tlog[b, :n] = d["topk_logits"][a + 1: e].float()
        return {"feats": feats if nf > 1 else feats[:, :, 0], "next": nxt, "tokens": toks, "target_ids": tid,
                "target_logits": tlog, "lens": lens, "answer_from": answer_from}


def unrolled(head: EagleHead, feats: torch.Tensor, tokens: torch.Tensor, steps: int) -> list:
    """The training-time-test forward (module docstring, 3): feats [B, T, H] (or [B, T, k + 1,
    H] for a head with k ``feature_layers``), tokens int64 [B, T] -> [g^(1), ..., g^(steps)],
    each [B, T, H]."""
    B, T = tokens.shape
    H, D, Hq, Hkv = head.hidden_size, head.head_dim, head.num_heads, head.num_kv_heads
    rep = Hq // Hkv
    scale = 1.0 / math.sqrt(D)
    pos = torch.arange(T).repeat(B)
    feats = head.fuse_features(feats.reshape(B, T, -1))
    outs, keys, values = [], [], []
    cur = feats
    t_idx = torch.arange(T)
    for j in range(1, steps + 1):
        x = head.inputs(cur.reshape(B * T, H), tokens.reshape(-1))
        q, k, v = head.qkv(x, pos)
        q = q.view(B, T, Hq, D).transpose(1, 2)  # [B, Hq, T, D]
        k = k.view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(rep, 1)
        v = v.view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(rep, 1)
        keys.append(k)
        values.append(v)
        if j == 1:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s1 = (q @ keys[0].transpose(-1, -2)) * scale  # [B, Hq, T, T]
            visible = t_idx[None, :] <= (t_idx[:, None] - (j - 1)).clamp(min=0)
            s1 = s1.masked_fill(~visible, float("-inf"))
            diag, vals = [], []
            for i in range(2, j + 1):
                shift = j - i
                ki = F.pad(keys[i - 1], (0, 0, shift, 0))[:, :, :T] if shift else keys[i - 1]
                vi = F.pad(values[i - 1], (0, 0, shift, 0))[:, :, :T] if shift else values[i - 1]
                diag.append((q * ki).sum(-1, keepdim=True) * scale)
                vals.append(vi)
            p = torch.cat([s1] + diag, dim=-1).softmax(-1)
            attn = p[..., :T] @ values[0]
            for n, vi in enumerate(vals):
                attn = attn + p[..., T + n: T + n + 1] * vi
        g = head.output(x, attn.transpose(1, 2).reshape(B * T, Hq * D)).view(B, T, H)
        outs.append(g)
        cur = F.pad(g, (0, 0, 1, 0))[:, :T]  # step j+1 at t reads g^(j) at t-1
    return outs


def losses(head, batch, steps: int, *, feat_scale: float, decay: float = 0.7, reg_weight: float = 0.3,
           precision: str = "fp32"):
    """(total loss, per-step top-1 hits [steps], per-step valid counts [steps]). The loss
    covers every position; hits and counts only the answer's (where decoding drafts: the
    template's predictable prompt tokens would flatter the score). ``precision`` "bf16": the
    forward's products in bf16 under autocast (AVX512-BF16 / AMX through oneDNN: 2.3x fp32's
    GFLOP/s on a Zen 4 core), fp32 master weights, losses in fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        g_all = unrolled(head, batch["feats"], batch["tokens"], steps)
        logp_all = [head.logits(g).log_softmax(-1) for g in g_all]  # fp32 [B, T, Vd] each
    g_all = [g.float() for g in g_all]
    T = batch["tokens"].shape[1]
    t = torch.arange(T)
    tid, tlog = batch["target_ids"], batch["target_logits"]
    in_vocab = tid >= 0
    soft = torch.where(in_vocab, tlog, torch.full_like(tlog, float("-inf"))).softmax(-1)
    soft = torch.nan_to_num(soft, nan=0.0)  # no top-k token in the draft vocabulary: no CE signal
    argmax = tid[..., 0]  # the target's greedy token (-1 outside the draft vocabulary)
    total = 0.0
    hits, counts = [], []
    for j, (g, logp) in enumerate(zip(g_all, logp_all), start=1):
        valid = (t[None, :] >= j - 1) & (t[None, :] < batch["lens"][:, None])
        ce = -(soft * logp.gather(-1, tid.clamp(min=0))).sum(-1)
        reg = F.smooth_l1_loss(g / feat_scale, batch["next"] / feat_scale, reduction="none").mean(-1)
        w = valid.float()
        step_loss = ((ce + reg_weight * reg) * w).sum() / w.sum().clamp(min=1)
        total = total + decay ** (j - 1) * step_loss
        with torch.no_grad():
            scored = valid & (t[None, :] >= batch["answer_from"][:, None])
            hits.append(((logp.argmax(-1) == argmax) & scored).sum().item())
            counts.append(scored.sum().item())
    return total, hits, counts


@torch.no_grad()
def evaluate(head, examples: Examples, steps: int, *, feat_scale: float, batch_seqs: int = 8,
             precision: str = "fp32") -> dict:
    """Held-out per-step top-1 agreement with the target and the chain's expected length."""
    head.eval()
    hits, counts = [0] * steps, [0] * steps
    for s in range(0, len(examples), batch_seqs):
        _, h, c = losses(head, examples.batch(list(range(s, min(len(examples), s + batch_seqs)))), steps,
                         feat_scale=feat_scale, precision=precision)
        hits = [a + b for a, b in zip(hits, h)]
        counts = [a + b for a, b in zip(counts, c)]
    head.train()
    acc = [h / max(1, c) for h, c in zip(hits, counts)]
    return {"top1_by_depth": acc, "expected_chain_length": chain_tokens(acc)}


def train(head: EagleHead, train_ex: Examples, held_ex: Examples, *, steps: int, epochs: int, batch_seqs: int,
          lr: float, seed: int, feat_scale: float, log=print, progress: bool = True,
          max_updates: int = 0, max_seconds: float = 0, stop_after: int = 0, on_best=None,
          precision: str = "fp32", score_before: bool = False) -> dict:
    """``recipe.fit`` over ``epochs`` (or ``max_updates``), scored by the held-out expected
    chain length after each epoch; the best epoch's weights are left in ``head``.
    ``on_best(head, scores)`` is called whenever an epoch improves the held-out score (the
    trainer saves the head then, so an interrupted run keeps its best epoch).
    ``max_seconds`` (0 = off): a wall-clock safety net, checked after every update — when
    it stops the run early the result says so (``stopped_early``). ``stop_after`` (0 = off):
    stop after that many updates without changing the learning-rate schedule (replays a run
    that the time limit stopped). ``score_before``: score the head before training and keep
    it unless an epoch beats it (continued training, ``--init-from``)."""
    params = [p for p in head.parameters() if p.requires_grad]
    epoch = [-1 if score_before else 0]  # the score before training is "epoch -1"

    def step(seqs):
        loss, hits, counts = losses(head, train_ex.batch(seqs), steps, feat_scale=feat_scale, precision=precision)
        return loss, {"loss": f"{float(loss.detach()):.3f}", "top1": f"{hits[0] / max(1, counts[0]):.2f}"}

    def score():
        ev = evaluate(head, held_ex, steps, feat_scale=feat_scale, precision=precision)
        ev["epoch"] = epoch[0]
        epoch[0] += 1
        return ev["expected_chain_length"], ev, (f"held-out top-1 by depth {[round(a, 3) for a in ev['top1_by_depth']]}, "
                                                 f"expected chain length {ev['expected_chain_length']:.3f}")

    return fit(head, params, len(train_ex), batch_seqs, step, score, epochs=epochs, lr=lr, seed=seed,
               max_updates=max_updates, max_seconds=max_seconds, stop_after=stop_after, score_before=score_before,
               desc="train eagle", log=log,
               progress=progress, on_best=None if on_best is None else lambda ev: on_best(head, ev))


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``specdec train-eagle``: one flat list of flags."""
    p = argparse.ArgumentParser(prog="specdec train-eagle", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="registered name, .gguf file or HF checkpoint folder")
    p.add_argument("--out", default="eagle_head.safetensors",
                   help="output .safetensors, a new file in the working directory by default (the shipped one is "
                        "specdec_kernels/data/eagle_smollm2_135m.safetensors); an existing file is replaced only "
                        "with --overwrite")
    p.add_argument("--overwrite", action="store_true", help="allow --out to replace an existing file")
    distill_data.add_data_arguments(p, num_prompts=320)
    p.add_argument("--init-from", default=None, metavar="HEAD.safetensors",
                   help="continue training this head of the same model (its draft vocabulary and MLP width are "
                        "kept; it is scored first and replaced only if an epoch beats it on the held-out data)")
    p.add_argument("--new-vocab", action="store_true",
                   help="with --init-from: choose the draft vocabulary again from this run's data "
                        "(--draft-vocab-size tokens); the head's LM-head rows are the target's own, so its "
                        "layer and fc carry over unchanged")
    p.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="tokens the head drafts from (8192 covered 0.93 of held-out greedy tokens, 4096 0.89)")
    p.add_argument("--features", choices=("top", "fused"), default="top",
                   help="top: the target's last hidden state; fused: the low / middle / last layers' states through "
                        "a learned projection (EAGLE-3), which decoding then reads too")
    p.add_argument("--head-intermediate", type=int, default=0,
                   help="the head's MLP width (0: the target's); narrower heads cost less per draft depth and fit "
                        "the package (the 1.5B's shipped head: 1536)")
    p.add_argument("--weights", default="native", choices=WEIGHT_FORMATS,
                   help="the target's weights while making the data and decoding the validation prompts")
    p.add_argument("--precision", choices=("auto", *PRECISIONS), default="auto",
                   help="the products of the training forward and backward (bf16: autocast, fp32 master weights; "
                        "auto: bf16 where the CPU multiplies bf16 in hardware (AVX512-BF16, AMX), else fp32)")
    p.add_argument("--unroll", type=int, default=3, help="training-time-test steps (draft depths trained)")
    p.add_argument("--epochs", type=int, default=4, help="passes over the training sequences")
    p.add_argument("--max-updates", type=int, default=0, help="stop after this many optimiser steps (0: all epochs)")
    p.add_argument("--max-minutes", type=float, default=0,
                   help="wall-clock safety net (0 = off): stop updating after this long; reported if it triggers")
    p.add_argument("--stop-after", type=int, default=0,
                   help="stop after this many updates, keeping the schedule of --max-updates (replays a timed-out run)")
    p.add_argument("--batch-seqs", type=int, default=8, help="training sequences per optimiser step")
    p.add_argument("--lr", type=float, default=5e-4, help="peak AdamW learning rate")
    p.add_argument("--held-out", type=float, default=0.08, help="fraction of sequences held out for validation")
    p.add_argument("--held-out-last", type=int, default=0,
                   help="hold out the data's last N sequences instead of a random --held-out fraction (the "
                        "newest --written-prompts: when continuing a head, sequences it has not trained on)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts, split, initialisation and shuffling")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--eval-prompts", type=int, default=4, help="validation prompts decoded for the final acceptance")
    p.add_argument("--data-only", action="store_true", help="generate (or complete) the cached data, then stop")
    return p


def _load_data(args):
    """(model, tokenizer, distillation data) of ``args.model`` (distill_data.load_training_data)."""
    from ...models import load_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tok = load_model(args.model, args.weights)
    t0 = time.perf_counter()
    data = distill_data.load_training_data(model, tok, args)
    S = data["seq_start"].shape[0] - 1
    print(f"data: {data['tokens'].shape[0]} positions in {S} sequences, layers {data['layers'].tolist()} "
          f"({time.perf_counter() - t0:.0f}s)")
    return model, tok, data


def _split_examples(args, model, data, vocab=None):
    """The train / held-out split and draft vocabulary (``vocab``, or the most frequent
    target predictions of the train split): (train sequence ids, train Examples, held-out
    Examples, draft vocab [Vd], layer index of the features (the top one, or all for
    ``--features fused``), feature scale (std of the top layer's train features))."""
    st = data["seq_start"]
    S = st.shape[0] - 1
    if args.held_out_last:
        if not 0 < args.held_out_last < S:
            raise SystemExit(f"--held-out-last {args.held_out_last}: the data has {S} sequences")
        train_seqs, held_seqs = list(range(S - args.held_out_last)), list(range(S - args.held_out_last, S))
    else:
        train_seqs, held_seqs = distill_data.split_sequences(st, args.held_out, args.seed)
    train_rows = distill_data.sequence_rows(st, train_seqs)
    if vocab is None:
        vocab = draft_vocabulary(data["topk_ids"][train_rows, 0], model.config.vocab_size, args.draft_vocab_size)
    held_rows = distill_data.sequence_rows(st, held_seqs)
    inv = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    inv[vocab] = True
    print(f"draft vocabulary: {vocab.shape[0]} tokens cover {inv[data['topk_ids'][held_rows, 0]].float().mean():.3f} "
          f"of the target's held-out greedy tokens")
    top = data["layers"].shape[0] - 1
    layer_index = top if args.features == "top" else list(range(data["layers"].shape[0]))
    train_ex = Examples(data, train_seqs, layer_index, vocab, model.config.vocab_size)
    held_ex = Examples(data, held_seqs, layer_index, vocab, model.config.vocab_size)
    feat_scale = float(data["features"][top, train_rows[:20000]].float().std())
    return train_seqs, train_ex, held_ex, vocab, layer_index, feat_scale


def _check_init_from(args) -> None:
    """Refuse an ``--init-from`` head that does not fit this run before any data is made: it
    must exist, be trained for the same model, have the requested MLP width, and a head of
    fused features needs ``--features fused`` (a last-layer head fits either)."""
    from safetensors import safe_open

    if not os.path.isfile(args.init_from):
        raise SystemExit(f"--init-from {args.init_from}: no such file")
    with safe_open(args.init_from, framework="pt") as f:
        meta, keys = dict(f.metadata() or {}), set(f.keys())
        width = f.get_slice("w_down").get_shape()[1] if "w_down" in keys else None
    if width is None:
        raise SystemExit(f"--init-from {args.init_from}: not an EAGLE head file (no w_down)")
    if meta.get("feature_layers") and args.features != "fused":
        raise SystemExit(f"--init-from {args.init_from} reads fused features (layers {meta['feature_layers']} and the "
                         "last): continue it with --features fused")
    if meta.get("model") and meta["model"] != args.model:
        raise SystemExit(f"--init-from {args.init_from} was trained for {meta['model']!r}, not {args.model!r}")
    if args.head_intermediate and args.head_intermediate != width:
        raise SystemExit(f"--head-intermediate {args.head_intermediate} differs from {args.init_from}'s MLP width "
                         f"{width}; leave it out to keep the head's")


def _initial_head(args, model) -> EagleHead | None:
    """The head of ``--init-from`` (checked by :func:`_check_init_from`) as trainable fp32
    parameters; None without the flag."""
    if not args.init_from:
        return None
    return load_eagle_head(args.init_from, model).float().train().requires_grad_(True)


def _continued_metadata(head: EagleHead, path: str) -> str:
    """What ``--init-from``'s head was: its file name and the training that made it (JSON)."""
    keep = ("updates", "train_seconds", "positions", "corpus_tokens", "num_prompts", "written_prompts", "epochs",
            "held_out_top1_by_depth", "continued_from")
    return json.dumps({"file": os.path.basename(path), **{k: head.metadata[k] for k in keep if k in head.metadata}})


def _base_metadata(args, data, train_sequences: int, draft_vocab_size: int) -> dict:
    """The output file's metadata that the run's flags and data fix."""
    return {"model": args.model, "num_prompts": args.num_prompts, "sampled_prompts": args.sampled_prompts,
            "answer_temperature": args.answer_temperature, "written_prompts": args.written_prompts,
            "max_new_tokens": args.max_new_tokens,
            "positions": int(data["tokens"].shape[0]), "train_sequences": train_sequences,
            "epochs": args.epochs, "max_updates": args.max_updates, "unroll": args.unroll, "lr": args.lr,
            "seed": args.seed, "draft_vocab_size": draft_vocab_size, "features": args.features,
            "held_out_split": (f"the last {args.held_out_last} sequences" if args.held_out_last
                               else f"a random {args.held_out:g} of the sequences"),
            "corpus_tokens": args.corpus_tokens, "corpus_seq_len": args.corpus_seq_len,
            "corpus": distill_data.CORPUS_NAME if args.corpus_tokens else "none",
            "corpus_licence": distill_data.CORPUS_LICENCE if args.corpus_tokens else "",
            "target_weights": args.weights, "precision": args.precision,
            "trained_by": "specdec train-eagle (the target's features over real code and its answers to synthetic prompts)"}


def _finish(args, model, tok, head, result: dict, train_s: float, base_meta: dict) -> None:
    """Report the training, decode the validation prompts with the head and write it with
    its final metadata."""
    print(f"trained in {train_s:.0f}s ({result['updates']} updates"
          f"{', stopped by --max-minutes' if result['stopped_early'] else ''})")
    best = result["best"] or result["history"][-1]  # no held-out data: the last epoch
    meta = {**base_meta, "updates": result["updates"], "stopped_by_time_limit": result["stopped_early"],
            "epoch": best["epoch"], "train_seconds": round(train_s),
            "held_out_top1_by_depth": json.dumps([round(a, 4) for a in best["top1_by_depth"]]),
            "held_out_expected_chain_length": round(best["expected_chain_length"], 4)}
    if args.eval_prompts:
        from ...decoding.schedule import SpecSchedule
        from .drafter import EagleDrafter

        head.eval().requires_grad_(False)
        dec = decode_acceptance(model, tok, EagleDrafter(model, head), VALIDATION_PROMPTS[: args.eval_prompts],
                                schedule=SpecSchedule("max", 8, max_k=8), max_new_tokens=40,
                                compare_autoregressive=False)
        print(f"validation decoding (greedy, batch 1, {dec['prompts']} prompts): mean accepted length "
              f"{dec['mean_accepted_length']:.3f}")
        meta["validation_mean_accepted_length"] = round(dec["mean_accepted_length"], 3)
    save_eagle_head(head, args.out, metadata=meta)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB)")


def training_precision(requested: str, bf16_in_hardware: bool | None = None) -> str:
    """``--precision``'s value for this CPU: "auto" is bf16 where the CPU multiplies bf16 in
    hardware, else fp32 (software bf16 products run ~100x slower than fp32 ones). An explicit
    bf16 on such a CPU is kept, with a warning."""
    if bf16_in_hardware is None:
        bf16_in_hardware = _platform.has_bf16_products()
    if requested == "auto":
        chosen = "bf16" if bf16_in_hardware else "fp32"
        print(f"training precision: {chosen} (this CPU {'has' if bf16_in_hardware else 'lacks'} bf16 products)")
        return chosen
    if requested == "bf16" and not bf16_in_hardware:
        print("warning: this CPU has no bf16 products (AVX512-BF16 / AMX): bf16 training runs far slower "
              "than --precision fp32", file=sys.stderr)
    return requested


def _fuse_data_layers(head: EagleHead, data: dict, num_layers: int) -> None:
    """Give ``head`` fusion of the data's feature layers (their last must be the target's last
    layer); a head that already fuses must fuse the same ones."""
    layers = [int(n) for n in data["layers"]]
    if len(layers) < 2 or layers[-1] != num_layers:
        raise SystemExit(f"--features fused needs data of several layers ending with the last ({num_layers}); "
                         f"the data holds {layers}")
    if not head.feature_layers:
        head.fuse_with(layers[:-1])
    elif list(head.feature_layers) != layers[:-1]:
        raise SystemExit(f"--init-from's head fuses layers {list(head.feature_layers)}; the data holds "
                         f"{layers[:-1]} (and the last)")


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if os.path.exists(args.out) and not args.overwrite and not args.data_only:
        p.error(f"{args.out} exists: pass --overwrite to replace it, or another --out")
    if args.new_vocab and not args.init_from:
        p.error("--new-vocab chooses a continued head's vocabulary again: it needs --init-from")
    if args.init_from:
        _check_init_from(args)
    args.precision = training_precision(args.precision)
    model, tok, data = _load_data(args)
    if args.data_only:
        return 0
    head = _initial_head(args, model)
    keep_vocab = head is not None and not args.new_vocab
    train_seqs, train_ex, held_ex, vocab, layer_index, feat_scale = _split_examples(
        args, model, data, head.draft_vocab if keep_vocab else None)
    if head is not None and args.new_vocab:
        head.draft_vocab = vocab.clone()
        head.attach(model)  # the LM head's rows of the new vocabulary
    if head is None:
        head = EagleHead.for_target(model, vocab, intermediate_size=args.head_intermediate or None)
    if args.features == "fused":
        _fuse_data_layers(head, data, model.config.num_layers)
    t1 = time.perf_counter()
    base_meta = _base_metadata(args, data, len(train_seqs), int(vocab.shape[0]))
    if args.init_from:
        base_meta["continued_from"] = _continued_metadata(head, args.init_from)

    def save_best(h, ev):  # keep the best epoch on disk as training goes
        save_eagle_head(h, args.out, metadata={**base_meta, "epoch": ev["epoch"],
                                               "held_out_top1_by_depth": json.dumps([round(a, 4) for a in ev["top1_by_depth"]]),
                                               "held_out_expected_chain_length": round(ev["expected_chain_length"], 4)})

    result = train(head, train_ex, held_ex, steps=args.unroll, epochs=args.epochs, batch_seqs=args.batch_seqs,
                   lr=args.lr, seed=args.seed, feat_scale=feat_scale, max_updates=args.max_updates,
                   max_seconds=args.max_minutes * 60, stop_after=args.stop_after, on_best=save_best,
                   precision=args.precision, score_before=bool(args.init_from))
    _finish(args, model, tok, head, result, time.perf_counter() - t1, base_meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
