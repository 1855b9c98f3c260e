"""The C++ CPU rejection sampler's internal paths (csrc/cpu/rejection_sampling_race.cpp):

- rows the walk does not reach are checked for validity inside the race, tile by tile;
- the race skips the log of entries that the bound -log(u) >= 1 - u rules out, which must
  not change any winner (checked against python_ref on rows with weights spanning the
  whole fp32 range, where the pruning's guards for tiny weights matter);
- the AVX2 kernels (forced with SPECDEC_DISABLE_AVX512=1) give the same tokens as the
  AVX-512 ones.
"""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from python_ref import rejection_sampling as ref
from specdec_kernels import ops
from specdec_kernels._platform import cpu_flags
from tests.helpers import assert_same, chain_args, make_chain_inputs, make_tree_inputs, tree_args

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("where", ["first", "chunk_edge", "tile_edge", "last"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_invalid_rows_the_walk_does_not_reach(where, bad):
    """Requests that reject at row 0 never reach rows 1..n; a NaN / +inf anywhere in them
    (including at the chunk and race-tile boundaries) still makes the request -1."""
    vocab = 16384 + 1030  # two race tiles, the second one spans two chunks
    col = {"first": 0, "chunk_edge": 1023, "tile_edge": 16384, "last": vocab - 1}[where]
    gen = torch.Generator().manual_seed(1)
    inp = make_chain_inputs(4, 3, vocab, gen=gen, num_drafts=torch.tensor([3, 3, 1, 3]))
    inp["draft_token_ids"][:] = torch.argmin(inp["target_logits"][:, :3], dim=-1)  # p(x) ~ 0: rejected
    inp["target_logits"][0, 2, col] = bad  # unreached row in use
    inp["target_logits"][1, 3, col] = bad  # unreached bonus row in use
    inp["target_logits"][2, 3, col] = bad  # row beyond num_draft_tokens: ignored
    inp["target_logits"][3, 1:, :] = float("-inf")  # unreached rows that are all -inf
    out, acc = ops.chain_rejection_sample(*chain_args(inp))
    assert acc.tolist() == [-1, -1, 0, -1]
    assert (out[[0, 1, 3]] == -1).all() and out[2, 0] >= 0
    assert_same((out, acc), ref.chain_rejection_sample(*chain_args(inp)))


def test_invalid_row_reached_by_the_walk():
    """A row the walk reaches after an acceptance gets its statistics lazily; a NaN there
    also gives -1 (p = q makes every draft accepted)."""
    logits = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2))
    q = torch.softmax(logits[:, :2], dim=-1)
    drafts = torch.tensor([[5, 7], [5, 7]])
    logits[0, 1, 9] = float("nan")
    args = (drafts, torch.tensor([2, 2], dtype=torch.int32), logits, q, torch.ones(2), torch.tensor([3, 4]),
            torch.zeros(2, dtype=torch.int64))
    out, acc = ops.chain_rejection_sample(*args)
    assert acc.tolist() == [-1, 2]
    assert_same((out, acc), ref.chain_rejection_sample(*args))


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_pruned_race_matches_reference_on_extreme_weights(with_q, kind):
    """Logits with a spread of hundreds at a low temperature: most weights underflow or
    are below 2^-100 (never pruned), a few dominate; top-k masking leaves rows mostly
    zero. Every token must match the reference's unpruned race."""
    gen = torch.Generator().manual_seed(3)
    vocab = 3000
    if kind == "chain":
        inp = make_chain_inputs(6, 2, vocab, gen=gen, with_q=with_q, sharpness=60.0)
        inp["temperature"] = torch.tensor([0.3, 0.7, 1.0, 2.0, 0.05, 1.0])
        logits, call, reference = inp["target_logits"], ops.chain_rejection_sample, ref.chain_rejection_sample
        args = chain_args
    else:
        inp = make_tree_inputs(6, 4, vocab, gen=gen, with_q=with_q, sharpness=60.0)
        inp["temperature"] = torch.tensor([0.3, 0.7, 1.0, 2.0, 0.05, 1.0])
        logits, call, reference = inp["target_logits"], ops.tree_rejection_sample, ref.tree_rejection_sample
        args = tree_args
    # Request 5: top-50 masking (mostly zero weights, compacted races).
    kth = logits[5].topk(50, dim=-1).values[:, -1:]
    logits[5] = logits[5].masked_fill(logits[5] < kth, float("-inf"))
    for offset in range(3):
        inp["offset"] = torch.full((6,), offset * 7, dtype=torch.int64)
        assert_same(call(*args(inp)), reference(*args(inp)))


_SUBPROCESS = """
import sys, torch
sys.path.insert(0, {root!r})
from specdec_kernels import ops
from tests.helpers import chain_args, make_chain_inputs, make_tree_inputs, tree_args
torch.set_num_threads(1)
outs = []
for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16]):
    gen = torch.Generator().manual_seed(10 + i)
    inp = make_chain_inputs(5, 3, 20000 + 37 * i, gen=gen, dtype=dtype, with_q=i != 1)
    outs.append(ops.chain_rejection_sample(*chain_args(inp)))
    inp = make_tree_inputs(4, 5, 3001, gen=gen, dtype=dtype, with_q=i != 2)
    outs.append(ops.tree_rejection_sample(*tree_args(inp)))
torch.save(outs, sys.argv[1])
"""


# What cpu_has_avx512() in csrc/cpu/philox_simd.h requires for the AVX-512 kernels.
AVX512_FEATURES = ("avx512f", "avx512vl", "avx512dq", "avx512bw")


def missing_avx512_features(cpuinfo: str = "/proc/cpuinfo") -> list[str] | None:
    """The AVX512_FEATURES this CPU lacks, or None when it cannot be told (no cpuinfo flags)."""
    flags = cpu_flags(cpuinfo) if platform.machine() == "x86_64" else None
    return None if flags is None else [feat for feat in AVX512_FEATURES if feat not in flags]


def test_avx2_kernels_match_the_default_ones(tmp_path):
    """The same cases in two processes, one with the AVX2 kernels forced."""
    missing = missing_avx512_features()
    if missing is None:
        pytest.skip("cannot tell whether this CPU has AVX-512 (no x86-64 /proc/cpuinfo flags): "
                    "the default kernels may be the AVX2 ones")
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}: the default kernels are the AVX2 ones, "
                    f"so both processes would run AVX2 and the comparison would test nothing")
    code = _SUBPROCESS.format(root=str(ROOT))
    results = []
    for flag in ["0", "1"]:
        path = tmp_path / f"out{flag}.pt"
        env = dict(os.environ, SPECDEC_DISABLE_AVX512=flag)
        subprocess.run([sys.executable, "-c", code, str(path)], check=True, cwd=ROOT, env=env)
        results.append(torch.load(path))
    for default, avx2 in zip(*results):
        assert_same(avx2, default)
