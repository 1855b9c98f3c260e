"""Fuzzing compact_kv.

Valid inputs (random trees and accepted paths, block tables with holes, any dtype, heads
adjacent or not, negative counts, empty batches) must give python_ref's caches exactly on
the C++ and Triton kernels, with the index tensors in guarded storage. Random data faults
(accepted nodes out of order, 0, negative or huge; counts beyond the width; prefixes
negative or near INT32_MAX; block ids -1 or out of range): the C++ kernel raises before
writing anything, the Triton kernel does the documented valid moves only. Bad layouts and
a cache tensor given twice (moving its rows twice): a clear error, never a crash.
Budget: tests/fuzzing.py.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import specdec_kernels
from python_ref.kv_compaction import compact_kv as compact_kv_ref
from tests.helpers import requires_triton, run_guarded
from tests.fuzzing import call_or_clear_error, fuzz_settings
from tests.test_kv_compaction import batches, clone_caches, make_case, valid_move_reference

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def backend_fn(backend):
    if backend == "wrapper":
        return specdec_kernels.compact_kv
    if backend == "cpu":
        return torch.ops.specdec.compact_kv
    from specdec_kernels.triton.kv_compaction import compact_kv_triton

    return compact_kv_triton


def run_case(backend, case):
    """The index tensors in guarded storage (tests.helpers.run_guarded); the caches (lists of
    tensors, written in place) are passed as they are and compared whole by the callers."""
    run_guarded(backend_fn(backend), list(case), [])


@st.composite
def valid_cases(draw, max_requests=3, max_nodes=12, max_prefix=20):
    params = draw(batches(max_requests=max_requests, max_nodes=max_nodes, max_prefix=max_prefix))
    case = list(make_case(**params))
    # Requests whose sampler reported a NaN row (num_accepted = -1) move nothing.
    counts = case[5].clone()
    for b in draw(st.lists(st.integers(0, len(counts) - 1), max_size=2)):
        counts[b] = draw(st.sampled_from([-1, INT32_MIN]))
    case[5] = counts
    return case


@pytest.mark.parametrize("backend", ["wrapper", "cpu"])
@fuzz_settings(40)
@given(case=valid_cases())
def test_cpu_matches_reference(case, backend):
    k, v, *rest = case
    ek, ev = clone_caches(k), clone_caches(v)
    compact_kv_ref(ek, ev, *rest)
    run_case(backend, case)
    assert all(torch.equal(a, b) for a, b in zip(k + v, ek + ev))


@requires_triton
@fuzz_settings(5)
@given(case=valid_cases(max_requests=2, max_nodes=7, max_prefix=7))
def test_triton_matches_reference(case):
    k, v, *rest = case
    ek, ev = clone_caches(k), clone_caches(v)
    compact_kv_ref(ek, ev, *rest)
    run_case("triton", case)
    assert all(torch.equal(a, b) for a, b in zip(k + v, ek + ev))


FAULTS = ["node_zero", "node_negative", "node_repeated", "node_decreasing", "node_huge", "count_too_large",
          "count_int_max", "prefix_negative", "prefix_int_max", "block_minus_one", "block_too_large",
          "block_int_max", "block_int_min"]


def apply_fault(case, fault, draw):
    k, v, bt, pl, nodes, counts = case
    bt, pl, nodes, counts = bt.clone(), pl.clone(), nodes.clone(), counts.clone()
    batch, width = nodes.shape
    b = draw(st.integers(0, batch - 1))
    n = max(int(counts[b]), 0)
    if fault.startswith("node") or fault.startswith("count"):
        if n == 0:  # give the request one move
            counts[b] = n = 1
            nodes[b, 0] = 1
        i = draw(st.integers(0, n - 1))
        if fault == "node_zero":
            nodes[b, i] = 0
        elif fault == "node_negative":
            nodes[b, i] = -1
        elif fault == "node_huge":
            nodes[b, i] = INT32_MAX
        elif fault in ("node_repeated", "node_decreasing"):
            if n == 1:
                if width < 2:
                    nodes = torch.cat([nodes, nodes], 1)
                counts[b] = n = 2
                nodes[b, 1] = nodes[b, 0] + 1
            nodes[b, 1] = nodes[b, 0] if fault == "node_repeated" else nodes[b, 0] - 1
        else:
            counts[b] = width + 1 if fault == "count_too_large" else INT32_MAX
    elif fault.startswith("prefix"):
        if n == 0:
            counts[b], nodes[b, 0] = 1, 1
        pl[b] = -1 if fault == "prefix_negative" else INT32_MAX
    else:
        # A block the request's moves touch: the one of its first destination.
        if n == 0:
            counts[b], nodes[b, 0] = 1, 1
        block_size = k[0].shape[1]
        slot = (int(pl[b]) + 1) // block_size
        bt[b, slot] = {"block_minus_one": -1, "block_too_large": k[0].shape[0], "block_int_max": INT32_MAX,
                       "block_int_min": INT32_MIN}[fault]
    return [k, v, bt, pl, nodes, counts]


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("fault", FAULTS)
@fuzz_settings(3)
@given(data=st.data())
def test_data_faults(data, fault, backend):
    case = apply_fault(data.draw(valid_cases(max_requests=2, max_nodes=7, max_prefix=7)), fault, data.draw)
    k, v, *rest = case
    before = clone_caches(k + v)
    if backend == "cpu":
        with pytest.raises(RuntimeError, match="compact_kv|accepted_nodes|num_accepted|prefix_lens|block"):
            run_case("cpu", case)
        assert all(torch.equal(a, b) for a, b in zip(k + v, before)), "the caches changed before the error"
        return
    ek, ev = clone_caches(k), clone_caches(v)
    valid_move_reference(ek, ev, *rest, block_size=k[0].shape[1], num_blocks=k[0].shape[0])
    run_case("triton", case)
    assert all(torch.equal(a, b) for a, b in zip(k + v, ek + ev))


def layout_mutations():
    def meta(c):
        k, v, *rest = c
        return [k, v, rest[0].to("meta"), *rest[1:]]

    def cache_meta(c):
        k, v, *rest = c
        return [[t.to("meta") for t in k], v, *rest]

    def dtype(i, to):
        return lambda c: [*c[:i], c[i].to(to), *c[i + 1:]]

    def layer(kind):
        def mutate(c):
            k, v, *rest = c
            t = v[-1]
            bad = {"dtype": lambda: t.to(torch.float64), "shape": lambda: t[:, :1].contiguous() if t.shape[1] > 1
                   else torch.cat([t, t], 1),
                   # Rows padded to 2 * head_dim: strides no layer of k_caches has.
                   "strides": lambda: torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., :t.shape[-1]],
                   "head_dim_strided": lambda: torch.stack([t, t], -1)[..., 0]}[kind]()
            return [k, [*v[:-1], bad], *rest]
        return mutate

    def alias(kind):
        def mutate(c):
            k, v, *rest = c
            if kind == "k_is_v":
                return [k, [k[0], *v[1:]], *rest]
            if kind == "layer_twice":
                return [[k[0], k[0]], v[:1] * 2, *rest]
            return [k, [k[-1].view(k[-1].shape), *v[1:]], *rest]  # a view of the same memory
        return mutate

    return {
        "block_table:meta": meta, "k_caches:meta": cache_meta,
        "block_table:dtype": dtype(2, torch.int16), "prefix_lens:dtype": dtype(3, torch.float32),
        "accepted_nodes:dtype": dtype(4, torch.int16), "num_accepted:dtype": dtype(5, torch.int16),
        "prefix_lens:shape": lambda c: [*c[:3], torch.cat([c[3], c[3]]), *c[4:]],
        "accepted_nodes:1d": lambda c: [*c[:4], c[4][0], c[5]],
        "v_caches:dtype": layer("dtype"), "v_caches:shape": layer("shape"), "v_caches:strides": layer("strides"),
        "v_caches:head_dim_strided": layer("head_dim_strided"),
        "v_caches:length": lambda c: [c[0], c[1][:-1] if len(c[1]) > 1 else c[1] * 2, *c[2:]],
        "k_caches:empty": lambda c: [[], [], *c[2:]],
        "aliasing:k_is_v": alias("k_is_v"), "aliasing:layer_twice": alias("layer_twice"),
        "aliasing:view": alias("view"),
    }


LAYOUT = layout_mutations()


@pytest.mark.parametrize("backend", ["wrapper", "cpu", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("mutation", sorted(LAYOUT))
@fuzz_settings(2)
@given(data=st.data())
def test_bad_layouts_raise(data, mutation, backend):
    case = data.draw(valid_cases(max_requests=2, max_nodes=6, max_prefix=6))
    # Something to move, so that a cache given twice would be moved twice.
    case[4][0, :2] = torch.tensor([2, 3], dtype=torch.int32)[: case[4].shape[1]]
    case[5][0] = min(2, case[4].shape[1])
    case[4][0, int(case[5][0]):] = -1
    mutated = LAYOUT[mutation](case)
    _, error = call_or_clear_error(backend_fn(backend), *mutated)
    assert error is not None, f"{mutation} accepted by {backend}"
    names = ["k_caches", "v_caches", "block_table", "prefix_lens", "accepted_nodes", "num_accepted"]
    assert any(n in str(error) for n in names) or "device" in str(error), f"{mutation} on {backend}: {error}"
