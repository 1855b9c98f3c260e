"""Self-distillation data: the target answers synthetic prompts; we keep what drafts learn from.

The one data pipeline of every trainer: the EAGLE head (``specdec train-eagle``), the
draft-model / exit-head trainers (``specdec train-draft``) and the Medusa heads (``specdec
train-medusa``, which read the last layer's features of the answers):

1. **Answers.** :func:`~specdec_kernels.training.prompts.synthetic_prompts` (templates, never
   the benchmark's prompts) with the chat template applied; the target answers them greedily
   with the package's own batched loop (``Generator`` with no drafter, a batch of prompts of
   similar length per call), stopping at EOS or ``max_new_tokens``. Optionally a second set
   (other fillings of the templates) is answered by *sampling* (``--sampled-prompts``): the
   labels are still the target's own next-token distribution at every position, but the
   contexts vary more than greedy answers to templated prompts do (measured: a draft that
   agreed 0.66 with the target on held-out greedy answers agreed 0.06-0.17 on real chat
   prompts — the narrow data, not the model size, limited it). A third set
   (``--written-prompts``) has prompts *written by the target itself*: a chat model asked
   to continue the user's turn of its own template writes a user's message (sampled at
   T = 1, seeded per prompt; about two thirds start with an opener such as "Translate" or
   "Summarize the following article:", so every kind of task appears). Measured: the EAGLE
   head trained on templates alone agreed 0.58 with the target on answers to held-out
   template prompts but 0.28 on answers to real questions; the templates are too narrow.
2. **Features.** Every sequence (prompt + answer) is run once more, teacher-forced, through
   ``Llama.prefill(return_layers=...)``: the hidden states after the requested layer counts
   (default: the model's low / middle / last layer, EAGLE-3's fusion inputs; the last one,
   before the final norm, is what the decode loop calls ``hidden``), fp16, at every position
   of the sequence; and the target's top-k next-token logits (fp16) and their ids, for a KL
   to the target's distribution (issue: distilled draft model). Position t's features are
   the state after reading tokens[0..t]: they produce the prediction of tokens[t+1].
3. **Real text** (``--corpus-tokens``): sequences of ``--corpus-seq-len`` tokens cut from the
   Python standard library's sources (PSF licence; every machine running the package has
   them), files in a seeded order, at most two sequences a file so the corpus spans the
   library; no generation, only the teacher-forced pass of 2. (EAGLE-1's data: the target's
   features over fixed text). ``prompt_len`` is 0 there: every position is scored.
4. **Cache.** Shards of ``shard_size`` prompts, ``cache_dir/<model>/<key>/shard_XXXX.pt``
   where the key names everything that changes the data (seed, token limit, layers, top-k,
   shard size); an interrupted run resumes at the first missing shard (shards are written
   atomically). ``synthetic_prompts(n)`` is a prefix of ``synthetic_prompts(n + m)``, so a
   larger run reuses a smaller one's shards.

A data dict (one shard or several concatenated) holds, with N positions in S sequences:
``tokens`` int64 [N]; ``seq_start`` int64 [S+1] (sequence s owns rows seq_start[s]:
seq_start[s+1]); ``prompt_len`` int64 [S]; ``features`` fp16 [len(layers), N, H];
``layers`` int64 [len(layers)]; ``topk_ids`` int64 [N, k] and ``topk_logits`` fp16 [N, k]
(absent when top-k is 0); ``category`` list[str] [S].
"""
from __future__ import annotations

import os
import random
import time
from pathlib import Path

