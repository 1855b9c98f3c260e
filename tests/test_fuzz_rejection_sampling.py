"""Fuzzing chain_rejection_sample, tree_rejection_sample and apply_top_k_top_p.

Valid inputs (batch and sizes including 0 and 1, ragged counts, extreme / tied / -inf /
NaN / +inf logits, every kind of temperature, duplicate drafts, trees of every shape, any
seed and offset) must give python_ref's tokens exactly, on the C++ kernels and the Triton
kernels (interpreter), with every tensor in guarded storage (nothing read or written
outside it). Invalid inputs (wrong dtype, shape, device, layout, out-of-range ids, counts
and parents, non-finite draft probabilities, outputs aliasing inputs) must raise a clear
error or give the documented result, never crash. Budget: tests/fuzzing.py.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import specdec_kernels  # noqa: F401  (registers the ops)
from python_ref import rejection_sampling as ref
from specdec_kernels import ops
from tests.helpers import assert_same, requires_triton, run_guarded
from tests.fuzzing import call_or_clear_error, fuzz_settings

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Logit rows: ordinary, very sharp, tied (small integers), extreme magnitudes, partly -inf,
# one-hot (-inf but one entry), and the rows that make a request invalid (-1).
ROW_KINDS = ["normal", "normal", "sharp", "ties", "ties", "extreme", "some_neg_inf", "one_hot", "all_neg_inf", "nan",
             "pos_inf"]
# Temperatures: greedy ones (0, negative, NaN, below 2^-64), the smallest sampled one, and up.
TEMPERATURES = [0.0, -1.0, float("nan"), 1e-45, 1e-38, 1e-30, 2.0**-64 * 0.99, 2.0**-64, 1e-19, 1e-3, 0.3, 1.0,
                1.0, 2.5, 1e30, float("inf")]
SEEDS = st.sampled_from([0, -1, 2**63 - 1, -(2**63), 12345]) | st.integers(-(2**63), 2**63 - 1)
OFFSETS = st.sampled_from([0, 2**32 - 1, 2**63 - 2, -(2**63), -5]) | st.integers(-(2**63), 2**63 - 1)


def logit_row(kind: str, vocab: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(vocab, generator=gen) * 3
    if kind == "sharp":
        return torch.randn(vocab, generator=gen) * 60
    if kind == "ties":
        return torch.randint(-2, 3, (vocab,), generator=gen).float()
    if kind == "extreme":
        pool = torch.tensor([3e38, -3e38, 1e30, -1e30, 1e20, 0.0, 1e-38, -1e-45, 88.0, -88.0])
        return pool[torch.randint(0, len(pool), (vocab,), generator=gen)]
    if kind == "some_neg_inf":
        row = torch.randn(vocab, generator=gen)
        row[torch.rand(vocab, generator=gen) < 0.6] = -math.inf
        row[int(torch.randint(0, vocab, (1,), generator=gen))] = 1.0
        return row
    if kind == "one_hot":
        row = torch.full((vocab,), -math.inf)
        row[int(torch.randint(0, vocab, (1,), generator=gen))] = 0.0
        return row
    if kind == "all_neg_inf":
        return torch.full((vocab,), -math.inf)
    row = torch.randn(vocab, generator=gen)
    row[int(torch.randint(0, vocab, (1,), generator=gen))] = math.nan if kind == "nan" else math.inf
    return row


def draft_distribution(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 [rows, vocab] distributions, some entries exactly 0."""
    q = torch.softmax(torch.randn(rows, vocab, generator=gen) * 3, dim=-1)
    q[torch.rand(rows, vocab, generator=gen) < 0.2] = 0.0
    q[:, 0] += 1e-3  # no all-zero row
    return q / q.sum(-1, keepdim=True)


