"""The fused decode step (``models.decoder_step``, csrc/cpu/decoder_step.cpp) against the Python
layers it replaces, bit for bit: hidden states, logits and the K/V written into the cache, for Llama
and Qwen2 (q/k/v biases), every weight format (fp32, bf16, GGUF blocks with fp32 or int8
activations, a fused weight of parts of different block types), one and several requests,
tree rows, row counts on both sides of the skinny/MKL rule, and the truncated stack."""
import pytest
import torch

from specdec_kernels import gguf_blocks
from specdec_kernels.models import Llama, tiny_config
from specdec_kernels.models import decoder_step
from specdec_kernels.models.llama import Batch
from specdec_kernels.tree import tree_mask, tree_mask_ragged

pytestmark = pytest.mark.skipif(not decoder_step.available(), reason="the C++ extension has no DecoderStack")


def mixed_qkv(model: Llama) -> Llama:
    """Q8_0 weights with every layer's q|k|v kept as parts of three block types (Q8_0, Q4_K,
    Q4_0), the way a GGUF file with a Q6_K v projection loads."""
    c = model.config
    D = c.head_dim
    layers = []
    for L in model.layers:
        q, k, v = L["wqkv"].split([c.num_heads * D, c.num_kv_heads * D, c.num_kv_heads * D])
        parts = (gguf_blocks.quantize(q, "Q8_0"), gguf_blocks.quantize(k, "Q4_K"), gguf_blocks.quantize(v, "Q4_0"))
        layers.append({**L, "wqkv": parts})
    q8 = model.quantized("Q8_0")
    layers = [{**Lq, "wqkv": L["wqkv"]} for Lq, L in zip(q8.layers, layers)]
    return Llama(c, dict(embed=q8.embed, norm=q8.norm, lm_head=q8.lm_head, layers=layers), name="mixed")


FORMATS = {
    "fp32": lambda m: m,
    "bf16": lambda m: Llama(m.config, dict(embed=m.embed.bfloat16(), norm=m.norm.bfloat16(),
                                           lm_head=m.lm_head.bfloat16(),
                                           layers=[{k: v.bfloat16() for k, v in L.items()} for L in m.layers])),
    "Q8_0": lambda m: m.quantized("Q8_0"),
    "Q4_K": lambda m: m.quantized("Q4_K"),
    "Q4_0-int8act": lambda m: m.quantized("Q4_0").with_int8_activations(),
    "Q6_K-int8act": lambda m: m.quantized("Q6_K").with_int8_activations(),
    "mixed-parts": mixed_qkv,
    "mixed-parts-int8act": lambda m: mixed_qkv(m).with_int8_activations(),
}


@pytest.fixture(scope="module", params=[False, True], ids=["llama", "qwen2"])
def base(request):
    return Llama.random(tiny_config(num_layers=3, hidden_size=256, intermediate_size=512,
                                    attention_bias=request.param), seed=3)


def run(model: Llama, path: str, steps, num_layers=None, feature_layers=()):
    """Prefill two requests, then run ``steps`` forwards of (tokens per request, tree parents or
    None) on ``path``; returns every forward's hidden states (with ``feature_layers``: those
    layers' states too) (and logits, through all layers: ``forward_logits``) and the final caches."""
    model.step_path = path
    cache = model.new_cache(2, 128, block_size=8)
    g = torch.Generator().manual_seed(0)
    slots = []
    for n in (11, 5):
        slot = cache.add_request()
        model.prefill(torch.randint(0, 64, (n,), generator=g), cache, slot)
        slots.append(slot)
    outs = []
    for rows, parents in steps:
        new = cache.append_slots(slots, rows)
        bt, pl = cache.batch_view(slots)
        positions = new.cache_positions.to(torch.int64)
        mask = None
        if parents is not None:
            mask = tree_mask_ragged(tree_mask(torch.tensor([parents] * len(slots), dtype=torch.int32)),
                                    new.qo_indptr, sum(rows))
            depth = [0]
            for p in parents[1:]:
                depth.append(depth[p] + 1)
            positions = torch.cat([pl[b].long() + torch.tensor(depth) for b in range(len(slots))])
        toks = torch.randint(0, 64, (sum(rows),), generator=g)
        batch = Batch(bt, pl, new.qo_indptr, new.slot_mapping, mask)
        if num_layers is None:  # the verification step: hidden states and logits in one call
            outs.extend(model.forward_logits(toks, positions, cache, batch, feature_layers=feature_layers))
        else:
            outs.append(model.forward(toks, positions, cache, batch, num_layers=num_layers,
                                      feature_layers=feature_layers))
        cache.commit(slots, rows)
    return outs, cache