import torch

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec_kernels" / "distill"


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """(low, middle, last) layer counts: EAGLE-3 fuses an early, a middle and a late layer;
    we take layer 2, the middle one and the last (the decode loop's ``hidden``)."""
    return (min(2, num_layers), num_layers // 2, num_layers)


@torch.inference_mode()
def teacher_forced(model, sequences: list[list[int]], layers, topk: int) -> dict:
    """Features (after each layer count in ``layers``) and top-k logits of ``model`` at every
    position of each sequence (one causal forward per sequence). See the module docstring."""
    feats, ids, vals = [], [], []
    max_len = max(len(s) for s in sequences)
    cache = model.new_cache(1, max_len + 1, block_size=64)
    for seq in sequences:
        slot = cache.add_request(0)
        h, states = model.prefill(torch.tensor(seq, dtype=torch.int64), cache, slot, return_layers=tuple(layers))
        cache.free(slot)
        feats.append(torch.stack([s.to(torch.float16) for s in states]))
        if topk > 0:
            v, i = model.logits(h).topk(topk, dim=-1)
            ids.append(i)
            vals.append(v.to(torch.float16))
    out = {"features": torch.cat(feats, dim=1)}
    if topk > 0:
        out["topk_ids"] = torch.cat(ids)
        out["topk_logits"] = torch.cat(vals)
    return out


# How a written prompt starts ("": the model starts it); drawn per prompt from its seed.
OPENERS = ("",) * 16 + (
    "Write", "Compose", "Write a story", "Explain", "Describe", "Imagine you are", "Pretend to be",
    "Solve", "Calculate", "A store", "If", "Write a Python function", "Write a program",
    "Fix the bug in this code:\n", "Given the following", "Extract", "Translate the following sentence into English:",
    "Translate into German:", "Summarize the following article:\n\n", "Read the passage and answer the question.\n\n",
    "What is", "How do", "Why", "Compare", "Suppose", "List", "Edit the following paragraph", "Evaluate")


@torch.inference_mode()
def written_prompts(model, tok, indices, *, seed: int, max_tokens: int = 96) -> list[dict]:
    """Prompts written by ``model`` itself (module docstring, 1): prompt i of ``indices``
    continues the user turn of the chat template after an opener drawn with seed
    ``seed * 1_000_003 + i``, sampled at T = 1 with that seed, up to ``max_tokens`` tokens
    or the end-of-turn token -> [{"prompt", "category"}] (category "written:<opener's first word>")."""
    from ..decoding.generator import Generator, SamplingParams

    indices = list(indices)
    openers = [random.Random(seed * 1_000_003 + i).choice(OPENERS) for i in indices]
    results = Generator(model, None).generate(
        [tok.user_turn_prefix(o) for o in openers], max_tokens,
        [SamplingParams(temperature=1.0, seed=seed * 1_000_003 + i) for i in indices])
    eos = set(model.config.eos_token_ids)
    out = []
    for opener, r in zip(openers, results):
        text = (opener + tok.decode([t for t in r.output if t not in eos])).strip()
        out.append({"prompt": text or "Hello!", "category": "written:" + (opener.split()[0] if opener else "free")})
    return out


_SKIPPED_CORPUS_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def corpus_files() -> list[str]:
    """The Python standard library's own sources (PSF licence), in a fixed order: real code,
    comments and English docstrings that every machine running this package has."""
    import sysconfig

    files = []
    for root, dirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_CORPUS_DIRS)
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
    return files


CORPUS_NAME = "python-stdlib"
CORPUS_LICENCE = "PSF-2.0 (the Python standard library's own sources)"


