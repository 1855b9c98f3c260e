"""Train Medusa heads for a model of the package by self-distillation (no download).

    specdec train-medusa --model smollm2-135m    (a new file in ~/.cache/specdec_kernels/medusa)
    specdec train-medusa --model smollm2-135m --out specdec_kernels/data/medusa_smollm2_135m.safetensors --overwrite

1. **Data.** :func:`~specdec_kernels.training.prompts.synthetic_prompts` builds instruction
   prompts from templates (never the benchmark's prompts); the chat template is applied and
   the model answers them greedily with the package's own decode loop at a large batch,
   through the data pipeline every trainer shares (``training.distill_data``: cached
   shards, the last layer's features teacher-forced over prompt + answer). For every
   emitted token o_i we take the hidden state that produced it, *after* the final RMSNorm —
   what ``MedusaDrafter`` feeds the heads at decode time (the pre-norm state of the node
   that produced the root, normed; :func:`answer_rows`): ``hidden`` fp16 [N, H],
   ``tokens`` int64 [N], ``seq_start`` int64 [S+1].
2. **Targets** (:func:`medusa_targets`). Row i's hidden state produced o_i (the LM head's
   token, the root at decode time); head k (0-based) must predict o_{i+k+1}, the token k+1
   steps after the root — the model's own greedy continuation, which greedy verification
   accepts. (In the base model's position terms: the hidden state at position t, whose LM
   head predicts token t+1, gives head k the target token t+k+2, as in
   :func:`~specdec_kernels.drafting.medusa.loss.sequence_targets`.)
   Positions past the end of a sequence are ignored (-1).
3. **Training** (:func:`train_heads`). ``MedusaHeads`` with L ResBlocks per head and the
   model's LM head shared (frozen), loss sum_k 0.8^k CE_k (``medusa_loss``, one ``heads_loss``
   per batch). The softmax is taken over the
   tokens that occur in the data (every target is one of them) rather than the full
   vocabulary: the frozen LM head dominates the cost and on one CPU thread the full 49k-row
   softmax would be ~5x slower. Held-out accuracy is measured with the full vocabulary
   (what decoding uses). AdamW, cosine learning rate, fixed seed.
4. The heads are saved in bf16 (``save_medusa_heads``); ``MedusaDrafter`` loads the shipped
   file for the model by default (``specdec_kernels.drafting.medusa.heads.default_medusa_checkpoint``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from ..._platform import user_cache_dir
from ...decoding.cost_model import as_step_cost, tree_payoffs
from .heads import MedusaHeads, save_medusa_heads
from .loss import heads_loss, medusa_targets
from ...training import distill_data
from ...training.recipe import VALIDATION_PROMPTS, draft_vocabulary, fit


# ---------------------------------------------------------------------------------------
# Data.
# ---------------------------------------------------------------------------------------


def answer_rows(model, data: dict) -> dict:
    """The heads' rows from the shared pipeline's data (``training.distill_data``: prompt +
    answer sequences with the last layer's features): for every answer token, the
    final-normed hidden state that produced it (the feature one position earlier), as
    ``MedusaDrafter`` feeds the heads. Returns {"hidden": fp16 [N, H], "tokens": int64 [N],
    "seq_start": int64 [S+1]} over the sequences that have an answer."""
    from ...models.llama import rms_norm

    last = data["layers"].tolist().index(model.config.num_layers)
    st, prompt_len = data["seq_start"].tolist(), data["prompt_len"].tolist()
    spans = [(st[s] + prompt_len[s], st[s + 1]) for s in range(len(prompt_len)) if st[s + 1] > st[s] + prompt_len[s]]
    produced = torch.cat([torch.arange(a - 1, b - 1) for a, b in spans])  # row i produced token i + 1
    hidden = rms_norm(data["features"][last][produced].float(), model.norm.float(), model.config.rms_norm_eps)
    lengths = torch.tensor([b - a for a, b in spans], dtype=torch.int64)
    return {"hidden": hidden.to(torch.float16), "tokens": data["tokens"][produced + 1],
            "seq_start": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])}


def training_rows(model, tok, args) -> dict:
    """:func:`answer_rows` of the target's greedy answers to ``--num-prompts`` synthetic
    prompts (the shared pipeline's cached shards)."""
    data = distill_data.load_or_generate(
        model, tok, args.num_prompts, model_name=distill_data.cache_name(args.model, "fp32"),
        max_new_tokens=args.max_new_tokens, layers=(model.config.num_layers,), topk=0,
        shard_size=args.gen_batch_size, seed=args.seed, cache_dir=args.cache_dir, regenerate=args.regenerate)
    return answer_rows(model, data)


def validation_rows(model, tok, args, *, max_new_tokens: int = 96) -> dict:
    """:func:`answer_rows` of the answers to the package's prompts.jsonl + VALIDATION_PROMPTS
    (written by hand: the template-held-out sequences overrate the heads)."""
    from importlib import resources

    lines = resources.files("specdec_kernels").joinpath("data/prompts.jsonl").read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines if line.strip()] + VALIDATION_PROMPTS
    data = distill_data.load_or_generate(
        model, tok, len(texts), model_name=distill_data.cache_name(args.model, "fp32"), max_new_tokens=max_new_tokens,
        layers=(model.config.num_layers,), topk=0, shard_size=len(texts), cache_dir=args.cache_dir,
        prompts=[{"prompt": text, "category": "validation"} for text in texts])
    return answer_rows(model, data)


# ---------------------------------------------------------------------------------------
# Training.
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def head_accuracy(heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, *, top: int = 5,
                  chunk: int = 512, root_ids: torch.Tensor | None = None) -> dict:
    """Full-vocabulary accuracy per head: {"top1": [K], "top{top}": [K], "count": [K]}.
    ``root_ids`` [N] (the tokens the rows produced) for root-conditioned heads."""
    K = heads.num_heads
    hit1, hitk, count = torch.zeros(K), torch.zeros(K), torch.zeros(K)
    for s in range(0, hidden.shape[0], chunk):
        h = hidden[s: s + chunk].float()
        t = targets[s: s + chunk]
        logits = heads.logits(h, None if root_ids is None else root_ids[s: s + chunk])  # [M, K, V]
        topk = logits.topk(top, dim=-1).indices
        valid = t >= 0
        hit1 += ((topk[..., 0] == t) & valid).sum(0).float()
        hitk += ((topk == t[..., None]).any(-1) & valid).sum(0).float()
        count += valid.sum(0).float()
    c = count.clamp(min=1)
    return {"top1": (hit1 / c).tolist(), f"top{top}": (hitk / c).tolist(), "count": count.long().tolist()}


def train_heads(hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.Tensor, *, num_layers: int = 1,
                root_ids: torch.Tensor | None = None, embed: torch.Tensor | None = None,
                epochs: int = 3, batch_size: int = 256, lr: float = 1e-3, weight_decay: float = 0.0,
                decay: float = 0.8, seed: int = 0, progress: bool = True, log=print,
                validation: tuple | None = None) -> MedusaHeads:
    """Train ``targets.shape[1]`` Medusa heads on (hidden fp16/fp32 [N, H], targets int64 [N, K]).

    The LM head ``lm_head`` [V, H] is shared and frozen; the softmax runs over the tokens
    that occur in ``targets`` (see the module docstring). With ``embed`` [V, H] (the base
    model's embedding) and ``root_ids`` [N] (the token each row produced) the heads are
    root-conditioned (``MedusaHeads.head_input``). ``validation`` = (hidden, targets,
    root_ids) of held-out sequences: scored after every epoch (full-vocabulary top-1 per
    head), and the epoch with the best sum_k decay^k top1_k is kept (early stopping: with
    a few tens of thousands of tokens the ResBlocks overfit within a few epochs).
    Returns fp32 heads (eval mode).
    """
    torch.manual_seed(seed)
    N, K = targets.shape
    V, H = lm_head.shape
    heads = MedusaHeads(H, V, K, num_layers, lm_head_weight=lm_head.float(),
                        embed_weight=None if embed is None else embed.float())
    if heads.root_conditioned and root_ids is None:
        raise ValueError("root-conditioned training needs root_ids")
    vocab = torch.unique(targets[targets >= 0])
    remap = torch.full((V,), -1, dtype=torch.int64)
    remap[vocab] = torch.arange(vocab.shape[0])
    sub_targets = torch.where(targets >= 0, remap[targets.clamp(min=0)], torch.full_like(targets, -100))
    w_sub = lm_head.float()[vocab].contiguous()  # [Vs, H]
    log(f"training {K} heads x {num_layers} ResBlock(s) on {N} rows, softmax over {vocab.shape[0]} of {V} tokens")
    running = {"loss": torch.zeros(K), "top1": torch.zeros(K), "rows": 0}  # this epoch's, for the log

    def step(rows):
        idx = torch.tensor(rows)
        t = sub_targets[idx]  # [M, K]
        loss, per_head, logits = heads_loss(heads, hidden[idx].float(), t, decay=decay, lm_head=w_sub,
                                            root_ids=None if root_ids is None else root_ids[idx])  # [M, K, Vs]
        with torch.no_grad():
            valid = (t >= 0).float()
            running["loss"] += per_head.detach() * len(rows)
            running["top1"] += ((logits.argmax(-1) == t).float() * valid).sum(0) / valid.sum(0).clamp(min=1) * len(rows)
            running["rows"] += len(rows)
        return loss, {"loss": f"{float(loss.detach()):.3f}"}

    def evaluate():
        n = max(1, running["rows"])
        msg = (f"train loss per head {[round(v, 3) for v in (running['loss'] / n).tolist()]}, "
               f"top-1 (data vocab) {[round(v, 3) for v in (running['top1'] / n).tolist()]}")
        running.update(loss=torch.zeros(K), top1=torch.zeros(K), rows=0)
        if validation is None:
            return None, None, msg
        heads.eval()
        acc = head_accuracy(heads, validation[0], validation[1], root_ids=validation[2])["top1"]
        return sum(decay ** k * a for k, a in enumerate(acc)), acc, msg + f"; validation top-1 {[round(v, 3) for v in acc]}"

    params = [p for p in heads.parameters() if p.requires_grad]
    fit(heads, params, N, batch_size, step, evaluate, epochs=epochs, lr=lr, seed=seed, weight_decay=weight_decay,
        betas=(0.9, 0.999), max_warmup=50, max_grad_norm=None, desc="train heads", log=log, progress=progress)
    return heads.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------
# Tree choice.
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def target_ranks(heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, *, top_k: int = 10,
                 chunk: int = 512, root_ids: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [M, K]: the rank of head k's target in the top-k the drafter sees (``heads``'
    fused forward, draft vocabulary included), or top_k when it is not there / invalid."""
    out = []
    for s in range(0, hidden.shape[0], chunk):
        ids, _ = heads(hidden[s: s + chunk].to(heads.stacked_weights()[0].dtype), top_k,
                       root_ids=None if root_ids is None else root_ids[s: s + chunk])  # [m, K, top_k]
        t = targets[s: s + chunk]
        hit = ids == t[..., None]
        rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(t, top_k))
        out.append(torch.where(t >= 0, rank, torch.full_like(t, top_k)))
    return torch.cat(out)


def choose_tree(ranks: torch.Tensor, *, max_nodes: int = 32, top_k: int = 10) -> list:
    """Medusa choices by greedy expected acceptance, measured on data (not assumed independent).

    ranks: int64 [M, K] from :func:`target_ranks`. The value of a choice (r_0, ..., r_d) is
    the fraction of rows whose heads 0..d ranked their targets exactly r_0..r_d: the
    probability that this node is accepted (greedy verification accepts a node iff its
    whole path is the target's continuation). The expected number of accepted draft tokens
    of a tree is the sum of its nodes' values, and a node's value never exceeds its
    parent's, so the best tree of n nodes is the n best-valued choices. Returns
    [(choice, value)] best first (prefix-closed at every length)."""
    M, K = ranks.shape
    counts: dict[tuple, int] = {}
    rows = ranks.tolist()
    for row in rows:
        path = ()
        for k in range(K):
            if row[k] >= top_k:
                break
            path = path + (row[k],)
            counts[path] = counts.get(path, 0) + 1
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))[:max_nodes]
    return [(c, n / max(1, M)) for c, n in ordered]


def pick_tree_size(scored: list, *, cost_per_node: float, draft_cost: float) -> tuple[int, list]:
    """(n, table): the number of nodes maximising predicted speedup = E[tokens per step] /
    (1 + cost_per_node * n + draft_cost) (the pay-off model, ``cost_model.tree_payoffs``, on
    a step cost linear in the nodes), step costs relative to an autoregressive step
    (measure them: SmolLM2-135M at batch 1 on one shared CPU thread, each verified node
    added 5-10% of an autoregressive step — the forward turns compute-bound beyond a few
    tokens — and the heads ~7% with a 4k-token draft vocabulary, ~20% without). No tree (n
    = 0) is an autoregressive step: speedup 1, the heads do not run."""
    cost = as_step_cost(lambda rows: 1 + cost_per_node * (rows - 1))
    values = tree_payoffs([v for _, v in scored], cost, draft_cost=draft_cost)
    table, acc, best = [], 1.0, (1.0, 0)
    for n, ((_, v), speed) in enumerate(zip(scored, values[1:]), start=1):
        acc += v
        table.append({"nodes": n, "expected_tokens_per_step": acc, "predicted_speedup": speed})
        if speed > best[0]:
            best = (speed, n)
    return best[1], table


# ---------------------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------------------


def output_path(out: str | None, model: str, *, overwrite: bool) -> Path | str:
    """Where the trained heads go: ``out`` if it is new or ``overwrite`` is set, else a new
    file in the per-user cache; an "error: ..." line when ``out`` exists without ``overwrite``
    (the package's shipped heads are replaced only when named explicitly with ``--overwrite``)."""
    if out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return user_cache_dir() / "medusa" / f"medusa_{Path(model).stem}_{stamp}_{os.getpid()}.safetensors"
    if Path(out).exists() and not overwrite:
        return f"error: {out} exists: pass --overwrite to replace it, or name a new file with --out"
    return Path(out)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``specdec train-medusa``: one flat list of flags."""
    p = argparse.ArgumentParser(prog="specdec train-medusa", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="registered name, .gguf file or HF checkpoint folder")
    p.add_argument("--out", default=None,
                   help="output .safetensors; None: a new file in the per-user cache "
                        f"({user_cache_dir() / 'medusa'}). An existing file, such as the heads the package "
                        "ships, is replaced only with --overwrite")
    p.add_argument("--overwrite", action="store_true", help="allow --out to replace an existing file")
    p.add_argument("--cache-dir", default=str(distill_data.DEFAULT_CACHE),
                   help="where the generated data is cached (the data pipeline every trainer shares)")
    p.add_argument("--num-prompts", type=int, default=512, help="synthetic prompts the model answers for the training data")
    p.add_argument("--max-new-tokens", type=int, default=160, help="tokens generated per training prompt")
    p.add_argument("--gen-batch-size", type=int, default=64, help="prompts answered at once while generating the data")
    p.add_argument("--num-heads", type=int, default=4, help="Medusa heads (head k predicts the token k+1 ahead)")
    p.add_argument("--num-layers", type=int, default=1, help="ResBlocks per head")
    p.add_argument("--epochs", type=int, default=2, help="passes over the training rows")
    p.add_argument("--batch-size", type=int, default=128, help="training rows per optimiser step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (cosine schedule)")
    p.add_argument("--held-out", type=float, default=0.08, help="fraction of sequences held out")
    p.add_argument("--eval-rows", type=int, default=4000, help="rows scored for the full-vocabulary accuracies")
    p.add_argument("--draft-vocab-size", type=int, default=4096,
                   help="tokens the heads draft from (0 = the whole vocabulary), see MedusaHeads.set_draft_vocab")
    p.add_argument("--max-tree-nodes", type=int, default=32, help="largest draft tree considered")
    p.add_argument("--tree-nodes", type=int, default=0, help="force the tree size (default: best predicted)")
    p.add_argument("--cost-per-node", type=float, default=0.09,
                   help="verification cost of one more tree node, relative to an autoregressive step")
    p.add_argument("--draft-cost", type=float, default=0.07, help="the heads' cost relative to an autoregressive step")
    p.add_argument("--root-conditioned", type=int, default=1,
                   help="1: the heads also see the root token's embedding (MedusaHeads.head_input); 0: plain Medusa")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--early-stop", type=int, default=1, help="1: keep the epoch with the best validation accuracy")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts, split, initialisation and shuffling")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--regenerate", action="store_true", help="regenerate the data even if cached")
    p.add_argument("--data-only", action="store_true", help="generate (and cache) the data, do not train")
    return p


def _load_training_data(args):
    """(model, tokenizer, the heads' training rows) of ``args.model`` (:func:`training_rows`)."""
    from ...models import load_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    # fp32 weights: the trainer reads the LM head and embedding as dense tensors (and the shipped
    # heads were trained on the fp32 model's hidden states).
    model, tok = load_model(args.model, weights="fp32")
    t0 = time.perf_counter()
    data = training_rows(model, tok, args)
    print(f"data: {data['tokens'].shape[0]} tokens in {data['seq_start'].shape[0] - 1} sequences "
          f"({time.perf_counter() - t0:.0f}s)")
    return model, tok, data


def _print_accuracies(args, heads, splits) -> dict:
    """{split name: head_accuracy} of ``splits`` [(name, hidden, targets, root ids)], each on at
    most ``--eval-rows`` random rows, printed."""
    g = torch.Generator().manual_seed(args.seed)
    accuracy = {}
    for name, hid, tgt, rts in splits:
        rows = torch.arange(hid.shape[0])
        if rows.numel() > args.eval_rows:
            rows = rows[torch.randperm(rows.numel(), generator=g)[: args.eval_rows]]
        acc = head_accuracy(heads, hid[rows], tgt[rows], root_ids=rts[rows])
        accuracy[name] = acc
        print(f"{name} accuracy per head (full vocabulary, {rows.numel()} rows): top-1 "
              f"{[round(v, 3) for v in acc['top1']]}, top-5 {[round(v, 3) for v in acc['top5']]}")
    return accuracy


def _choose_medusa_choices(args, ranks: torch.Tensor) -> list:
    """The draft tree (Medusa choices: one path of head ranks per node) from the target ranks
    ``ranks`` of the scored rows: the size of best predicted speedup unless ``--tree-nodes``."""
    scored = choose_tree(ranks, max_nodes=args.max_tree_nodes)
    n, table = pick_tree_size(scored, cost_per_node=args.cost_per_node, draft_cost=args.draft_cost)
    if args.tree_nodes:
        n = args.tree_nodes
    print("tree size vs expected tokens per step (validation + held-out rows) and predicted speedup:")
    for row in table:
        mark = "  <- chosen" if row["nodes"] == n else ""
        print(f"  {row['nodes']:3d} nodes: {row['expected_tokens_per_step']:.3f} tokens/step, "
              f"{row['predicted_speedup']:.3f}x{mark}")
    choices = [list(c) for c, _ in scored[:n]]
    print(f"medusa choices ({n} nodes): {choices}")
    return choices


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = output_path(args.out, args.model, overwrite=args.overwrite)
    if isinstance(out, str) and out.startswith("error: "):
        print(f"specdec train-medusa: {out}", file=sys.stderr)
        return 2
    model, tok, data = _load_training_data(args)
    if args.data_only:
        return 0
    targets = medusa_targets(data["tokens"], data["seq_start"], args.num_heads)
    train_seqs, held_seqs = distill_data.split_sequences(data["seq_start"], args.held_out, args.seed)
    train_rows = distill_data.sequence_rows(data["seq_start"], train_seqs)
    held_rows = distill_data.sequence_rows(data["seq_start"], held_seqs)
    t1 = time.perf_counter()
    roots = data["tokens"]  # row i's hidden state produced tokens[i]: the root at decode time
    val = validation_rows(model, tok, args)
    val_targets = medusa_targets(val["tokens"], val["seq_start"], args.num_heads)
    print(f"validation: {val['tokens'].shape[0]} tokens in {val['seq_start'].shape[0] - 1} sequences")
    heads = train_heads(data["hidden"][train_rows], targets[train_rows], model.lm_head, num_layers=args.num_layers,
                        root_ids=roots[train_rows] if args.root_conditioned else None,
                        embed=model.embed if args.root_conditioned else None,
                        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                        weight_decay=args.weight_decay,
                        validation=(val["hidden"], val_targets, val["tokens"]) if args.early_stop else None)
    print(f"trained in {time.perf_counter() - t1:.0f}s")
    accuracy = _print_accuracies(args, heads, (
        ("train", data["hidden"][train_rows], targets[train_rows], roots[train_rows]),
        ("held-out", data["hidden"][held_rows], targets[held_rows], roots[held_rows]),
        ("validation", val["hidden"], val_targets, val["tokens"])))
    if 0 < args.draft_vocab_size < model.config.vocab_size:
        heads.set_draft_vocab(draft_vocabulary(targets[train_rows], model.config.vocab_size, args.draft_vocab_size))
    # The tree is chosen on the validation prompts (and the template held-out sequences).
    ranks = torch.cat([target_ranks(heads, val["hidden"], val_targets, root_ids=val["tokens"]),
                       target_ranks(heads, data["hidden"][held_rows], targets[held_rows], root_ids=roots[held_rows])])
    choices = _choose_medusa_choices(args, ranks)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_medusa_heads(heads, str(out), dtype=torch.bfloat16,
                      metadata={"model": args.model, "num_prompts": str(args.num_prompts),
                                "max_new_tokens": str(args.max_new_tokens), "epochs": str(args.epochs),
                                "lr": str(args.lr), "seed": str(args.seed), "train_tokens": str(int(train_rows.numel())),
                                "held_out_top1": json.dumps([round(v, 4) for v in accuracy["held-out"]["top1"]]),
                                "validation_top1": json.dumps([round(v, 4) for v in accuracy["validation"]["top1"]]),
                                "weight_decay": str(args.weight_decay),
                                "medusa_choices": json.dumps(choices),
                                "trained_by": "specdec train-medusa (self-distillation on synthetic prompts)"})
    print(f"wrote {out} ({os.path.getsize(out) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