@st.composite
def sampling_common(draw, batch, rows, vocab, row_kinds, temperatures):
    """(kinds per row, temperatures, seeds, offsets, dtype, with_q, generator seed)."""
    kinds = draw(st.lists(st.sampled_from(row_kinds), min_size=batch * rows, max_size=batch * rows))
    temps = draw(st.lists(st.sampled_from(temperatures), min_size=batch, max_size=batch))
    seeds = draw(st.lists(SEEDS, min_size=batch, max_size=batch))
    offsets = draw(st.lists(OFFSETS, min_size=batch, max_size=batch))
    return kinds, temps, seeds, offsets, draw(st.sampled_from(DTYPES)), draw(st.booleans()), draw(st.integers(0, 2**31))


def make_logits(kinds, batch, rows, vocab, dtype, gen):
    rows_list = [logit_row(kind, vocab, gen) for kind in kinds]
    logits = torch.stack(rows_list).reshape(batch, rows, vocab) if rows_list else torch.zeros(batch, rows, vocab)
    return logits.to(dtype)


@st.composite
def chain_cases(draw, max_batch=4, max_drafts=6, vocabs=(1, 2, 3, 17, 64, 100, 1030, 2049), min_batch=0,
                min_drafts=0, row_kinds=ROW_KINDS, temperatures=TEMPERATURES,
                draft_modes=("from_q", "argmax", "random", "same")):
    batch = draw(st.integers(min_batch, max_batch))
    k = draw(st.integers(min_drafts, max_drafts))
    vocab = draw(st.sampled_from(vocabs))
    kinds, temps, seeds, offsets, dtype, with_q, gseed = draw(
        sampling_common(batch, k + 1, vocab, row_kinds, temperatures))
    num_drafts = draw(st.lists(st.integers(0, k), min_size=batch, max_size=batch))
    draft_mode = draw(st.sampled_from(draft_modes))
    gen = torch.Generator().manual_seed(gseed)
    logits = make_logits(kinds, batch, k + 1, vocab, dtype, gen)
    q = draft_distribution(batch * k, vocab, gen).reshape(batch, k, vocab)
    if draft_mode == "from_q" and batch * k > 0:
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    elif draft_mode == "argmax":
        drafts = logits[:, :k].float().nan_to_num(0.0).argmax(-1) if k > 0 else torch.zeros(batch, 0, dtype=torch.int64)
    elif draft_mode == "same":
        drafts = torch.full((batch, k), int(torch.randint(0, vocab, (1,), generator=gen)), dtype=torch.int64)
    else:
        drafts = torch.randint(0, vocab, (batch, k), generator=gen)
    return dict(draft_token_ids=drafts.to(torch.int64).contiguous(),
                num_draft_tokens=torch.tensor(num_drafts, dtype=torch.int32),
                target_logits=logits, draft_probs=q if with_q else None,
                temperature=torch.tensor(temps, dtype=torch.float32), seed=torch.tensor(seeds, dtype=torch.int64),
                offset=torch.tensor(offsets, dtype=torch.int64))


