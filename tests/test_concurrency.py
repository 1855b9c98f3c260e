"""Concurrency: ops called from several Python threads at once give bit-identical results
to serial calls.

The C++ kernels run without the GIL (torch.ops releases it) and use ATen's thread pool from
every calling thread at once; the Python wrappers keep module-level memos (compact_kv's
checked cache lists). Each test computes every thread's result serially first, then starts
the threads together (a barrier) and has each call its op REPEATS times on its own inputs.
Two Generators (one shared model, a drafter each) decoding in two threads give the
outputs they give alone.
"""
from __future__ import annotations

import threading

import pytest
import torch

import specdec_kernels
from specdec_kernels import ops
from tests.helpers import chain_args, make_chain_inputs, make_tree_inputs, requires_triton, tree_args
from tests.test_kv_compaction import make_case as kv_case
from tests.test_tree_attention import make_case as attention_case
from tests.test_tree_attention import op_args as attention_args
from tests.test_tree_attention import random_tree

THREADS = 4
REPEATS = 3


def run_concurrently(calls):
    """Runs calls[i]() REPEATS times in thread i, all threads started together; returns
    results[i] = the list of REPEATS results of thread i (an exception in any thread fails)."""
    barrier = threading.Barrier(len(calls))
    results = [None] * len(calls)
    errors = []

    def worker(i):
        try:
            barrier.wait()
            results[i] = [calls[i]() for _ in range(REPEATS)]
        except BaseException as error:  # noqa: BLE001  (re-raised in the main thread)
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


def assert_bit_identical(got, expected, what):
    got = got if isinstance(got, (tuple, list)) else (got,)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    for g, e in zip(got, expected):
        if isinstance(e, torch.Tensor):
            same = torch.equal(g, e) or (g.is_floating_point() and torch.equal(g.isnan(), e.isnan())
                                          and torch.equal(g.nan_to_num(), e.nan_to_num()))
            assert same, f"{what}: a concurrent call differs from the serial one"
        else:
            assert g == e, f"{what}: a concurrent call differs from the serial one"


def check_concurrent_equals_serial(make_calls, what):
    calls = make_calls()
    expected = [call() for call in calls]  # serial
    for thread_results, serial in zip(run_concurrently(calls), expected):
        for result in thread_results:
            assert_bit_identical(result, serial, what)


# ---------------------------------------------------------------------------------------
# One op per test, THREADS threads with different inputs (large enough that the C++
# kernels split their work over ATen's threads).
# ---------------------------------------------------------------------------------------


def test_chain_rejection_sample():
    def calls():
        inputs = [make_chain_inputs(16, 4, 5000, gen=torch.Generator().manual_seed(i),
                                    greedy_mask=torch.arange(16) % 5 == i) for i in range(THREADS)]
        return [lambda inp=inp: ops.chain_rejection_sample(*chain_args(inp)) for inp in inputs]
    check_concurrent_equals_serial(calls, "chain_rejection_sample")


def test_tree_rejection_sample():
    def calls():
        inputs = [make_tree_inputs(12, 9, 3000, gen=torch.Generator().manual_seed(10 + i), with_q=i % 2 == 0)
                  for i in range(THREADS)]
        return [lambda inp=inp: ops.tree_rejection_sample(*tree_args(inp)) for inp in inputs]
    check_concurrent_equals_serial(calls, "tree_rejection_sample")


def test_apply_top_k_top_p():
    def calls():
        out = []
        for i in range(THREADS):
            gen = torch.Generator().manual_seed(20 + i)
            logits = (torch.randn(8, 4000, generator=gen) * 3).round(decimals=1)
            top_k = torch.randint(0, 100, (8,), generator=gen, dtype=torch.int32)
            top_p = torch.rand(8, generator=gen)
            out.append(lambda logits=logits, k=top_k, p=top_p: ops.apply_top_k_top_p(logits, k, p, inplace=False))
        return out
    check_concurrent_equals_serial(calls, "apply_top_k_top_p")


def test_tree_attention():
    def calls():
        out = []
        for i in range(THREADS):
            gen = torch.Generator().manual_seed(30 + i)
            case = attention_case([random_tree(13, gen), random_tree(5, gen)], [700 + 50 * i, 40], Hq=8, Hkv=2, D=64,
                                  block_size=16, seed=i)
            out.append(lambda case=case: ops.tree_attention(*attention_args(case), return_lse=True))
        return out
    check_concurrent_equals_serial(calls, "tree_attention")


def test_compact_kv():
    """In place: every call compacts a fresh copy of its thread's caches."""
    def calls():
        out = []
        for i in range(THREADS):
            k, v, *rest = kv_case([3 + i, 7], [[1, 3, 4], [2]], tree_sizes=[6, 4], block_size=4, num_layers=4,
                                  heads=4, head_dim=64, seed=i)

            def run(k=k, v=v, rest=rest):
                kc, vc = [t.clone() for t in k], [t.clone() for t in v]
                specdec_kernels.compact_kv(kc, vc, *rest)
                return (*kc, *vc)
            out.append(run)
        return out
    check_concurrent_equals_serial(calls, "compact_kv")


