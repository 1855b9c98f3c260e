"""Helpers shared by the test modules (test modules import this, never each other).

- ``requires_triton``: skip marker for tests that need Triton;
- ``guarded`` / ``assert_guard_intact``: tensors in poisoned storage, to catch kernels that
  read or write outside their arguments;
- ``make_chain_inputs`` / ``make_tree_inputs`` (+ ``chain_args`` / ``tree_args``): random
  rejection-sampling inputs whose drafts are often accepted; ``assert_same``;
- ``backend_op`` / ``run_guarded``: a kernel (C++ or Triton) run with every tensor guarded,
  its inputs checked unchanged;
- ``real_model`` / ``require_real_model``: the marker and the skip of tests on a real
  checkpoint (tests/conftest.py turns their skips into failures under ``CI=true``);
- ``exact_joint_probs`` / ``joint_chisquare_pvalue``: the decode loop's sampled output
  against the target's exact distribution of its first tokens;
- ``assert_cpu_paths_agree``: a script's results on the default, AVX2 and portable CPU
  kernel paths (one process each) are bit-identical.

tests/conftest.py sets TRITON_INTERPRET before anything imports triton.
"""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specdec_kernels
from specdec_kernels import _platform

requires_triton = pytest.mark.skipif(
    not specdec_kernels.HAS_TRITON, reason="triton is not installed (pip install triton)"
)


# ---------------------------------------------------------------------------------------
# Tests on a real checkpoint: one marker, one way to skip, and CI runs them all.
# ---------------------------------------------------------------------------------------

# Every real-model skip's reason starts with this; tests/conftest.py turns a real-model test's
# skip (a test marked ``real_model``, or any skip with this reason) into a failure when
# CI=true, so that CI cannot pass without having run them.
REAL_MODEL_SKIP = "real model not available"
real_model = pytest.mark.real_model


def require_real_model(name: str = "smollm2-135m") -> str:
    """The path of the registered checkpoint ``name``; skips the test (reason starting with
    REAL_MODEL_SKIP) when it is not installed (only the registry's FileNotFoundError: any other
    error is the test's) or when SPECDEC_SKIP_REAL_MODEL=1."""
    from specdec_kernels.models import registry

    if os.environ.get("SPECDEC_SKIP_REAL_MODEL") == "1":
        pytest.skip(f"{REAL_MODEL_SKIP}: SPECDEC_SKIP_REAL_MODEL=1")
    try:
        return registry.resolve(name)
    except FileNotFoundError as e:
        pytest.skip(f"{REAL_MODEL_SKIP}: {e}")


# ---------------------------------------------------------------------------------------
# Guarded storage: catches reads and writes outside a tensor.
# ---------------------------------------------------------------------------------------

GUARD_ELEMENTS = 4096