def tree_parents(shape: str, n: int, gen: torch.Generator) -> list[int]:
    if shape == "chain":
        return [-1] + list(range(n - 1))
    if shape == "star":
        return [-1] + [0] * (n - 1)
    if shape == "binary":
        return [-1] + [(i - 1) // 2 for i in range(1, n)]
    if shape == "deep_last":  # a chain hanging off the last child of a star
        half = n // 2
        return [-1] + [0] * half + list(range(half, n - 1))[: n - 1 - half]
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


@st.composite
def tree_cases(draw, max_batch=4, max_nodes=10, vocabs=(1, 2, 3, 17, 64, 100, 1030), min_batch=0, min_nodes=1,
               row_kinds=ROW_KINDS, temperatures=TEMPERATURES,
               token_modes=("from_q", "argmax", "random", "duplicates")):
    batch = draw(st.integers(min_batch, max_batch))
    n_max = draw(st.integers(min_nodes, max_nodes))
    vocab = draw(st.sampled_from(vocabs))
    kinds, temps, seeds, offsets, dtype, with_q, gseed = draw(
        sampling_common(batch, n_max, vocab, row_kinds, temperatures))
    num_nodes = draw(st.lists(st.integers(min(2, n_max), n_max) if min_nodes > 1 else st.integers(0, n_max),
                              min_size=batch, max_size=batch))
    shapes = draw(st.lists(st.sampled_from(["random", "chain", "star", "binary", "deep_last"]),
                           min_size=batch, max_size=batch))
    token_mode = draw(st.sampled_from(token_modes))
    gen = torch.Generator().manual_seed(gseed)
    logits = make_logits(kinds, batch, n_max, vocab, dtype, gen)
    q = draft_distribution(batch * n_max, vocab, gen).reshape(batch, n_max, vocab)
    parents = torch.full((batch, n_max), -1, dtype=torch.int32)
    tokens = torch.zeros(batch, n_max, dtype=torch.int64)
    for b in range(batch):
        n = num_nodes[b]
        par = tree_parents(shapes[b], n, gen)
        parents[b, :n] = torch.tensor(par, dtype=torch.int32)
        # Padding beyond num_nodes is never read: fill it with garbage.
        parents[b, n:] = torch.randint(-5, n_max + 5, (n_max - n,), generator=gen, dtype=torch.int32)
        tokens[b, n:] = torch.randint(-5, vocab + 5, (n_max - n,), generator=gen)
        tokens[b, 0] = int(torch.randint(-5, vocab + 5, (1,), generator=gen))  # the root's token is not read
        for i in range(1, n):
            p = par[i]
            if token_mode == "from_q":
                tokens[b, i] = int(torch.multinomial(q[b, p], 1, generator=gen))
            elif token_mode == "argmax":
                tokens[b, i] = int(logits[b, p].float().nan_to_num(0.0).argmax())
            elif token_mode == "duplicates":
                tokens[b, i] = int(torch.randint(0, min(vocab, 2), (1,), generator=gen))
            else:
                tokens[b, i] = int(torch.randint(0, vocab, (1,), generator=gen))
    return dict(parents=parents, tree_token_ids=tokens, num_nodes=torch.tensor(num_nodes, dtype=torch.int32),
                target_logits=logits, draft_probs=q if with_q else None,
                temperature=torch.tensor(temps, dtype=torch.float32), seed=torch.tensor(seeds, dtype=torch.int64),
                offset=torch.tensor(offsets, dtype=torch.int64))


CHAIN_INPUTS = ["draft_token_ids", "num_draft_tokens", "target_logits", "draft_probs", "temperature", "seed", "offset"]
TREE_INPUTS = ["parents", "tree_token_ids", "num_nodes", "target_logits", "draft_probs", "temperature", "seed",
               "offset"]


def chain_outputs(case):
    batch, k = case["draft_token_ids"].shape
    return dict(output_token_ids=torch.full((batch, k + 1), 7, dtype=torch.int64),
                num_accepted=torch.full((batch,), 7, dtype=torch.int32))


def tree_outputs(case):
    batch, n = case["parents"].shape
    return dict(accepted_nodes=torch.full((batch, n - 1), 7, dtype=torch.int32),
                output_token_ids=torch.full((batch, n), 7, dtype=torch.int64),
                num_accepted=torch.full((batch,), 7, dtype=torch.int32))


def run_case(launch, case, input_names, outputs):
    """``launch`` on the case's ``input_names`` and the ``outputs`` dict's tensors, in guarded
    storage (tests.helpers.run_guarded); returns copies of the outputs."""
    return run_guarded(launch, [case[n] for n in input_names], list(outputs.values()))


def triton_rs():
    from specdec_kernels.triton import rejection_sampling

    return rejection_sampling


# ---------------------------------------------------------------------------------------
# Valid inputs against python_ref.
# ---------------------------------------------------------------------------------------


@fuzz_settings(40)
@given(case=chain_cases())
def test_chain_cpu_matches_reference(case):
    expected = ref.chain_rejection_sample(*(case[n] for n in CHAIN_INPUTS))
    got = run_case(torch.ops.specdec.chain_rejection_sample, case, CHAIN_INPUTS, chain_outputs(case))
    assert_same(got, expected, case)
    assert_same(ops.chain_rejection_sample(*(case[n] for n in CHAIN_INPUTS)), expected, case)


@fuzz_settings(40)
@given(case=tree_cases())
def test_tree_cpu_matches_reference(case):
    expected = ref.tree_rejection_sample(*(case[n] for n in TREE_INPUTS))
    got = run_case(torch.ops.specdec.tree_rejection_sample, case, TREE_INPUTS, tree_outputs(case))
    assert_same(got, expected, case)


@requires_triton
@fuzz_settings(5)
@given(case=chain_cases(max_batch=2, max_drafts=3, vocabs=(1, 2, 17, 1030)))
def test_chain_triton_matches_reference(case):
    expected = ref.chain_rejection_sample(*(case[n] for n in CHAIN_INPUTS))
    got = run_case(triton_rs().chain_rejection_sample, case, CHAIN_INPUTS, chain_outputs(case))
    assert_same(got, expected, case)


@requires_triton
@fuzz_settings(5)
@given(case=tree_cases(max_batch=2, max_nodes=5, vocabs=(1, 3, 17)))
def test_tree_triton_matches_reference(case):
    expected = ref.tree_rejection_sample(*(case[n] for n in TREE_INPUTS))
    got = run_case(triton_rs().tree_rejection_sample, case, TREE_INPUTS, tree_outputs(case))
    assert_same(got, expected, case)


# ---------------------------------------------------------------------------------------
# Invalid inputs.
# ---------------------------------------------------------------------------------------


def check_chain_structure(out, acc, case, num_drafts):
    """What any call must return: per request -1 everywhere, or a prefix of its drafts of
    length num_accepted <= num_drafts, one token in [0, V), then -1."""
    vocab = case["target_logits"].shape[2]
    for b in range(out.shape[0]):
        a = int(acc[b])
        if a == -1:
            assert (out[b] == -1).all()
            continue
        assert 0 <= a <= num_drafts[b]
        assert torch.equal(out[b, :a], case["draft_token_ids"][b, :a])
        assert 0 <= int(out[b, a]) < vocab
        assert (out[b, a + 1:] == -1).all()


def check_tree_structure(nodes, out, acc, case, num_nodes):
    """Per request: -1 everywhere; or (num_nodes 0) nothing; or a root path of nodes
    < num_nodes whose parents are valid, their tokens, one token in [0, V), then -1."""
    vocab = case["target_logits"].shape[2]
    parents, tokens = case["parents"], case["tree_token_ids"]
    for b in range(out.shape[0]):
        a = int(acc[b])
        if a == -1 or num_nodes[b] == 0:
            assert a == -1 or a == 0
            assert (out[b] == -1).all() and (nodes[b] == -1).all()
            continue
        assert a >= 0
        previous = 0
        for i in range(a):
            node = int(nodes[b, i])
            assert previous < node < num_nodes[b] and int(parents[b, node]) == previous
            assert int(out[b, i]) == int(tokens[b, node]) and 0 <= int(out[b, i]) < vocab
            previous = node
        assert 0 <= int(out[b, a]) < vocab
        assert (out[b, a + 1:] == -1).all() and (nodes[b, a:] == -1).all()


# Small valid cases in which most requests accept drafts (valid rows, drafts the target
# likes, greedy or moderate temperatures), so that a fault changes the outcome.
FRIENDLY_ROWS = ["normal", "sharp", "ties"]
FRIENDLY_TEMPERATURES = [0.0, 0.0, 0.5, 1.0]


def chain_base(draw):
    return draw(chain_cases(min_batch=1, max_batch=3, min_drafts=1, max_drafts=4, vocabs=(3, 17),
                            row_kinds=FRIENDLY_ROWS, temperatures=FRIENDLY_TEMPERATURES,
                            draft_modes=("argmax", "argmax", "from_q")))


def tree_base(draw):
    return draw(tree_cases(min_batch=1, max_batch=3, min_nodes=2, max_nodes=6, vocabs=(3, 17),
                           row_kinds=FRIENDLY_ROWS, temperatures=FRIENDLY_TEMPERATURES,
                           token_modes=("argmax", "argmax", "from_q")))


# Argument mutations that only the checks see (shape, dtype, device, layout of an input or
# an output): every backend must raise a clear error naming the argument.
def bad_layout_mutations(names, outputs):
    def retype(name, dtype):
        return lambda c, o: ({**c, name: c[name].to(dtype)}, o) if c[name] is not None else (c, o)

    def meta(name):
        return lambda c, o: ({**c, name: c[name].to("meta")}, o) if c[name] is not None else (c, o)

    def add_dim(name):
        return lambda c, o: ({**c, name: c[name].unsqueeze(0)}, o) if c[name] is not None else (c, o)

    def grow(name):  # one more request than the others
        return lambda c, o: ({**c, name: torch.cat([c[name], c[name][:1]])}, o) if c[name] is not None else (c, o)

    def bad_out(name, how):
        def mutate(c, o):
            t = o[name]
            if how == "dtype":
                t = t.to(torch.float32)
            elif how == "shape":
                t = torch.cat([t, t[..., :1]], dim=-1)
            elif how == "strided":
                t = torch.stack([t, t], dim=-1)[..., 0]
            return c, {**o, name: t}
        return mutate

    mutations = {}
    for n in names:
        mutations[f"{n}:dtype"] = retype(n, torch.float64 if n != "target_logits" else torch.int32)
        mutations[f"{n}:meta"] = meta(n)
        mutations[f"{n}:extra_dim"] = add_dim(n)
        mutations[f"{n}:grown"] = grow(n)
    for n in outputs:
        for how in ("dtype", "shape", "strided"):
            mutations[f"{n}:{how}"] = bad_out(n, how)
    return mutations


CHAIN_LAYOUT = bad_layout_mutations(CHAIN_INPUTS, ["output_token_ids", "num_accepted"])
TREE_LAYOUT = bad_layout_mutations(TREE_INPUTS, ["accepted_nodes", "output_token_ids", "num_accepted"])


def wrapper_call(fn, output_names):
    def call(*args):
        n_out = len(output_names)
        return fn(*args[:-n_out], **dict(zip(output_names, args[-n_out:])))
    return call


BACKENDS = ["wrapper", "cpu", pytest.param("triton", marks=requires_triton)]
KERNEL_BACKENDS = ["cpu", pytest.param("triton", marks=requires_triton)]


def backend_fn(op_name, backend, output_names):
    """The wrapper (outputs as keywords), the C++ kernel (torch.ops) or the Triton launcher."""
    if backend == "wrapper":
        return wrapper_call(getattr(ops, op_name), output_names)
    if backend == "cpu":
        return getattr(torch.ops.specdec, op_name)
    return getattr(triton_rs(), op_name)


def check_layout_error(fn, case, outputs, mutated, mutated_out, input_names, mutation, backend):
    """A clear error naming an argument; a strided output may instead be written correctly."""
    name, how = mutation.split(":")
    _, error = call_or_clear_error(fn, *(mutated[n] for n in input_names), *mutated_out.values())
    if error is None and how == "strided":
        fn(*(case[n] for n in input_names), *outputs.values())
        assert torch.equal(mutated_out[name], outputs[name]), f"{backend} wrote a strided {name} wrongly"
        return
    assert error is not None, f"{mutation} was accepted by {backend}"
    # The message names an argument: the mutated one, or (a size that no longer matches) the
    # one whose size disagrees with it.
    names = [*input_names, *outputs]
    assert any(n in str(error) for n in names), f"{mutation} on {backend}: {error}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mutation", sorted(CHAIN_LAYOUT))