STEPS = {
    "decode": [([1, 1], None)] * 3,
    "one-request-rows": [([1, 0], None), ([4, 0], None)],
    "chains": [([3, 5], None), ([9, 2], None), ([20, 17], None)],  # skinny rows and MKL's
    "trees": [([7, 7], [-1, 0, 0, 1, 1, 2, 3]), ([1, 1], None)],
    "many-rows": [([40, 30], None), ([1, 1], None)],  # past the rows the stack keeps buffers for
}


@pytest.mark.parametrize("steps", sorted(STEPS))
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_fused_step_gives_the_python_layers_bits(base, fmt, steps):
    model = FORMATS[fmt](base)
    assert decoder_step.build_stack(model.block, model.layers) is not None
    ref, ref_cache = run(model, "python", STEPS[steps])
    got, got_cache = run(model, "fused", STEPS[steps])
    assert model.decoder_stack() is not None  # the fused path ran
    for r, o in zip(ref, got):
        assert o.dtype == r.dtype and torch.equal(o, r)
    for layer in range(model.config.num_layers):
        assert torch.equal(got_cache.k_caches[layer], ref_cache.k_caches[layer])
        assert torch.equal(got_cache.v_caches[layer], ref_cache.v_caches[layer])


def run_decode(model: Llama, path: str, steps: int = 3):
    """Prefill two requests, then ``steps`` autoregressive steps through ``Llama.decode_logits``
    (the cache's host integers on the fused path); returns every step's (hidden, logits) and
    the final caches."""
    model.step_path = path
    cache = model.new_cache(2, 128, block_size=8)
    g = torch.Generator().manual_seed(0)
    slots = []
    for n in (15, 5):  # the first request crosses a block boundary on its second step
        slot = cache.add_request()
        model.prefill(torch.randint(0, 64, (n,), generator=g), cache, slot)
        slots.append(slot)
    outs = []
    for _ in range(steps):
        outs.extend(model.decode_logits(torch.randint(0, 64, (2,), generator=g).tolist(), cache, slots))
        cache.commit(slots, 1)
    return outs, cache


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "Q4_K", "Q6_K-int8act", "mixed-parts-int8act"])
def test_decode_logits_with_host_integers_gives_the_python_bits(base, fmt):
    """``decode_logits`` hands the batch to the stack as the cache's host integers
    (``forward_logits_host``): the Python layers' bits, and the same K/V written."""
    model = FORMATS[fmt](base)
    ref, ref_cache = run_decode(model, "python")
    got, got_cache = run_decode(model, "fused")
    assert model.decoder_stack() is not None
    for r, o in zip(ref, got):
        assert o.dtype == r.dtype and torch.equal(o, r)
    for layer in range(model.config.num_layers):
        assert torch.equal(got_cache.k_caches[layer], ref_cache.k_caches[layer])
        assert torch.equal(got_cache.v_caches[layer], ref_cache.v_caches[layer])