def corpus_sequences(tok, count: int, *, seq_len: int, seed: int, per_file: int = 2) -> list[list[int]]:
    """``count`` token sequences of ``seq_len`` tokens (fewer if the library runs out) cut
    from the starts of the standard library's source files (:func:`corpus_files`,
    tests skipped), the files shuffled by ``seed``, at most ``per_file`` sequences a file.
    Sequence i does not depend on ``count``, so a larger corpus extends a smaller one."""
    if seq_len < 8:
        raise ValueError(f"corpus sequences need at least 8 tokens, got seq_len={seq_len}")
    files = corpus_files()
    random.Random(seed).shuffle(files)
    out: list[list[int]] = []
    for f in files:
        if len(out) >= count:
            break
        with open(f, encoding="utf-8", errors="replace") as fh:
            text = fh.read(seq_len * per_file * 8)  # source code runs 3-4 characters a token
        ids = tok.encode(text)
        out += [ids[c * seq_len:(c + 1) * seq_len] for c in range(min(per_file, len(ids) // seq_len))]
    return out[:count]


def corpus_shard(model, sequences: list[list[int]], *, layers, topk: int) -> dict:
    """:func:`teacher_forced` data over corpus ``sequences`` (no prompt: ``prompt_len`` 0)."""
    data = teacher_forced(model, sequences, layers, topk)
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    data.update(tokens=torch.tensor([t for s in sequences for t in s], dtype=torch.int64),
                seq_start=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
                prompt_len=torch.zeros(len(sequences), dtype=torch.int64),
                layers=torch.tensor(list(layers), dtype=torch.int64), category=["corpus"] * len(sequences))
    return data


def collect(model, prompts: list[list[int]], *, max_new_tokens: int, layers, topk: int,
            batch_size: int = 32, temperature: float = 0.0, seed: int = 0) -> dict:
    """Answers of ``model`` to ``prompts`` (token ids) with the package's batched decode loop
    — greedy, or sampled at ``temperature`` (prompt i with seed ``seed + i``) — then
    :func:`teacher_forced` features over prompt + answer."""
    from ..decoding.generator import Generator, SamplingParams

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: dict[int, list] = {}
    gen = Generator(model, None)
    for start in range(0, len(order), batch_size):
        ids = order[start: start + batch_size]
        sampling = [SamplingParams(temperature=temperature, seed=seed + i) for i in ids]
        for i, r in zip(ids, gen.generate([prompts[i] for i in ids], max_new_tokens, sampling)):
            answers[i] = r.output
    sequences = [list(prompts[i]) + answers[i] for i in range(len(prompts))]
    data = teacher_forced(model, sequences, layers, topk)
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    data.update(tokens=torch.tensor([t for s in sequences for t in s], dtype=torch.int64),
                seq_start=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
                prompt_len=torch.tensor([len(p) for p in prompts], dtype=torch.int64),
                layers=torch.tensor(list(layers), dtype=torch.int64))
    return data


def concat(shards: list[dict]) -> dict:
    """Concatenate data dicts (same layers / top-k)."""
    starts, offset = [torch.zeros(1, dtype=torch.int64)], 0
    for sh in shards:
        starts.append(sh["seq_start"][1:] + offset)
        offset += int(sh["seq_start"][-1])
    out = {"tokens": torch.cat([s["tokens"] for s in shards]), "seq_start": torch.cat(starts),
           "prompt_len": torch.cat([s["prompt_len"] for s in shards]),
           "features": torch.cat([s["features"] for s in shards], dim=1), "layers": shards[0]["layers"],
           "category": [c for s in shards for c in s.get("category", [])]}
    if "topk_ids" in shards[0]:
        out["topk_ids"] = torch.cat([s["topk_ids"] for s in shards])
        out["topk_logits"] = torch.cat([s["topk_logits"] for s in shards])
    return out


def load_or_generate(model, tok, num_prompts: int, *, model_name: str, max_new_tokens: int = 128, layers=None,
                     topk: int = 32, shard_size: int = 32, seed: int = 0, cache_dir=DEFAULT_CACHE,
                     regenerate: bool = False, progress: bool = True, prompts: list[dict] | None = None,
                     temperature: float = 0.0, written: bool = False) -> dict:
    """Self-distillation data for ``synthetic_prompts(num_prompts, seed)`` (or ``prompts``,
    [{"prompt", "category"}]; or, with ``written``, ``num_prompts`` prompts the model writes
    itself, :func:`written_prompts`), generated shard by shard and cached (see the module
    docstring); answers greedy, or sampled at ``temperature`` (seeded per prompt)."""
    from .prompts import synthetic_prompts

    torch.manual_seed(seed)
    layers = tuple(layers or default_layers(model.config.num_layers))
    if written:  # written shard by shard, inside the cached unit (they cost a generation too)
        if prompts is not None:
            raise ValueError("pass either prompts or written=True, not both")
        prompts = [None] * num_prompts
        tag = f"written_s{seed}"
    elif prompts is None:
        prompts = synthetic_prompts(num_prompts, seed=seed)
        tag = f"synthetic_s{seed}"
    else:
        import hashlib

        tag = "custom_" + hashlib.sha1("\n".join(p["prompt"] for p in prompts).encode()).hexdigest()[:10]
    if temperature > 0:
        tag += f"_T{temperature:g}"
    key = f"{tag}_t{max_new_tokens}_l{'-'.join(map(str, layers))}_k{topk}_b{shard_size}"

    def make(start: int, stop: int) -> dict:
        chunk = prompts[start:stop]
        if written:
            chunk = written_prompts(model, tok, range(start, stop), seed=seed)
        shard = collect(model, [tok.chat_prompt(p["prompt"]) for p in chunk], max_new_tokens=max_new_tokens,
                        layers=layers, topk=topk, batch_size=shard_size, temperature=temperature,
                        seed=seed * 1_000_003 + start)
        shard["category"] = [p.get("category", "") for p in chunk]
        return shard

    return cached_shards(Path(cache_dir) / _folder(model_name) / key, len(prompts), shard_size, make,
                         desc="self-distillation", unit="prompt", progress=progress, regenerate=regenerate)


def load_corpus(model, tok, num_tokens: int, *, model_name: str, seq_len: int = 256, layers=None, topk: int = 32,
                shard_size: int = 32, seed: int = 0, cache_dir=DEFAULT_CACHE, progress: bool = True) -> dict:
    """Teacher-forced data over ``num_tokens`` tokens of the standard library's sources
    (:func:`corpus_sequences`, module docstring 3), made by one prefill a sequence and cached
    shard by shard like :func:`load_or_generate`'s."""
    import hashlib
    import sys

    layers = tuple(layers or default_layers(model.config.num_layers))
    sequences = corpus_sequences(tok, -(-num_tokens // seq_len), seq_len=seq_len, seed=seed)
    digest = hashlib.sha1(repr([s[:4] for s in sequences[:shard_size]]).encode()).hexdigest()[:8]
    key = (f"{CORPUS_NAME}{sys.version_info[0]}.{sys.version_info[1]}_{digest}_s{seed}_n{seq_len}"
           f"_l{'-'.join(map(str, layers))}_k{topk}_b{shard_size}")
    return cached_shards(Path(cache_dir) / _folder(model_name) / key, len(sequences), shard_size,
                         lambda a, b: corpus_shard(model, sequences[a:b], layers=layers, topk=topk),
                         desc="corpus features", unit="seq", progress=progress)


def _folder(model_name: str) -> str:
    """A model's cache folder name (a path's stem; :func:`cache_name`'s output as is)."""
    return Path(model_name).stem if os.sep in model_name or os.path.exists(model_name) else model_name


def cached_shards(root: Path, count: int, shard_size: int, make, *, desc: str, unit: str, progress: bool = True,
                  regenerate: bool = False) -> dict:
    """The data of ``count`` items, made ``shard_size`` at a time by ``make(start, stop)`` and
    cached as ``root/shard_XXXX.pt`` (written atomically: a killed run never leaves half a
    shard, and the next run resumes at the first missing one), concatenated."""
    from tqdm import tqdm

    root.mkdir(parents=True, exist_ok=True)
    shards, positions = [], 0
    bar = tqdm(total=count, desc=desc, unit=unit, disable=not progress)
    for i, start in enumerate(range(0, count, shard_size)):
        stop = min(count, start + shard_size)
        path = root / f"shard_{i:04d}.pt"
        if path.exists() and not regenerate:
            shard = torch.load(path, weights_only=True)
        else:
            t0 = time.perf_counter()
            shard = make(start, stop)
            tmp = path.with_suffix(".tmp")
            torch.save(shard, tmp)
            tmp.replace(path)
            if progress:
                tqdm.write(f"shard {i}: {shard['tokens'].shape[0]} positions in {time.perf_counter() - t0:.0f}s -> {path}")
        shards.append(shard)
        positions += shard["tokens"].shape[0]
        bar.update(stop - start)
        bar.set_postfix(positions=positions)
    bar.close()
    return concat(shards)


def add_data_arguments(p, *, num_prompts: int) -> None:
    """The data options both trainers take (``specdec train-eagle``, ``train-draft``)."""
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="where the generated data is cached")
    p.add_argument("--num-prompts", type=int, default=num_prompts,
                   help="synthetic prompts the model answers greedily for the training data")
    p.add_argument("--sampled-prompts", type=int, default=0,
                   help="more synthetic prompts (drawn with seed + 1, so other fillings of the templates), "
                        "answered by sampling at --answer-temperature: more varied contexts than greedy answers")
    p.add_argument("--answer-temperature", type=float, default=0.8,
                   help="sampling temperature of the --sampled-prompts answers")
    p.add_argument("--written-prompts", type=int, default=0,
                   help="prompts the target writes itself (continuing the user turn of its chat template, "
                        "seed + 2), answered greedily: the broadest contexts of the three sets")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per training prompt")
    p.add_argument("--shard-size", type=int, default=32, help="prompts per cached data shard (the unit of resuming)")
    p.add_argument("--topk", type=int, default=32, help="target logits cached per position")
    p.add_argument("--corpus-tokens", type=int, default=0,
                   help="tokens of real code and text (the Python standard library's sources, PSF licence) "
                        "run teacher-forced through the target: features at the cost of a prefill")
    p.add_argument("--corpus-seq-len", type=int, default=256, help="tokens per corpus sequence")


def cache_name(model: str, weights: str = "native") -> str:
    """The cache folder's name for a model (:func:`_folder`) loaded with ``weights``:
    features differ between weight formats."""
    name = _folder(model)
    return name if weights == "native" else f"{name}-{weights}"


def load_training_data(model, tok, args) -> dict:
    """The data of :func:`add_data_arguments`' options: ``--corpus-tokens`` tokens of real
    code, plus ``--num-prompts`` greedy answers (seed ``args.seed``), plus
    ``--sampled-prompts`` sampled ones (seed + 1), plus greedy answers to
    ``--written-prompts`` prompts the model wrote (seed + 2), concatenated."""
    if max(args.corpus_tokens, args.num_prompts, args.sampled_prompts, args.written_prompts) <= 0:
        raise ValueError("no training data: give --corpus-tokens, --num-prompts, --sampled-prompts or --written-prompts")
    name = cache_name(args.model, getattr(args, "weights", "native"))  # train-draft has no --weights
    kw = dict(model_name=name, max_new_tokens=args.max_new_tokens, topk=args.topk,
              shard_size=args.shard_size, cache_dir=args.cache_dir)
    parts = []
    if args.corpus_tokens > 0:
        parts.append(load_corpus(model, tok, args.corpus_tokens, model_name=name, seq_len=args.corpus_seq_len,
                                 topk=args.topk, shard_size=args.shard_size, seed=args.seed, cache_dir=args.cache_dir))
    if args.num_prompts > 0:
        parts.append(load_or_generate(model, tok, args.num_prompts, seed=args.seed, **kw))
    if args.sampled_prompts > 0:
        if not args.answer_temperature > 0:
            raise ValueError(f"--answer-temperature must be > 0, got {args.answer_temperature}")
        parts.append(load_or_generate(model, tok, args.sampled_prompts, seed=args.seed + 1,
                                      temperature=args.answer_temperature, **kw))
    if args.written_prompts > 0:
        parts.append(load_or_generate(model, tok, args.written_prompts, seed=args.seed + 2, written=True, **kw))
    return concat(parts)


def split_sequences(seq_start: torch.Tensor, held_out: float, seed: int) -> tuple[list[int], list[int]]:
    """(train sequences, held-out sequences): a seeded split of whole sequences."""
    S = seq_start.shape[0] - 1
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(seed)).tolist()
    n_held = max(1, int(round(S * held_out))) if S > 1 else 0
    return sorted(perm[n_held:]), sorted(perm[:n_held])


def sequence_rows(seq_start: torch.Tensor, seqs: list[int]) -> torch.Tensor:
    """int64: the rows of sequences ``seqs`` (in that order)."""
    parts = [torch.arange(int(seq_start[s]), int(seq_start[s + 1])) for s in seqs]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def main(argv=None) -> int:
    """``python -m specdec_kernels.training.distill_data --num-prompts N``: generate and cache."""
    import argparse

    p = argparse.ArgumentParser(description="generate (and cache) self-distillation data")
    p.add_argument("--model", default="smollm2-135m")
    add_data_arguments(p, num_prompts=384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    from ..models import load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    t0 = time.perf_counter()
    data = load_training_data(model, tok, args)
    print(f"{data['tokens'].shape[0]} positions in {data['seq_start'].shape[0] - 1} sequences "
          f"({time.perf_counter() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