def _poison(dtype, count):
    """Values a kernel must never see: for floats NaN, +-inf, huge and ordinary numbers mixed
    (a uniform fill can be hidden by a fallback path, a mix changes results); for integers
    ids far out of range, -1 and 0 mixed."""
    gen = torch.Generator().manual_seed(1234)
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=gen).bool()
    if dtype.is_floating_point:
        pool = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.5, -3.0, 7.0])
        return pool[torch.randint(0, len(pool), (count,), generator=gen)].to(dtype)
    info = torch.iinfo(dtype)
    pool = torch.tensor([info.max, info.min, -1, 0, 1, 3, info.max // 2], dtype=torch.int64)
    return pool[torch.randint(0, len(pool), (count,), generator=gen)].to(dtype)


def guarded(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in the middle of a larger buffer filled with poison
    (GUARD_ELEMENTS on each side). A kernel that reads outside ``t`` sees the poison and
    (with the right inputs) gives a different result; one that writes outside changes the
    guard, which ``assert_guard_intact`` checks."""
    t = t.contiguous()
    n = t.numel()
    buf = _poison(t.dtype, n + 2 * GUARD_ELEMENTS)
    view = buf[GUARD_ELEMENTS:GUARD_ELEMENTS + n].view(t.shape)
    view.copy_(t)
    return view


def assert_guard_intact(view: torch.Tensor) -> None:
    """The poison around a tensor made by ``guarded`` is unchanged (nothing wrote outside it)."""
    buf = view._base
    assert buf is not None, "not a guarded tensor"
    n = view.numel()
    expected = _poison(view.dtype, n + 2 * GUARD_ELEMENTS)
    for name, sl in (("before", slice(0, GUARD_ELEMENTS)), ("after", slice(GUARD_ELEMENTS + n, None))):
        got, want = buf[sl], expected[sl]
        same = (got == want) | (got.isnan() & want.isnan()) if got.is_floating_point() else got == want
        assert bool(same.all()), f"the kernel wrote {name} the tensor (outside its storage)"


# ---------------------------------------------------------------------------------------
# Rejection-sampling inputs.
# ---------------------------------------------------------------------------------------


def make_chain_inputs(batch, max_drafts, vocab, *, dtype=torch.float32, with_q=True, greedy_mask=None, gen=None,
                      sharpness=3.0, num_drafts=None):
    """Random chain inputs whose drafts are drawn from q (so acceptances are frequent)."""
    gen = gen or torch.Generator().manual_seed(0)
    logits = (torch.randn(batch, max_drafts + 1, vocab, generator=gen) * sharpness).to(dtype)
    q = torch.softmax(torch.randn(batch, max(max_drafts, 1), vocab, generator=gen) * sharpness, dim=-1)[:, :max_drafts]
    # Make the draft close to the target on some rows so that chains get accepted.
    q = 0.5 * q + 0.5 * torch.softmax(logits[:, :max_drafts].float(), dim=-1)
    q = q / q.sum(-1, keepdim=True)
    if max_drafts > 0:
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, max_drafts)
    else:
        drafts = torch.zeros(batch, 0, dtype=torch.int64)
    if num_drafts is None:
        num_drafts = torch.randint(0, max_drafts + 1, (batch,), generator=gen, dtype=torch.int32)
    temperature = torch.rand(batch, generator=gen) + 0.5
    if greedy_mask is not None:
        temperature[greedy_mask] = 0.0
    seed = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    offset = torch.randint(0, 2**40, (batch,), generator=gen)
    return dict(draft_token_ids=drafts, num_draft_tokens=num_drafts.to(torch.int32), target_logits=logits,
                draft_probs=q.contiguous() if with_q else None, temperature=temperature, seed=seed, offset=offset)


def chain_args(inp):
    return (inp["draft_token_ids"], inp["num_draft_tokens"], inp["target_logits"], inp["draft_probs"],
            inp["temperature"], inp["seed"], inp["offset"])


def random_parents(num_nodes, gen, max_nodes=None):
    max_nodes = max_nodes or num_nodes
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]
    return parents + [-1] * (max_nodes - num_nodes)


def make_tree_inputs(batch, max_nodes, vocab, *, dtype=torch.float32, with_q=True, greedy_mask=None, gen=None,
                     sharpness=3.0):
    gen = gen or torch.Generator().manual_seed(0)
    num_nodes = torch.randint(1, max_nodes + 1, (batch,), generator=gen, dtype=torch.int32)
    parents = torch.tensor([random_parents(int(n), gen, max_nodes) for n in num_nodes], dtype=torch.int32)
    logits = (torch.randn(batch, max_nodes, vocab, generator=gen) * sharpness).to(dtype)
    q = torch.softmax(torch.randn(batch, max_nodes, vocab, generator=gen) * sharpness, dim=-1)
    q = 0.5 * q + 0.5 * torch.softmax(logits.float(), dim=-1)
    q = q / q.sum(-1, keepdim=True)
    tokens = torch.zeros(batch, max_nodes, dtype=torch.int64)
    for b in range(batch):
        for i in range(1, int(num_nodes[b])):
            tokens[b, i] = int(torch.multinomial(q[b, int(parents[b, i])], 1, generator=gen))
    temperature = torch.rand(batch, generator=gen) + 0.5
    if greedy_mask is not None:
        temperature[greedy_mask] = 0.0
    seed = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    offset = torch.randint(0, 2**40, (batch,), generator=gen)
    return dict(parents=parents, tree_token_ids=tokens, num_nodes=num_nodes, target_logits=logits,
                draft_probs=q if with_q else None, temperature=temperature, seed=seed, offset=offset)


def tree_args(inp):
    return (inp["parents"], inp["tree_token_ids"], inp["num_nodes"], inp["target_logits"], inp["draft_probs"],
            inp["temperature"], inp["seed"], inp["offset"])


def assert_same(got, expected, case=None):
    """``got`` and ``expected`` — each a tensor or a sequence of tensors, of the same length —
    hold the same values: same shapes and dtypes, equal elements, NaN where the other has NaN
    (``case``: the inputs, for the message)."""
    if isinstance(got, torch.Tensor) or isinstance(expected, torch.Tensor):
        got, expected = [got], [expected]
    got, expected = list(got), list(expected)
    assert len(got) == len(expected), f"got {len(got)} outputs, expected {len(expected)}; case {case}"
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape and g.dtype == e.dtype, (
            f"output {i}: got {g.dtype} {list(g.shape)}, expected {e.dtype} {list(e.shape)}; case {case}")
        same = (g == e) | (g.isnan() & e.isnan()) if g.is_floating_point() else g == e
        assert bool(same.all()), f"output {i}:\ngot      {g}\nexpected {e}\ncase {case}"


def backend_op(backend: str, name: str, triton_module: str):
    """The kernel a fuzz test runs: ``torch.ops.specdec.<name>`` for "cpu", else the Triton
    launcher ``specdec_kernels.triton.<triton_module>.<name>`` (same arguments)."""
    if backend == "cpu":
        return getattr(torch.ops.specdec, name)
    import importlib

    return getattr(importlib.import_module(f"specdec_kernels.triton.{triton_module}"), name)


def _unchanged(t: torch.Tensor, before: torch.Tensor) -> bool:
    if t.is_floating_point():
        return bool(((t == before) | (t.isnan() & before.isnan())).all())
    return torch.equal(t, before)


def run_guarded(launch, inputs: list, outputs: list) -> tuple:
    """``launch(*inputs, *outputs)`` with every tensor in guarded storage (``guarded``); checks
    that nothing but the outputs changed — the guards around every tensor, the inputs'
    values — and returns copies of the outputs. Non-tensor inputs (None, numbers) are passed
    as they are, and so is a non-contiguous input tensor (a strided view under test: checked
    unchanged, not guarded)."""
    is_guarded = [isinstance(t, torch.Tensor) and t.is_contiguous() for t in inputs]
    inputs = [guarded(t) if g else t for t, g in zip(inputs, is_guarded)]
    before = [t.clone() if isinstance(t, torch.Tensor) else None for t in inputs]
    outs = [guarded(t) for t in outputs]
    launch(*inputs, *outs)
    for t in outs:
        assert_guard_intact(t)
    for i, (t, b, g) in enumerate(zip(inputs, before, is_guarded)):
        if g:
            assert_guard_intact(t)
        if b is not None:
            assert _unchanged(t, b), f"input {i} was modified"
    return tuple(o.clone() for o in outs)


# ---------------------------------------------------------------------------------------
# Decode-loop distribution tests: the target's exact joint distribution of its first tokens.
# ---------------------------------------------------------------------------------------


def exact_joint_probs(model, temperature, prompt, length: int = 2, top_k: int = 0, top_p: float = 1.0):
    """fp64 [V] * length: P(first ``length`` sampled tokens = (a, b, ...)) of ``model`` after
    ``prompt`` at ``temperature``, with the sampler's top-k / top-p filtering (exact: one
    forward per prefix of positive probability)."""
    from specdec_kernels import ops

    def probs(ids):
        cache = model.new_cache(1, 16, block_size=16)
        slot = cache.add_request(len(ids))
        logits = model.logits(model.prefill(torch.tensor(ids), cache, slot))[-1:] / temperature
        if top_k or top_p < 1:
            logits = ops.apply_top_k_top_p(logits.contiguous(), torch.tensor([top_k], dtype=torch.int32),
                                           torch.tensor([top_p]))
        return logits[0].softmax(-1).double()

    def joint(prefix, n):
        p = probs(list(prompt) + prefix)
        if n == 1:
            return p
        rest = (p.shape[0],) * (n - 1)
        return torch.stack([p[a] * joint(prefix + [a], n - 1) if p[a] > 0 else torch.zeros(rest, dtype=p.dtype)
                            for a in range(p.shape[0])])

    return joint([], length)


def joint_chisquare_pvalue(samples, joint):
    """Chi-square p-value of sampled token tuples against ``joint`` [V] * len(tuple) (cells
    expecting fewer than 5 counts pooled into one). Asserts first that no sample fell in a cell
    of probability 0, which a p-value would not show."""
    from scipy.stats import chisquare

    n = len(samples)
    counts = torch.zeros_like(joint)
    for s in samples:
        counts[tuple(s)] += 1
    joint, counts = joint.flatten(), counts.flatten()
    assert counts[joint == 0].sum() == 0, "sampled a token sequence of probability 0"
    keep = joint * n >= 5
    f_obs, f_exp = counts[keep], joint[keep] * n
    if joint[~keep].sum() > 0:
        f_obs = torch.cat([f_obs, counts[~keep].sum()[None]])
        f_exp = torch.cat([f_exp, (joint[~keep] * n).sum()[None]])
    return chisquare(f_obs.numpy(), f_exp.numpy() * f_obs.sum().item() / f_exp.sum().item())[1]


# ---------------------------------------------------------------------------------------
# The CPU kernels' ISA paths give the same bits.
# ---------------------------------------------------------------------------------------

def cpu_flags() -> set | None:
    """The x86-64 CPU flags /proc/cpuinfo lists, or None when it cannot be read (or elsewhere)."""
    return _platform.cpu_flags() if platform.machine() == "x86_64" else None


def assert_cpu_paths_agree(script: str, tmp_path) -> None:
    """Runs ``script`` (Python source: ``{root}`` is replaced by the repository root; it saves a
    dict of tensors to sys.argv[1]) in four processes — the default path (AMX tiles where the
    CPU has them), AMX off (SPECDEC_DISABLE_AMX=1: AVX-512 VNNI), AVX2 forced
    (SPECDEC_DISABLE_AVX512=1) and the portable loops (SPECDEC_QUANTIZED_LINEAR_PORTABLE=1) —
    and asserts that every tensor is bit-identical across them."""
    root = str(Path(__file__).resolve().parent.parent)
    path = tmp_path / "paths.py"
    path.write_text(script.format(root=root))
    results = {}
    switches = ("SPECDEC_DISABLE_AMX", "SPECDEC_DISABLE_AVX512", "SPECDEC_QUANTIZED_LINEAR_PORTABLE")
    paths = [("default", {}), ("no-amx", {"SPECDEC_DISABLE_AMX": "1"}), ("avx2", {"SPECDEC_DISABLE_AVX512": "1"}),
             ("portable", {"SPECDEC_QUANTIZED_LINEAR_PORTABLE": "1"})]
    for label, env in paths:
        out = tmp_path / f"{label}.pt"
        full_env = {k: v for k, v in os.environ.items() if k not in switches}
        proc = subprocess.run([sys.executable, str(path), str(out)], env={**full_env, **env}, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        results[label] = torch.load(out)
    for label in ("no-amx", "avx2", "portable"):
        for key, want in results["default"].items():
            assert torch.equal(results[label][key], want), (label, key)