@fuzz_settings(2)
@given(data=st.data())
def test_chain_bad_layouts_raise(data, mutation, backend):
    case = chain_base(data.draw)
    outputs = chain_outputs(case)
    if mutation.startswith("draft_probs") and case["draft_probs"] is None:
        case = {**case, "draft_probs": draft_distribution(case["draft_token_ids"].numel(),
                                                          case["target_logits"].shape[2],
                                                          torch.Generator().manual_seed(0)).reshape(
            *case["draft_token_ids"].shape, -1)}
    mutated, mutated_out = CHAIN_LAYOUT[mutation](case, outputs)
    fn = backend_fn("chain_rejection_sample", backend, list(outputs))
    check_layout_error(fn, case, outputs, mutated, mutated_out, CHAIN_INPUTS, mutation, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mutation", sorted(TREE_LAYOUT))
@fuzz_settings(2)
@given(data=st.data())
def test_tree_bad_layouts_raise(data, mutation, backend):
    case = tree_base(data.draw)
    outputs = tree_outputs(case)
    if mutation.startswith("draft_probs") and case["draft_probs"] is None:
        case = {**case, "draft_probs": draft_distribution(case["parents"].numel(), case["target_logits"].shape[2],
                                                          torch.Generator().manual_seed(0)).reshape(
            *case["parents"].shape, -1)}
    mutated, mutated_out = TREE_LAYOUT[mutation](case, outputs)
    fn = backend_fn("tree_rejection_sample", backend, list(outputs))
    check_layout_error(fn, case, outputs, mutated, mutated_out, TREE_INPUTS, mutation, backend)


# Data faults: the C++ kernels raise (RuntimeError naming the argument); the Triton kernels
# clamp counts, reject out-of-range tokens (p(x) = 0) and never visit a node whose parent
# is not an earlier node (documented in the op docstrings); nothing is read or written
# outside the tensors either way.
CHAIN_FAULTS = ["draft_id_too_large", "draft_id_negative", "draft_id_huge", "count_negative", "count_too_large",
                "count_int_min", "count_int_max"]
TREE_FAULTS = ["token_too_large", "token_negative", "parent_after_child", "parent_self", "parent_negative",
               "parent_huge", "root_not_minus_one", "count_negative", "count_too_large", "count_int_max"]
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def chain_fault(case, fault, data):
    drafts, counts = case["draft_token_ids"].clone(), case["num_draft_tokens"].clone()
    batch, k = drafts.shape
    vocab = case["target_logits"].shape[2]
    b = data.draw(st.integers(0, batch - 1))
    if fault.startswith("draft_id"):
        counts[b] = max(int(counts[b]), 1)
        i = data.draw(st.integers(0, int(counts[b]) - 1))
        drafts[b, i] = {"draft_id_too_large": vocab, "draft_id_negative": -1, "draft_id_huge": 2**62}[fault]
        return {**case, "draft_token_ids": drafts, "num_draft_tokens": counts}, "draft_token_ids", counts
    counts[b] = {"count_negative": -1, "count_too_large": k + 1, "count_int_min": INT32_MIN,
                 "count_int_max": INT32_MAX}[fault]
    return {**case, "num_draft_tokens": counts}, "num_draft_tokens", counts.clamp(0, k)


def tree_fault(case, fault, data):
    parents, tokens, counts = case["parents"].clone(), case["tree_token_ids"].clone(), case["num_nodes"].clone()
    batch, n_max = parents.shape
    vocab = case["target_logits"].shape[2]
    b = data.draw(st.integers(0, batch - 1))
    n = int(counts[b])  # >= 2 (tree_base)
    i = data.draw(st.integers(1, n - 1))
    if fault.startswith("token"):
        tokens[b, i] = vocab if fault == "token_too_large" else -1
        return {**case, "tree_token_ids": tokens}, "tree_token_ids", counts
    if fault.startswith("parent") or fault == "root_not_minus_one":
        if fault == "root_not_minus_one":
            parents[b, 0] = 0
        elif fault == "parent_after_child":
            if i + 1 >= n:
                i = n - 2
            parents[b, i] = data.draw(st.integers(i + 1, n - 1))
        else:
            parents[b, i] = {"parent_self": i, "parent_negative": -1, "parent_huge": INT32_MAX}[fault]
        return {**case, "parents": parents}, "parents", counts
    counts[b] = {"count_negative": -1, "count_too_large": n_max + 1, "count_int_max": INT32_MAX}[fault]
    if counts[b] > n:  # the clamped count takes in the padding nodes: make them a valid tree
        parents[b, n:] = 0
        tokens[b, n:] = tokens[b, n:].clamp(0, vocab - 1)
    return {**case, "parents": parents, "tree_token_ids": tokens, "num_nodes": counts}, "num_nodes", \
        counts.clamp(0, n_max)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("fault", CHAIN_FAULTS)
@fuzz_settings(3)
@given(data=st.data())
def test_chain_data_faults(data, fault, backend):
    case, name, clamped = chain_fault(chain_base(data.draw), fault, data)
    fn = backend_fn("chain_rejection_sample", backend, [])
    if backend == "cpu":
        with pytest.raises(RuntimeError, match=name):
            run_case(fn, case, CHAIN_INPUTS, chain_outputs(case))
        return
    out, acc = run_case(fn, case, CHAIN_INPUTS, chain_outputs(case))
    check_chain_structure(out, acc, case, clamped.tolist())
    if name == "num_draft_tokens":  # clamped into 0..K: exactly the clamped request
        assert_same((out, acc), ref.chain_rejection_sample(*({**case, name: clamped}[n] for n in CHAIN_INPUTS)), case)
    else:  # the bad draft (and everything after it) is never accepted
        vocab = case["target_logits"].shape[2]
        for b in range(out.shape[0]):
            bad = [i for i in range(int(clamped[b])) if not 0 <= int(case["draft_token_ids"][b, i]) < vocab]
            if bad:
                assert int(acc[b]) <= bad[0]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("fault", TREE_FAULTS)
@fuzz_settings(3)
@given(data=st.data())
def test_tree_data_faults(data, fault, backend):
    case, name, clamped = tree_fault(tree_base(data.draw), fault, data)
    fn = backend_fn("tree_rejection_sample", backend, [])
    if backend == "cpu":
        with pytest.raises(RuntimeError, match=name):
            run_case(fn, case, TREE_INPUTS, tree_outputs(case))
        return
    nodes, out, acc = run_case(fn, case, TREE_INPUTS, tree_outputs(case))
    check_tree_structure(nodes, out, acc, case, clamped.tolist())
    if name == "num_nodes":
        assert_same((nodes, out, acc), ref.tree_rejection_sample(*({**case, name: clamped}[n] for n in TREE_INPUTS)),
                    case)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("kind", ["chain", "tree"])
@fuzz_settings(6)
@given(data=st.data(), poison=st.sampled_from([math.nan, math.inf, -1.0, 1e38]))
def test_non_finite_draft_probs_give_in_range_tokens(data, poison, kind, backend):
    """draft_probs must hold probabilities; other values are not detected (that would cost a
    pass over q) but still give a well-formed result within the tensors."""
    case = chain_base(data.draw) if kind == "chain" else tree_base(data.draw)
    shape = case["draft_token_ids"].shape if kind == "chain" else case["parents"].shape
    q = draft_distribution(shape[0] * shape[1], case["target_logits"].shape[2], torch.Generator().manual_seed(1))
    flat = q.view(-1)
    for i in data.draw(st.lists(st.integers(0, flat.numel() - 1), min_size=1, max_size=5)):
        flat[i] = poison
    case = {**case, "draft_probs": q.reshape(*shape, -1)}
    fn = backend_fn(f"{kind}_rejection_sample", backend, [])
    if kind == "chain":
        out, acc = run_case(fn, case, CHAIN_INPUTS, chain_outputs(case))
        check_chain_structure(out, acc, case, case["num_draft_tokens"].tolist())
    else:
        nodes, out, acc = run_case(fn, case, TREE_INPUTS, tree_outputs(case))
        check_tree_structure(nodes, out, acc, case, case["num_nodes"].tolist())


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout (every other element of a larger tensor,
    the others zero)."""
    return torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["chain", "tree"])
@fuzz_settings(4)
@given(data=st.data())
def test_non_contiguous_inputs_give_the_same_result(data, kind, backend):
    case = chain_base(data.draw) if kind == "chain" else tree_base(data.draw)
    names = CHAIN_INPUTS if kind == "chain" else TREE_INPUTS
    outputs = chain_outputs(case) if kind == "chain" else tree_outputs(case)
    fn = backend_fn(f"{kind}_rejection_sample", backend, list(outputs))
    expected = {k: t.clone() for k, t in outputs.items()}
    fn(*(case[n] for n in names), *expected.values())
    mutated = {n: strided(case[n]) if case[n] is not None else None for n in names}
    got = {k: t.clone() for k, t in outputs.items()}
    fn(*(mutated[n] for n in names), *got.values())
    for k in outputs:
        assert torch.equal(got[k], expected[k]), f"{backend}: non-contiguous inputs changed {k}"


CHAIN_ALIASES = {  # output -> an input of the same dtype it can be a view of (batch 1 for a 2-d one)
    "output_token_ids/draft_token_ids": ("output_token_ids", "draft_token_ids", lambda o: o[:, :-1]),
    "num_accepted/num_draft_tokens": ("num_accepted", "num_draft_tokens", lambda o: o),
}
TREE_ALIASES = {
    "output_token_ids/tree_token_ids": ("output_token_ids", "tree_token_ids", lambda o: o),
    "num_accepted/num_nodes": ("num_accepted", "num_nodes", lambda o: o),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,alias", [("chain", a) for a in CHAIN_ALIASES] + [("tree", a) for a in TREE_ALIASES])
@fuzz_settings(4)
@given(data=st.data())
def test_outputs_aliasing_inputs_raise_or_are_correct(data, kind, alias, backend):
    """An output that shares memory with an input (e.g. output_token_ids written over
    tree_token_ids): a clear error, or the result of the call without aliasing."""
    case = chain_base(data.draw) if kind == "chain" else tree_base(data.draw)
    names = CHAIN_INPUTS if kind == "chain" else TREE_INPUTS
    outputs = chain_outputs(case) if kind == "chain" else tree_outputs(case)
    out_name, in_name, view = (CHAIN_ALIASES if kind == "chain" else TREE_ALIASES)[alias]
    if kind == "chain":  # one request: then out[:, :K] is a contiguous view
        case = {n: t[:1] if t is not None else None for n, t in case.items()}
        outputs = chain_outputs(case)
    fn = backend_fn(f"{kind}_rejection_sample", backend, list(outputs))
    expected = {k: t.clone() for k, t in outputs.items()}
    fn(*(case[n] for n in names), *expected.values())
    outs = {k: t.clone() for k, t in outputs.items()}
    aliased = view(outs[out_name])
    aliased.copy_(case[in_name])
    args = {**case, in_name: aliased}
    _, error = call_or_clear_error(fn, *(args[n] for n in names), *outs.values())
    if error is None:
        for k in outputs:
            assert torch.equal(outs[k], expected[k]), f"{backend}: {out_name} aliasing {in_name} gave a wrong {k}"
    else:
        assert out_name in str(error) or in_name in str(error), str(error)