def test_medusa_topk_and_skinny_linear():
    def calls():
        out = []
        for i in range(THREADS):
            gen = torch.Generator().manual_seed(40 + i)
            hidden = torch.randn(3, 64, generator=gen)
            res_w = torch.randn(3, 1, 64, 64, generator=gen) / 8
            res_b = torch.randn(3, 1, 64, generator=gen)
            lm_head = torch.randn(5000, 64, generator=gen) / 8
            x = torch.randn(9, 256, generator=gen)
            w = torch.randn(1000, 256, generator=gen)
            out.append(lambda a=(hidden, res_w, res_b, lm_head), x=x, w=w: (*ops.medusa_topk(*a, 10),
                                                                           ops.skinny_linear(x, w)))
        return out
    check_concurrent_equals_serial(calls, "medusa_topk / skinny_linear")


def test_philox_uniform():
    def calls():
        return [lambda i=i: ops.philox_uniform(torch.arange(4) * 7 + i, torch.arange(4) + 2**40, i, 1, 3000)
                for i in range(THREADS)]
    check_concurrent_equals_serial(calls, "philox_uniform")


def test_every_op_at_once():
    """Different ops in different threads at the same time."""
    def calls():
        gen = torch.Generator().manual_seed(50)
        chain = make_chain_inputs(8, 3, 2000, gen=gen)
        tree = make_tree_inputs(8, 6, 2000, gen=gen)
        case = attention_case([random_tree(9, gen)], [900], Hq=4, Hkv=1, D=64, block_size=16)
        k, v, *rest = kv_case([2, 5], [[1, 2], [3]], tree_sizes=[4, 5], num_layers=3)

        def compact():
            kc, vc = [t.clone() for t in k], [t.clone() for t in v]
            specdec_kernels.compact_kv(kc, vc, *rest)
            return (*kc, *vc)
        return [lambda: ops.chain_rejection_sample(*chain_args(chain)),
                lambda: ops.tree_rejection_sample(*tree_args(tree)),
                lambda: ops.tree_attention(*attention_args(case), return_lse=True),
                compact]
    check_concurrent_equals_serial(calls, "every op")


@requires_triton
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="Triton's interpreter keeps the launch grid in a module-level object: launches from "
                           "several threads at once fail inside it (ValueError: x >= grid_dim[0]); on a GPU the "
                           "launchers run from threads")
def test_triton_kernels_in_threads():
    """The Triton launchers (our Python keeps no launch state) from several threads at once."""
    def calls():
        from specdec_kernels.triton import rejection_sampling as tr

        out = []
        for i in range(THREADS):
            inp = {k: (v.cuda() if v is not None else None)
                   for k, v in make_chain_inputs(64, 4, 32000, gen=torch.Generator().manual_seed(i)).items()}

            def run(inp=inp):
                out_ids = torch.empty(64, 5, dtype=torch.int64, device="cuda")
                acc = torch.empty(64, dtype=torch.int32, device="cuda")
                tr.chain_rejection_sample(*chain_args(inp), out_ids, acc)
                torch.cuda.synchronize()
                return out_ids.cpu(), acc.cpu()
            out.append(run)
        return out
    check_concurrent_equals_serial(calls, "triton chain_rejection_sample")


# ---------------------------------------------------------------------------------------
# Two Generators (one shared model) in two threads.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["none", "medusa", "ngram"])
def test_two_generators_in_two_threads(drafter):
    from specdec_kernels.decoding import Generator, SamplingParams, SpecSchedule
    from specdec_kernels.drafting.medusa.drafter import MedusaDrafter
    from specdec_kernels.drafting.ngram import NgramDrafter
    from specdec_kernels.models import Llama, tiny_config

    model = Llama.random(tiny_config(num_layers=2), seed=0)
    gen = torch.Generator().manual_seed(3)
    prompts = [[torch.randint(0, 64, (n,), generator=gen).tolist() for n in (5, 12)] for _ in range(2)]
    sampling = [[SamplingParams(temperature=0.8, seed=11)] * 2, [SamplingParams()] * 2]  # sampled, greedy

    def make_generator():
        d = {"none": None, "medusa": lambda: MedusaDrafter(model), "ngram": NgramDrafter}[drafter]
        return Generator(model, d() if d else None, SpecSchedule("constant", 3))

    def calls():
        return [lambda i=i: [r.output for r in make_generator().generate(prompts[i], 16, sampling[i])]
                for i in range(2)]

    check_concurrent_equals_serial(calls, f"two generators ({drafter})")
