"""chain_rejection_sample_flat: the engines' flattened ragged layout (vLLM's RejectionSampler).

Request b owns drafts cu[b-1] .. cu[b]-1 of draft_token_ids [T] / draft_probs [T, V] and the
logits rows cu[b-1] + b .. cu[b] + b of target_logits [T + B, V]. The op must give exactly
the tokens of chain_rejection_sample on the same requests padded to K drafts, on every backend
(C++ and Triton under the interpreter), against python_ref, with mixed greedy / sampled
requests, per-request temperatures and top-k / top-p, one-hot or full draft probabilities;
chi-square exactness at fixed seeds; nothing read or written outside its tensors.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from python_ref import rejection_sampling as ref
from specdec_kernels import ops
from tests.helpers import assert_guard_intact, assert_same, chain_args, guarded, make_chain_inputs, requires_triton
from tests.test_rejection_sampling import DTYPES
from tests.test_rejection_sampling_stats import P_BROKEN, P_MIN, chisq_pvalue


def to_flat(inp):
    """The padded chain inputs of ``make_chain_inputs`` in the flattened layout: (draft ids
    [T], cu [B], logits [T + B, V], q [T, V] or None, temperature, seed, offset), and K."""
    drafts, num = inp["draft_token_ids"], inp["num_draft_tokens"]
    batch, k_max = drafts.shape
    n = num.tolist()
    vocab = inp["target_logits"].shape[-1]
    flat_drafts = torch.cat([drafts[b, :n[b]] for b in range(batch)] + [drafts.new_zeros(0)])
    logits = torch.cat([inp["target_logits"][b, :n[b] + 1] for b in range(batch)]
                       + [inp["target_logits"].new_zeros(0, vocab)])
    q = inp["draft_probs"]
    if q is not None:
        q = torch.cat([q[b, :n[b]] for b in range(batch)] + [q.new_zeros(0, vocab)]).contiguous()
    cu = torch.tensor(n, dtype=torch.int64).cumsum(0).to(torch.int32)
    return (flat_drafts.contiguous(), cu, logits.contiguous(), q, inp["temperature"], inp["seed"], inp["offset"]), k_max


def triton_flat(args, k_max):
    from specdec_kernels.triton import rejection_sampling as tr

    out = torch.empty(args[1].shape[0], k_max + 1, dtype=torch.int64)
    num = torch.empty(args[1].shape[0], dtype=torch.int32)
    tr.chain_rejection_sample_flat(*args, out, num)
    return out, num


# ---------------------------------------------------------------------------------------
# Same tokens as the padded op and as python_ref.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_q", [True, False])
def test_flat_equals_padded_and_reference(dtype, with_q):
    inp = make_chain_inputs(24, 4, 37, dtype=dtype, with_q=with_q, greedy_mask=torch.arange(24) % 4 == 0)
    inp["num_draft_tokens"][:3] = torch.tensor([0, 4, 0], dtype=torch.int32)
    flat, k_max = to_flat(inp)
    expected = ops.chain_rejection_sample(*chain_args(inp))
    got = ops.chain_rejection_sample_flat(*flat, max_num_draft_tokens=k_max)
    assert_same(got, expected)
    assert_same(ref.chain_rejection_sample_flat(*flat, k_max), expected)
    assert (expected[1] > 0).sum() >= 4 and (expected[1] == 0).sum() >= 4  # both outcomes exercised


def test_width_beyond_the_longest_request_and_inferred_width():
    inp = make_chain_inputs(6, 3, 29, num_drafts=torch.tensor([1, 0, 2, 1, 0, 2]))
    flat, _ = to_flat(inp)
    wide = ops.chain_rejection_sample_flat(*flat, max_num_draft_tokens=5)  # K = 5 > every n_b
    assert_same(wide, ref.chain_rejection_sample_flat(*flat, 5))
    inferred = ops.chain_rejection_sample_flat(*flat)  # K read from cu: 2
    assert inferred[0].shape == (6, 3)
    assert torch.equal(inferred[1], wide[1]) and torch.equal(inferred[0], wide[0][:, :3])
    assert (wide[0][:, 3:] == -1).all()


def test_wrapper_takes_either_index_width_and_python_numbers():
    inp = make_chain_inputs(4, 2, 23, num_drafts=torch.tensor([2, 0, 1, 2]))
    inp["temperature"] = torch.full((4,), 0.8)
    inp["offset"] = torch.full((4,), 3, dtype=torch.int64)
    flat, k_max = to_flat(inp)
    drafts, cu, logits, q, temp, seed, offset = flat
    expected = ops.chain_rejection_sample_flat(*flat, max_num_draft_tokens=k_max)
    got = ops.chain_rejection_sample_flat(drafts.to(torch.int32), cu.to(torch.int64), logits, q, 0.8, seed, 3,
                                          max_num_draft_tokens=k_max)
    assert_same(got, expected)


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(0, 6), k=st.integers(0, 5), vocab=st.integers(1, 60), with_q=st.booleans(),
       seed=st.integers(0, 2**31), dtype=st.sampled_from(DTYPES))
def test_flat_cpu_matches_reference_hypothesis(batch, k, vocab, with_q, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    inp = make_chain_inputs(batch, k, vocab, dtype=dtype, with_q=with_q, gen=gen,
                            greedy_mask=torch.rand(batch, generator=gen) < 0.3)
    flat, k_max = to_flat(inp)
    got = ops.chain_rejection_sample_flat(*flat, max_num_draft_tokens=k_max)
    assert_same(got, ref.chain_rejection_sample_flat(*flat, k_max))
    assert_same(got, ops.chain_rejection_sample(*chain_args(inp)))


@requires_triton
@pytest.mark.parametrize("with_q,dtype", [(True, torch.float32), (False, torch.bfloat16), (True, torch.float16)])
def test_triton_flat_matches_cpu_token_for_token(with_q, dtype):
    inp = make_chain_inputs(40, 3, 16, dtype=dtype, with_q=with_q, greedy_mask=torch.arange(40) % 6 == 0)
    inp["num_draft_tokens"][:2] = torch.tensor([0, 3], dtype=torch.int32)
    flat, k_max = to_flat(inp)
    expected = ops.chain_rejection_sample_flat(*flat, max_num_draft_tokens=k_max)
    assert_same(triton_flat(flat, k_max), expected)
    assert (expected[1] > 0).sum() > 5 and (expected[1] == 0).sum() > 5


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("with_q", [True, False])
def test_negative_drafts_are_padding_that_ends_the_drafts(backend, with_q):
    # vLLM pads some decodes to its speculation length with -1 drafts. A request whose slots
    # hold [x, -1, y] is the request with the one draft x (its logits rows stay where the
    # layout puts them; y and the rows after the padding are never used).
    inp = make_chain_inputs(16, 3, 23, with_q=with_q, greedy_mask=torch.arange(16) % 4 == 0,
                            num_drafts=torch.full((16,), 3))
    flat, k_max = to_flat(inp)
    cut = torch.arange(16) % 4  # drafts kept: 0..3
    padded = flat[0].clone().view(16, 3)
    for b in range(16):
        if cut[b] < 3:
            padded[b, cut[b]] = -1
            if cut[b] + 1 < 3:
                padded[b, cut[b] + 1:] = torch.randint(-3, 23, (2 - int(cut[b]),))  # anything after it
    args = (padded.flatten(), *flat[1:])
    truncated = dict(inp, num_draft_tokens=cut.to(torch.int32))
    expected = ops.chain_rejection_sample(*chain_args(truncated))
    assert_same(ref.chain_rejection_sample_flat(*args, k_max), expected)
    got = ops.chain_rejection_sample_flat(*args, max_num_draft_tokens=k_max) if backend == "cpu" \
        else triton_flat(args, k_max)
    assert_same(got, expected)


@requires_triton
def test_triton_flat_large_vocab_and_empty_batch():
    inp = make_chain_inputs(2, 1, 8193, sharpness=0.3, num_drafts=torch.tensor([1, 0]))
    flat, k_max = to_flat(inp)
    assert_same(triton_flat(flat, k_max), ref.chain_rejection_sample_flat(*flat, k_max))
    empty = make_chain_inputs(0, 2, 16)
    flat, _ = to_flat(empty)
    out, num = triton_flat(flat, 2)
    assert out.shape == (0, 3) and num.shape == (0,)


# ---------------------------------------------------------------------------------------
# Exactness: chi-square per position with per-request temperatures, top-k / top-p on the
# flattened rows, greedy requests mixed in, one-hot and full draft probabilities.
# ---------------------------------------------------------------------------------------

VOCAB = 8
GROUPS = {  # temperature, top_k, top_p
    "t1": (1.0, 0, 1.0),
    "t0.6-top-k-top-p": (0.6, 5, 0.85),
    "greedy": (0.0, 0, 1.0),
}
PER_GROUP = 50_000


def run_flat_stats(k, with_q, sampler=None):
    """PER_GROUP requests per group of GROUPS in one flattened batch (groups interleaved),
    ragged draft counts in 0..k; every request sees the same target logits table, so that
    the token at position j follows p_j whatever came before. Returns per group the outputs,
    the accepted counts and the target distributions [k + 1, V]."""
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(k + 1, VOCAB, generator=gen) * 1.2
    names = list(GROUPS)
    batch = PER_GROUP * len(names)
    group = torch.arange(batch) % len(names)
    temp = torch.tensor([GROUPS[n][0] for n in names])[group]
    top_k = torch.tensor([GROUPS[n][1] for n in names], dtype=torch.int32)[group]
    top_p = torch.tensor([GROUPS[n][2] for n in names])[group]
    # Ragged counts, mostly k (so that many requests reach the later positions).
    weights = torch.full((k + 1,), 0.4 / k)
    weights[k] = 0.6
    num = torch.multinomial(weights, batch, replacement=True, generator=gen).to(torch.int32)
    rows_per_request = num.long() + 1

    def position_in_request(counts):  # 0, 1, .., counts[b] - 1 for every request b
        starts = counts.cumsum(0) - counts
        return torch.arange(int(counts.sum())) - starts.repeat_interleave(counts)

    logits = table[position_in_request(rows_per_request)]
    # Caller's side of the contract: top-k / top-p on logits / T of every row (greedy rows
    # at T = 1), then sampling the scaled rows at T = 1.
    scale = torch.where(temp > 0, temp, torch.ones_like(temp)).repeat_interleave(rows_per_request)
    logits = ops.apply_top_k_top_p(logits / scale[:, None], top_k.repeat_interleave(rows_per_request),
                                   top_p.repeat_interleave(rows_per_request))
    sample_temp = torch.where(temp > 0, torch.ones_like(temp), temp)
    # Drafts from q (full probabilities) or deterministic (one-hot: any fixed choice).
    # (close to the target, so that requests reach the later positions)
    q_table = 0.1 * torch.softmax(torch.randn(k, VOCAB, generator=gen), -1) + 0.9 * torch.softmax(table[:k], -1)
    pos = position_in_request(num.long())
    drafts = torch.multinomial(q_table[pos], 1, generator=gen)[:, 0]
    q = q_table[pos].contiguous() if with_q else None
    cu = num.long().cumsum(0).to(torch.int32)
    seed = torch.arange(batch, dtype=torch.int64) * 104729 + 17
    offset = torch.zeros(batch, dtype=torch.int64)
    sampler = sampler or (lambda *a: ops.chain_rejection_sample_flat(*a, max_num_draft_tokens=k))
    out, acc = sampler(drafts, cu, logits.contiguous(), q, sample_temp, seed, offset)
    assert (acc >= 0).all()
    results = {}
    for i, name in enumerate(names):
        t, kk, pp = GROUPS[name]
        scaled = table / (t if t > 0 else 1.0)
        masked = ref.apply_top_k_top_p(scaled, torch.full((k + 1,), kk, dtype=torch.int32), torch.full((k + 1,), pp))
        probs = torch.softmax(masked, -1) if t > 0 else torch.nn.functional.one_hot(table.argmax(-1), VOCAB).float()
        results[name] = (out[group == i], acc[group == i], probs)
    return results


def position_pvalues(out, acc, probs):
    return [chisq_pvalue(out[acc >= j, j], probs[j]) for j in range(probs.shape[0]) if (acc >= j).sum() >= 2000]


@pytest.mark.parametrize("with_q", [True, False])
def test_flat_positions_follow_the_target_per_request_parameters(with_q):
    results = run_flat_stats(3, with_q)
    for name, (out, acc, probs) in results.items():
        if name == "greedy":  # every emitted token is the argmax of its row
            for j in range(probs.shape[0]):
                assert (out[acc >= j, j] == int(probs[j].argmax())).all()
            continue
        pvalues = position_pvalues(out, acc, probs)
        assert len(pvalues) >= 3, name  # requests reach positions 0..2 at least
        assert min(pvalues) > P_MIN, (name, pvalues)


def test_flat_statistical_check_catches_a_broken_layout():
    # Reading each request's bonus row one row too early (the padded layout's row index with
    # a ragged batch) changes the distribution at the bonus position: the check must see it.
    def wrong_rows(drafts, cu, logits, q, temp, seed, offset):
        shifted = torch.cat([logits[1:], logits[-1:]])
        return ops.chain_rejection_sample_flat(drafts, cu, shifted, q, temp, seed, offset, max_num_draft_tokens=3)

    results = run_flat_stats(3, True, sampler=wrong_rows)
    out, acc, probs = results["t1"]
    assert min(position_pvalues(out, acc, probs)) < P_BROKEN


# ---------------------------------------------------------------------------------------
# Nothing outside the tensors is read or written; bad inputs.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("with_q", [True, False])
def test_flat_nothing_outside_the_tensors_is_read_or_written(backend, with_q):
    from specdec_kernels.triton import rejection_sampling as tr

    # Flat logits: rejections and bonus tokens; the last request drafts the most, so its
    # bonus row is the last row of target_logits, next to the guard.
    inp = make_chain_inputs(10, 3, 37, with_q=with_q, sharpness=0.3, greedy_mask=torch.arange(10) % 5 == 0,
                            num_drafts=torch.tensor([0, 1, 2, 3, 1, 0, 3, 2, 1, 3]))
    # Odd requests accept every draft, so that the race runs on their bonus rows too: q = p,
    # or (one-hot drafts) the drafted tokens made almost certain.
    if with_q:
        p = torch.softmax(inp["target_logits"][:, :3] / inp["temperature"][:, None, None], dim=-1)
        inp["draft_probs"][1::2] = p[1::2]
    else:
        for b in range(1, 10, 2):
            for j in range(3):
                inp["target_logits"][b, j, inp["draft_token_ids"][b, j]] += 30.0
    flat, k_max = to_flat(inp)
    expected = ref.chain_rejection_sample_flat(*flat, k_max)
    args = [guarded(a) if isinstance(a, torch.Tensor) else a for a in flat]
    outs = [guarded(torch.zeros(10, k_max + 1, dtype=torch.int64)), guarded(torch.zeros(10, dtype=torch.int32))]
    fn = torch.ops.specdec.chain_rejection_sample_flat if backend == "cpu" else tr.chain_rejection_sample_flat
    fn(*args, *outs)
    for t in outs:
        assert_guard_intact(t)
    assert_same(outs, expected)
    assert ((expected[1] == 3) & (inp["temperature"] > 0)).sum() >= 1


@requires_triton
def test_triton_flat_clamps_bad_ranges_without_reading_out_of_bounds():
    from specdec_kernels.triton import rejection_sampling as tr

    inp = make_chain_inputs(3, 2, 16, num_drafts=torch.tensor([2, 2, 2]))
    flat, _ = to_flat(inp)
    drafts, cu, logits, q, temp, seed, offset = flat
    for bad_cu in ([2, 9, 6], [4, 2, 6], [-3, 4, 6]):  # past T, decreasing, negative
        args = [guarded(a) for a in (drafts, torch.tensor(bad_cu, dtype=torch.int32), logits, q, temp, seed, offset)]
        outs = [guarded(torch.zeros(3, 3, dtype=torch.int64)), guarded(torch.zeros(3, dtype=torch.int32))]
        tr.chain_rejection_sample_flat(*args, *outs)
        for t in outs:
            assert_guard_intact(t)
        assert ((outs[0][:, 0] >= 0) & (outs[0][:, 0] < 16)).all() and (outs[1] >= 0).all()


@pytest.mark.parametrize("bad_cu,match", [([2, 1, 6], "must lie in"), ([2, 4, 7], "exceeds"),
                                          ([2, 4, 5], "must equal"), ([4, 4, 6], "must lie in")])
def test_cpu_raises_on_bad_ranges(bad_cu, match):
    inp = make_chain_inputs(3, 2, 16, num_drafts=torch.tensor([2, 2, 2]))
    flat, _ = to_flat(inp)
    args = list(flat)
    args[1] = torch.tensor(bad_cu, dtype=torch.int32)
    out, acc = torch.empty(3, 4, dtype=torch.int64), torch.empty(3, dtype=torch.int32)  # K = 3
    with pytest.raises(RuntimeError, match=match):
        torch.ops.specdec.chain_rejection_sample_flat(*args, out, acc)


@pytest.mark.parametrize("bad_id", [16, 10**12])
def test_cpu_raises_on_out_of_range_draft_ids(bad_id):
    inp = make_chain_inputs(2, 2, 16, num_drafts=torch.tensor([2, 2]))
    flat, k_max = to_flat(inp)
    flat[0][3] = bad_id
    with pytest.raises(RuntimeError, match=r"draft_token_ids\[3\]"):
        ops.chain_rejection_sample_flat(*flat, max_num_draft_tokens=k_max)


def _bad_flat_cases(wrapper=True):
    """Bad inputs for the wrapper, or (wrapper=False) for the raw op, which takes exactly
    int64 ids and int32 cu where the wrapper casts either width (so it gets int16)."""
    ids_dtype, cu_dtype = (torch.int16, torch.int16) if wrapper else (torch.int32, torch.int64)

    def mod(i, fn):
        def f(args):
            args[i] = fn(args[i])
        return f

    return [
        ("draft_token_ids", mod(0, lambda t: t.to(ids_dtype))),
        ("draft_token_ids", mod(0, lambda t: t.view(-1, 1))),
        ("cu_num_draft_tokens", mod(1, lambda t: t.to(cu_dtype))),
        ("target_logits", mod(2, lambda t: t[:-1])),
        ("target_logits", mod(2, lambda t: t.double())),
        ("target_logits", mod(2, lambda t: t.unsqueeze(0))),
        ("draft_probs", mod(3, lambda t: t[:, :5])),
        ("draft_probs", mod(3, lambda t: t[:-1])),
        ("temperature", mod(4, lambda t: t[:1])),
        ("seed", mod(5, lambda t: t.to(torch.int32))),
        ("offset", mod(6, lambda t: t.double())),
    ]


@pytest.mark.parametrize("name,modify", _bad_flat_cases())
def test_bad_inputs_name_the_argument(name, modify):
    inp = make_chain_inputs(3, 2, 16, num_drafts=torch.tensor([1, 2, 0]))
    flat, _ = to_flat(inp)
    args = list(flat)
    modify(args)
    with pytest.raises(ValueError, match=name):
        ops.chain_rejection_sample_flat(*args, max_num_draft_tokens=2)


@pytest.mark.parametrize("name,modify", _bad_flat_cases(wrapper=False))
def test_cpu_kernel_checks_name_the_argument(name, modify):
    inp = make_chain_inputs(3, 2, 16, num_drafts=torch.tensor([1, 2, 0]))
    flat, _ = to_flat(inp)
    args = list(flat)
    modify(args)
    out, acc = torch.empty(3, 3, dtype=torch.int64), torch.empty(3, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=name):
        torch.ops.specdec.chain_rejection_sample_flat(*args, out, acc)


def test_bad_outputs_and_width():
    inp = make_chain_inputs(3, 2, 16, num_drafts=torch.tensor([1, 2, 0]))
    flat, _ = to_flat(inp)
    with pytest.raises(ValueError, match="max_num_draft_tokens"):
        ops.chain_rejection_sample_flat(*flat, max_num_draft_tokens=-1)
    with pytest.raises(ValueError, match="output_token_ids"):
        ops.chain_rejection_sample_flat(*flat, output_token_ids=torch.empty(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_accepted"):
        ops.chain_rejection_sample_flat(*flat, max_num_draft_tokens=2, num_accepted=torch.empty(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="must lie in"):  # K = 1 < a request's 2 drafts
        ops.chain_rejection_sample_flat(*flat, max_num_draft_tokens=1)


@requires_triton
def test_triton_launcher_checks_the_shapes_it_indexes_with():
    inp = make_chain_inputs(3, 2, 16, num_drafts=torch.tensor([1, 2, 0]))
    flat, _ = to_flat(inp)
    for i, bad, name in ((2, flat[2][:-1], "target_logits"), (3, flat[3][:, :4], "draft_probs"),
                         (1, flat[1][:2], "target_logits")):
        args = list(flat)
        args[i] = bad
        with pytest.raises(ValueError, match=name):
            triton_flat(args, 2)


# ---------------------------------------------------------------------------------------
# opcheck and torch.compile.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_q", [True, False])
def test_opcheck(with_q):
    inp = make_chain_inputs(3, 2, 16, with_q=with_q, num_drafts=torch.tensor([1, 2, 0]))
    flat, _ = to_flat(inp)
    torch.library.opcheck(torch.ops.specdec.chain_rejection_sample_flat,
                          (*flat, torch.empty(3, 3, dtype=torch.int64), torch.empty(3, dtype=torch.int32)))


def test_torch_compile_fullgraph():
    inp = make_chain_inputs(3, 2, 16, num_drafts=torch.tensor([1, 2, 0]))
    flat, _ = to_flat(inp)

    def fn(args):
        logits = ops.apply_top_k_top_p(args[2].clone(), torch.full((args[2].shape[0],), 5, dtype=torch.int32))
        return ops.chain_rejection_sample_flat(args[0], args[1], logits, *args[3:], max_num_draft_tokens=2)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert_same(compiled(flat), fn(flat))