def test_decode_logits_refuses_bad_batches(base):
    """A slot holding no request is refused before anything is written; the host call checks
    its block table's shape and its slot mapping's range like the tensor call."""
    model = FORMATS["Q4_0-int8act"](base)
    model.step_path = "fused"
    cache = model.new_cache(2, 64, block_size=8)
    slot = cache.add_request()
    model.prefill(torch.tensor([1, 2, 3]), cache, slot)
    with pytest.raises(ValueError, match="holds no request"):
        model.decode_logits([4], cache, [slot + 1])
    stack, h = model.decoder_stack(), model.embed_tokens([4])
    args = (h, [3], model.cos, model.sin, cache.k_caches, cache.v_caches)
    table, lens = cache.host_view([slot])
    with pytest.raises(RuntimeError, match="block_table"):
        stack.forward_logits_host(*args, table[:-1], [3, 3], [0, 1], [3], 3, 1, 16)
    before = [k.clone() for k in cache.k_caches]
    with pytest.raises(RuntimeError, match="slot"):
        stack.forward_logits_host(*args, table, lens, [0, 1], [10 ** 6], 3, 1, 16)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k_caches))


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_step_at_each_thread_count(base, threads):
    """The products split rows over threads; the bits do not depend on how."""
    model = FORMATS["Q4_0-int8act"](base)
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref, _ = run(model, "python", STEPS["chains"])
        got, _ = run(model, "fused", STEPS["chains"])
    finally:
        torch.set_num_threads(n)
    assert all(torch.equal(o, r) for o, r in zip(got, ref))


def test_step_timers_split_the_step_and_change_no_bits(base):
    """The benchmark's timers (``set_timing``): six non-negative totals — products, attention,
    norms, RoPE with the K/V write, SiLU, residuals — each part timed on the fp32 loop, reset by
    ``take_timings``; timing on gives the same bits as off."""
    model = FORMATS["Q4_0-int8act"](base)
    ref, _ = run(model, "fused", STEPS["decode"])
    stack = model.decoder_stack()
    stack.set_timing(True)
    try:
        stack.take_timings()
        got, _ = run(model, "fused", STEPS["decode"])
        timings = stack.take_timings()
        assert len(timings) == 6 and all(t > 0 for t in timings), timings
        assert stack.take_timings() == [0.0] * 6
    finally:
        stack.set_timing(False)
    assert all(torch.equal(o, r) for o, r in zip(got, ref))
    run(model, "fused", STEPS["decode"])
    assert stack.take_timings() == [0.0] * 6  # off: nothing accumulates


def test_concurrent_forwards_give_the_sequential_bits(base):
    """The stack keeps its activation buffers between calls; a forward that runs while another
    holds them works on buffers of its own."""
    import threading

    model = FORMATS["mixed-parts-int8act"](base)
    ref, _ = run(model, "fused", STEPS["decode"] + STEPS["chains"])
    results = [None] * 4
    def work(i):
        results[i] = run(model, "fused", STEPS["decode"] + STEPS["chains"])[0]
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in results:
        assert all(torch.equal(o, r) for o, r in zip(got, ref))


def test_truncated_stack_is_the_self_spec_prefix(base):
    """forward(num_layers=k) and the truncated model (self-speculation's draft) on the fused
    path equal the Python path's first k layers."""
    model = FORMATS["Q8_0"](base)
    ref, _ = run(model, "python", STEPS["chains"], num_layers=2)
    got, _ = run(model, "fused", STEPS["chains"], num_layers=2)
    short = run(model.truncated(2), "fused", STEPS["chains"])[0][0::2]  # its hidden states (not its logits)
    assert all(torch.equal(o, r) and torch.equal(s, r) for o, s, r in zip(got, short, ref))


def test_the_path_is_chosen_by_the_environment(monkeypatch, base):
    monkeypatch.setenv("SPECDEC_DECODE_STEP", "python")
    assert Llama(base.config, dict(embed=base.embed, norm=base.norm, lm_head=base.lm_head,
                                   layers=base.layers)).decoder_stack() is None
    monkeypatch.setenv("SPECDEC_DECODE_STEP", "compiled")
    with pytest.raises(ValueError, match="SPECDEC_DECODE_STEP must be one of"):
        decoder_step.default_path()


