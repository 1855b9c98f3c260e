"""Smoke test of an installed specdec_kernels wheel (run by .ci/wheel_smoke.sh).

Run with ``python -I`` from a directory outside the source tree, so that only the installed
package can be imported. Checks: the package and its compiled extension come from the
venv's site-packages; every module of the package imports (a module that imports something
only the source tree has, such as python_ref or tests, fails here); every package-data file
of the source tree is installed; every op runs through its wrapper on CPU and gives a
plausible result. ``specdec generate`` is run by the shell script.

Usage: python -I wheel_smoke.py SOURCE_TREE
"""
import importlib
import importlib.util
import math
import pkgutil
import sys
from importlib import resources
from pathlib import Path


def main(source_tree: str) -> None:
    source = Path(source_tree).resolve()
    assert not any(Path(p or ".").resolve() == source for p in sys.path), f"the source tree is on sys.path: {sys.path}"

    import torch  # noqa: F401  (libtorch first, as the package itself does)

    import specdec_kernels
    from specdec_kernels import _C

    installed = Path(specdec_kernels.__file__).resolve().parent
    assert "site-packages" in installed.parts and source not in installed.parents, f"imported from {installed}"
    assert Path(_C.__file__).resolve().parent == installed, f"_C loaded from {_C.__file__}"
    print(f"specdec_kernels {specdec_kernels.__version__} from {installed}")

    # Every module imports without the source tree (pkgutil finds them in the install).
    modules = [m.name for m in pkgutil.walk_packages([str(installed)], prefix="specdec_kernels.")]
    has_vllm = importlib.util.find_spec("vllm") is not None
    skipped = []
    for name in modules:
        if name.startswith("specdec_kernels.triton") and not specdec_kernels.HAS_TRITON:
            skipped.append(name)  # the optional extra (pip install specdec_kernels[triton])
            continue
        if name.startswith("specdec_kernels.integrations.vllm.") and not has_vllm:
            # The vLLM adapter's modules import vLLM (the package itself, which vLLM's plugin
            # entry point loads, must import without it: checked here). .ci/vllm tests them.
            if name.rsplit(".", 1)[1] not in ("compat",):
                skipped.append(name)
                continue
        importlib.import_module(name)
    print(f"imported {len(modules) - len(skipped)} modules ({len(skipped)} need an optional package: "
          f"{', '.join(skipped) or 'none'})")

    # Every package-data file of the source tree is in the install.
    data = sorted(p.relative_to(source / "specdec_kernels") for p in (source / "specdec_kernels" / "data").rglob("*")
                  if p.is_file())
    assert data, "the source tree has no package data?"
    for rel in data:
        assert resources.files("specdec_kernels").joinpath(str(rel)).is_file(), f"package data missing: {rel}"
    print(f"package data: {', '.join(map(str, data))}")
    run_every_op()