def test_bad_stacks_are_refused():
    """The C++ class checks what Python hands it (a layout that does not add up, a bad kind)."""
    from specdec_kernels._C import DecoderStack as make
    w = torch.zeros(8, 8)
    with pytest.raises(RuntimeError, match="parts_per_product"):
        make(2, 1, 4, 1e-6, [torch.ones(8), torch.ones(8)], [w], [0, 0, 8, -1], [1, 1, 1], [])
    with pytest.raises(RuntimeError, match="bad part kind"):
        make(2, 1, 4, 1e-6, [torch.ones(8), torch.ones(8)], [w] * 4, [7, 0, 8, -1] * 4, [1, 1, 1, 1], [])
    with pytest.raises(RuntimeError, match="bias index"):
        make(2, 1, 4, 1e-6, [torch.ones(8), torch.ones(8)], [w] * 4, [0, 0, 8, 3] * 4, [1, 1, 1, 1], [])
    with pytest.raises(RuntimeError, match="parts_per_product"):  # a final norm without the LM head's count
        make(2, 1, 4, 1e-6, [torch.ones(8)] * 3, [w] * 4, [0, 0, 8, -1] * 4, [1, 1, 1, 1], [])
    stack = make(2, 1, 4, 1e-6, [torch.ones(8), torch.ones(8)], [w] * 4, [0, 0, 8, -1] * 4, [1, 1, 1, 1], [])
    cos, sin = torch.ones(16, 4), torch.zeros(16, 4)
    caches = [torch.zeros(4, 8, 1, 4)]
    batch = (torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
             torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int64), None)
    with pytest.raises(RuntimeError, match="num_layers"):
        stack.forward(torch.zeros(1, 8), torch.zeros(1, dtype=torch.int64), cos, sin, [], [], *batch, 2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the rotary tables"):
        stack.forward(torch.zeros(1, 8), torch.tensor([16]), cos, sin, caches, caches, *batch, 1, 1, 8)
    with pytest.raises(RuntimeError, match="tables"):
        stack.forward(torch.zeros(1, 8), torch.tensor([0]), torch.ones(1, 1, 4), sin, caches, caches, *batch, 1, 1, 8)
    with pytest.raises(RuntimeError, match="built without the LM head"):
        stack.forward_logits(torch.zeros(1, 8), torch.tensor([0]), cos, sin, caches, caches, *batch, 1, 1, 8)
    for counts in ([0], [2]):  # the stack has one layer
        with pytest.raises(RuntimeError, match="layer counts must be in"):
            stack.set_capture(counts)
    stack.set_capture([1])
    with pytest.raises(RuntimeError, match="ran fewer than 1 layers"):  # no forward since
        stack.take_captured()
    assert stack.take_captured() == []  # a take clears the request
    # A slot past the cache, on the fp32 loop (contiguous caches) and on the general one
    # (a non-contiguous cache): refused before anything is written.
    shapes = [(16, 8), (8, 8), (16, 8), (8, 8)]  # q|k|v, o, gate|up, down of a layer that adds up
    stack = make(2, 1, 4, 1e-6, [torch.ones(8), torch.ones(8)], [torch.randn(*s) for s in shapes],
                 [0, 0, 16, -1, 0, 0, 8, -1, 0, 0, 16, -1, 0, 0, 8, -1], [1, 1, 1, 1], [])
    bad = batch[:3] + (torch.tensor([32]), None)
    for cache, message in ((torch.zeros(4, 8, 1, 4), r"slot_mapping\[0\] = 32 is out of range \[0, 32\)"),
                           (torch.zeros(4, 8, 1, 8)[..., :4], "index 32 is out of bounds")):
        with pytest.raises((RuntimeError, IndexError), match=message):
            stack.forward(torch.ones(1, 8), torch.tensor([0]), cos, sin, [cache], [cache.clone()], *bad, 1, 1, 8)
        assert not cache.any()


@pytest.mark.parametrize("fmt,int8", [(None, False), ("Q8_0", False), ("Q8_0", True), ("Q4_0", True)])
def test_eagle_head_halves_give_the_python_blocks_bits(base, fmt, int8):
    """The EAGLE head's decode halves (``decode_qkv`` / ``decode_output``) on its one-layer
    stack equal its Python decode block, for every decode format."""
    from specdec_kernels.drafting.eagle.head import EagleHead

    target = base.quantized("Q8_0")
    head = EagleHead.for_target(target, torch.arange(40)).set_decode_format(fmt, int8_activations=int8)
    g = torch.Generator().manual_seed(1)
    feats, toks = torch.randn(5, base.config.hidden_size, generator=g), torch.randint(0, 64, (5,), generator=g)
    positions = torch.tensor([3, 4, 4, 5, 9])
    results = {}
    for path in ("python", "fused"):
        head.step_path = path
        x = head.decode_inputs(feats, toks)
        q, k, v = head.decode_qkv(x, positions)
        attn = torch.randn(5, base.config.num_heads * base.config.head_dim, generator=torch.Generator().manual_seed(2))
        results[path] = (q, k, v, *head.decode_output(x, attn))
    assert head.decode_stack(torch.float32) is not None
    assert all(torch.equal(a, b) for a, b in zip(results["fused"], results["python"]))


@pytest.mark.parametrize("fmt,int8", [(None, False), ("Q8_0", True)])
def test_eagle_head_layer_in_one_call_gives_the_python_bits(base, fmt, int8):
    """``decode_layer`` (the drafter's depth: the layer over the head's paged cache, the final
    norm and the draft LM head) in one C++ call equals the Python halves around
    ``tree_attention``: g, the log-probs and the K/V written, for two requests of 3 and 2 rows."""
    from specdec_kernels.drafting.eagle.head import EagleHead
    from specdec_kernels.kv_cache import PagedKVCache

    target = base.quantized("Q8_0")
    head = EagleHead.for_target(target, torch.arange(40)).set_decode_format(fmt, int8_activations=int8)
    g = torch.Generator().manual_seed(1)
    feats, toks = torch.randn(5, base.config.hidden_size, generator=g), torch.randint(0, 64, (5,), generator=g)
    results = {}
    for path in ("python", "fused"):
        head.step_path = path
        cache = PagedKVCache(1, head.num_kv_heads, head.head_dim, num_blocks=8, block_size=4, max_batch=2,
                             max_blocks_per_seq=4)
        slots = [cache.add_request(), cache.add_request()]
        for slot, n in zip(slots, (6, 2)):  # committed entries with K/V of their own
            new = cache.append_slots([slot], [n])
            kv = torch.randn(n, head.num_kv_heads, head.head_dim, generator=torch.Generator().manual_seed(n))
            cache.write(0, new.slot_mapping, kv, -kv)
            cache.commit([slot], [n])
        new = cache.append_slots(slots, [3, 2])
        bt, pl = cache.batch_view(slots)
        positions = torch.tensor([6, 7, 8, 2, 3])
        x = head.decode_inputs(feats, toks)
        results[path] = (*head.decode_layer(x, positions, cache, bt, pl, new.qo_indptr, new.slot_mapping),
                         cache.k_caches[0].clone(), cache.v_caches[0].clone())
    assert head.decode_stack(torch.float32) is not None
    assert all(torch.equal(a, b) for a, b in zip(results["fused"], results["python"]))


@pytest.mark.parametrize("name,weights", [("smollm2-135m", "native"), ("smollm2-135m", "native-int8act"),
                                          ("qwen2.5-coder-0.5b", "native"),
                                          ("qwen2.5-coder-0.5b", "native-int8act")])
def test_real_models_fused_step_gives_the_python_bits(name, weights):
    """The real files' own mixes of block types (the 0.5B: Q5_0, Q8_0, Q6_K and Q4_K, Qwen2's
    biases): a prefill, then decode and verification rows, on both paths."""
    from specdec_kernels.models import load_model
    from tests.helpers import require_real_model

    model, _ = load_model(require_real_model(name), weights=weights)
    ref, ref_cache = run(model, "python", STEPS["chains"][:2] + STEPS["trees"])
    got, got_cache = run(model, "fused", STEPS["chains"][:2] + STEPS["trees"])
    assert all(torch.equal(o, r) for o, r in zip(got, ref))
    assert all(torch.equal(a, b) for a, b in zip(got_cache.k_caches + got_cache.v_caches,
                                                  ref_cache.k_caches + ref_cache.v_caches))


@pytest.mark.parametrize("steps", ["decode", "trees", "many-rows"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "Q4_0-int8act"])
def test_feature_layers_are_the_earlier_layers_states(base, fmt, steps):
    """``feature_layers`` (EAGLE-3's fused features): the hidden states come as [T, (k + 1) H],
    the states after those layer counts then the last layer's, the same bits on both paths;
    the last layer's states, the logits and the caches are those of a forward without them,
    and each earlier state is that of a forward through that many layers."""
    model = FORMATS[fmt](base)
    H = model.config.hidden_size
    plain, plain_cache = run(model, "fused", STEPS[steps])
    for path in ("python", "fused"):
        got, cache = run(model, path, STEPS[steps], feature_layers=(1, 2))
        for i in range(0, len(got), 2):
            hidden, logits = got[i], got[i + 1]
            assert hidden.shape == (plain[i].shape[0], 3 * H)
            assert torch.equal(hidden[:, 2 * H:], plain[i]) and torch.equal(logits, plain[i + 1])
        for layer in range(model.config.num_layers):
            assert torch.equal(cache.k_caches[layer], plain_cache.k_caches[layer])
        for count in (1, 2):
            through, _ = run(model, path, STEPS[steps], num_layers=count)
            for i, h in enumerate(through):
                assert torch.equal(got[2 * i][:, (count - 1) * H: count * H], h), (path, count)
        shallow, _ = run(model, path, STEPS[steps], num_layers=2, feature_layers=(1,))
        assert torch.equal(shallow[0][:, :H], got[0][:, :H])


@pytest.mark.parametrize("path", ["python", "fused"])
def test_decode_step_feature_layers(base, path):
    """The autoregressive step (``decode_logits``, the host-integer call on the fused path)
    returns the same feature rows as ``forward_logits``; a layer count outside the model is
    a ValueError before anything is written."""
    model = FORMATS["Q4_0-int8act"](base)
    model.step_path = path
    H = model.config.hidden_size
    outs = []
    for features in ((), (2,)):
        cache = model.new_cache(2, 64, block_size=8)
        slots = [cache.add_request(), cache.add_request()]
        for slot, n in zip(slots, (6, 3)):
            model.prefill(torch.arange(1, n + 1), cache, slot)
        outs.append(model.decode_logits([7, 9], cache, slots, feature_layers=features))
        cache.commit(slots, [1, 1])
    (plain, plain_logits), (feats, logits) = outs
    assert feats.shape == (2, 2 * H) and torch.equal(feats[:, H:], plain) and torch.equal(logits, plain_logits)
    lengths = [cache.length(s) for s in slots]
    for bad in ((0,), (4,), (1.5,)):
        with pytest.raises(ValueError, match="feature layers"):
            model.decode_logits([7, 9], cache, slots, feature_layers=bad)
    assert [cache.length(s) for s in slots] == lengths
    with pytest.raises(ValueError, match="feature layers"):
        run(model, path, STEPS["decode"], num_layers=1, feature_layers=(2,))