def run_every_op() -> None:
    """Every op of ``specdec_kernels.list_ops()`` through its wrapper on CPU, with a plausible
    result (an op added to the package and not run here fails the last assertion)."""
    import torch

    import specdec_kernels
    from specdec_kernels import ops

    gen = torch.Generator().manual_seed(0)
    i32 = torch.int32

    # philox_uniform
    u = ops.philox_uniform(torch.tensor([1, 2]), torch.tensor([0, 5]), 3, 1, 8)
    assert u.shape == (2, 8) and bool(((u > 0) & (u <= 1)).all())

    # chain / tree rejection sampling (greedy rows checked exactly)
    logits = torch.randn(2, 3, 50, generator=gen)
    drafts = logits[:, :2].argmax(-1)
    out, acc = ops.chain_rejection_sample(drafts, torch.tensor([2, 2], dtype=i32), logits, None,
                                          torch.tensor([0.0, 0.9]), torch.tensor([1, 2]), torch.tensor([0, 0]))
    assert acc[0] == 2 and out[0].tolist() == [*drafts[0].tolist(), int(logits[0, 2].argmax())]
    assert 0 <= int(acc[1]) <= 2
    # the flattened layout: the same two requests' drafts and logits rows, no padding
    flat_out, flat_acc = ops.chain_rejection_sample_flat(drafts.reshape(-1), torch.tensor([2, 4], dtype=i32),
                                                         logits.reshape(-1, 50), None, torch.tensor([0.0, 0.9]),
                                                         torch.tensor([1, 2]), torch.tensor([0, 0]))
    assert flat_out.tolist() == out.tolist() and flat_acc.tolist() == acc.tolist()
    parents = torch.tensor([[-1, 0, 1]], dtype=i32)
    tokens = torch.tensor([[0, int(logits[0, 0].argmax()), int(logits[0, 1].argmax())]])
    nodes, out, acc = ops.tree_rejection_sample(parents, tokens, torch.tensor([3], dtype=i32), logits[:1], None,
                                                torch.zeros(1), torch.zeros(1, dtype=torch.int64),
                                                torch.zeros(1, dtype=torch.int64))
    assert nodes.tolist() == [[1, 2]] and int(acc[0]) == 2

    # apply_top_k_top_p
    masked = ops.apply_top_k_top_p(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), torch.tensor([2], dtype=i32), inplace=False)
    assert masked.tolist() == [[-math.inf, 3.0, 2.0, -math.inf]]

    # tree_attention: one node over a 5-token prefix equals softmax attention
    q = torch.randn(1, 2, 64, generator=gen)
    k_cache = torch.randn(1, 8, 1, 64, generator=gen)
    v_cache = torch.randn(1, 8, 1, 64, generator=gen)
    att = ops.tree_attention(q, k_cache, v_cache, torch.tensor([[0]], dtype=i32), torch.tensor([5], dtype=i32),
                             torch.tensor([0, 1], dtype=i32))
    scores = torch.einsum("hd,ld->hl", q[0], k_cache[0, :6, 0]) / 8
    torch.testing.assert_close(att[0], torch.softmax(scores, -1) @ v_cache[0, :6, 0], atol=1e-5, rtol=1e-5)

    # compact_kv: node 2's K/V moves next to the root
    k = [torch.arange(8.0).reshape(1, 8, 1, 1).repeat(1, 1, 1, 4)]
    v = [-k[0].clone()]
    ops.compact_kv(k, v, torch.tensor([[0]], dtype=i32), torch.tensor([3], dtype=i32),
                   torch.tensor([[2]], dtype=i32), torch.tensor([1], dtype=i32))
    assert k[0][0, 4, 0, 0] == 5.0 and v[0][0, 4, 0, 0] == -5.0

    # medusa_topk and skinny_linear / linear
    hidden = torch.randn(2, 16, generator=gen)
    ids, logprobs = ops.medusa_topk(hidden, torch.zeros(2, 0, 16, 16), torch.zeros(2, 0, 16),
                                    torch.randn(30, 16, generator=gen), 3)
    assert ids.shape == (2, 2, 3) and bool((logprobs <= 0).all())
    x, w = torch.randn(4, 16, generator=gen), torch.randn(8, 16, generator=gen)
    torch.testing.assert_close(ops.skinny_linear(x, w), x @ w.T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.linear(x, w), x @ w.T, atol=1e-5, rtol=1e-5)

    # quantized_linear on F32 blocks (GGML type 0: the weight's fp32 bytes as they are), then
    # on every block format it reads (the K-quants: super-blocks of 256 weights)
    torch.testing.assert_close(ops.quantized_linear(x, w.view(torch.uint8), 0), x @ w.T, atol=1e-5, rtol=1e-5)
    from specdec_kernels import gguf_blocks

    xk = torch.randn(3, 512, generator=gen)
    for name in gguf_blocks.TYPES:
        qw = gguf_blocks.quantize(torch.randn(9, 512, generator=gen), name)
        torch.testing.assert_close(ops.quantized_linear(xk, qw.blocks, qw.block_type), xk @ qw.dequantize().T,
                                   atol=1e-4, rtol=1e-4, msg=lambda m: f"quantized_linear on {name}: {m}")

    # int8_activation_linear on Q8_0 blocks: integer weights with a power-of-two scale and
    # activations that quantise exactly (integers with max |x| = 127), so the result is exact
    xq = torch.randint(-127, 128, (3, 64), generator=gen).float()
    xq[:, 0], xq[:, 32] = 127.0, 127.0  # each block's max |x| is 127: d_x = 1, q = x
    wq = torch.randint(-127, 128, (20, 64), generator=gen).float() / 64
    q8 = gguf_blocks.quantize(wq, "Q8_0")
    out8 = ops.int8_activation_linear(xq, gguf_blocks.pack_int8_activation(q8.blocks, "Q8_0"), q8.block_type, 20)
    torch.testing.assert_close(out8, xq @ q8.dequantize().T, atol=1e-3, rtol=1e-5)

    xr, wr = torch.randn(3, 48, generator=gen), torch.randn(48, generator=gen)
    torch.testing.assert_close(ops.rms_norm(xr, wr, 1e-6), torch.nn.functional.rms_norm(xr, (48,), wr, 1e-6),
                               atol=1e-5, rtol=1e-5)
    gu = torch.randn(3, 96, generator=gen) * 4
    torch.testing.assert_close(ops.silu_and_mul(gu), torch.nn.functional.silu(gu[:, :48]) * gu[:, 48:],
                               atol=1e-5, rtol=1e-5)

    ran = {"philox_uniform", "rms_norm", "silu_and_mul", "chain_rejection_sample", "chain_rejection_sample_flat", "tree_rejection_sample", "apply_top_k_top_p", "tree_attention",
           "compact_kv", "medusa_topk", "skinny_linear", "quantized_linear", "int8_activation_linear"}
    assert set(specdec_kernels.list_ops()) == ran, f"ops not run here: {set(specdec_kernels.list_ops()) - ran}"
    print("every op ran on CPU")


if __name__ == "__main__":
    main(sys.argv[1])
