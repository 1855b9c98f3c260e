"""The argument checks live in one module (specdec_kernels.checks) and run once per call:
in the wrapper on CPU, in the Triton launcher on CUDA (torch.ops reaches it directly)."""
import ast
import pathlib

import pytest
import torch

import specdec_kernels
from specdec_kernels import checks
from tests.helpers import requires_triton

PACKAGE = pathlib.Path(specdec_kernels.__file__).parent
i32, i64 = torch.int32, torch.int64


def _imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_checks_module_imports_only_torch():
    assert _imported_modules(PACKAGE / "checks.py") <= {"__future__", "torch"}


def test_triton_launchers_import_checks_not_the_wrappers():
    for path in sorted((PACKAGE / "triton").glob("*.py")):
        imported = _imported_modules(path)
        assert "..ops" not in imported and "specdec_kernels.ops" not in imported, path.name


def test_wrappers_define_no_checks_of_their_own():
    # The op checks are checks.check_<op>; ops.py keeps only conversions and allocation.
    from specdec_kernels import ops

    assert not [name for name in vars(ops) if "check" in name.lower() and name != "checks"]


# ---------------------------------------------------------------------------------------
# One good call per op: (wrapper call, name of the check, launcher module, launcher call).
# ---------------------------------------------------------------------------------------


def _chain():
    args = (torch.randint(0, 16, (2, 3)), torch.tensor([3, 1], dtype=i32), torch.randn(2, 4, 16), None,
            torch.ones(2), torch.tensor([1, 2]), torch.zeros(2, dtype=i64))
    outs = (torch.empty(2, 4, dtype=i64), torch.empty(2, dtype=i32))
    return (lambda: specdec_kernels.chain_rejection_sample(*args), "check_chain_rejection_sample",
            "rejection_sampling", lambda tr: tr.chain_rejection_sample(*args, *outs))


def _chain_flat():
    # Requests of 3 and 1 drafts: drafts [4], logits [4 + 2, V].
    args = (torch.randint(0, 16, (4,)), torch.tensor([3, 4], dtype=i32), torch.randn(6, 16), None, torch.ones(2),
            torch.tensor([1, 2]), torch.zeros(2, dtype=i64))
    outs = (torch.empty(2, 4, dtype=i64), torch.empty(2, dtype=i32))
    return (lambda: specdec_kernels.chain_rejection_sample_flat(*args), "check_chain_rejection_sample_flat",
            "rejection_sampling", lambda tr: tr.chain_rejection_sample_flat(*args, *outs))


def _tree():
    args = (torch.tensor([[-1, 0, 0, 1]], dtype=i32), torch.randint(0, 16, (1, 4)), torch.tensor([4], dtype=i32),
            torch.randn(1, 4, 16), None, torch.ones(1), torch.tensor([1]), torch.zeros(1, dtype=i64))
    outs = (torch.empty(1, 3, dtype=i32), torch.empty(1, 4, dtype=i64), torch.empty(1, dtype=i32))
    return (lambda: specdec_kernels.tree_rejection_sample(*args), "check_tree_rejection_sample",
            "rejection_sampling", lambda tr: tr.tree_rejection_sample(*args, *outs))


def _top_k_top_p():
    logits, top_k = torch.randn(3, 8), torch.tensor([1, 2, 3], dtype=i32)
    return (lambda: specdec_kernels.apply_top_k_top_p(logits.clone(), top_k), "check_apply_top_k_top_p",
            "rejection_sampling", lambda tr: tr.apply_top_k_top_p(logits.clone(), top_k, None, None))


def _attention():
    args = (torch.randn(3, 2, 16), torch.randn(4, 4, 1, 16), torch.randn(4, 4, 1, 16),
            torch.tensor([[0, 1]], dtype=i32), torch.tensor([2], dtype=i32), torch.tensor([0, 3], dtype=i32))
    return (lambda: specdec_kernels.tree_attention(*args), "check_tree_attention", "tree_attention",
            lambda tr: tr.tree_attention(*args, None, 0.25, torch.empty(3, 2, 16), None))


def _compact():
    args = ([torch.randn(4, 4, 1, 8) for _ in range(2)], [torch.randn(4, 4, 1, 8) for _ in range(2)],
            torch.tensor([[0, 1]], dtype=i32), torch.tensor([2], dtype=i32), torch.tensor([[1, 2]], dtype=i32),
            torch.tensor([2], dtype=i32))
    return (lambda: specdec_kernels.compact_kv(*args), "check_compact_kv", "kv_compaction",
            lambda tr: tr.compact_kv_triton(*args))


def _skinny():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    return (lambda: specdec_kernels.skinny_linear(x, w), "check_skinny_linear", "linear",
            lambda tr: tr.skinny_linear(x, w, None, torch.empty(2, 4)))


def _medusa():
    args = (torch.randn(2, 8), torch.randn(1, 1, 8, 8), torch.randn(1, 1, 8), torch.randn(16, 8), 3)
    outs = (torch.empty(2, 1, 3, dtype=i64), torch.empty(2, 1, 3))
    return (lambda: specdec_kernels.medusa_topk(*args), "check_medusa_topk", "medusa",
            lambda tr: tr.medusa_topk(*args, *outs))


CASES = [_chain, _chain_flat, _tree, _top_k_top_p, _attention, _compact, _skinny, _medusa]


def _counting(monkeypatch, owner, name):
    calls = []
    original = getattr(owner, name)

    def counted(*args):
        calls.append(name)
        return original(*args)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.strip("_"))
def test_wrapper_on_cpu_checks_once(case, monkeypatch):
    wrapper_call, check_name, _, _ = case()
    calls = _counting(monkeypatch, checks, check_name)
    wrapper_call()
    assert calls == [check_name]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.strip("_"))
def test_wrapper_leaves_the_check_to_the_launcher_on_cuda(case, monkeypatch):
    # On CUDA the op dispatches to the Triton launcher, which runs the check: the wrapper
    # does not. (Simulated on CPU tensors: launcher_checks says yes, the C++ kernel runs.)
    wrapper_call, check_name, _, _ = case()
    calls = _counting(monkeypatch, checks, check_name)
    monkeypatch.setattr(checks, "launcher_checks", lambda device: True)
    wrapper_call()
    assert calls == []


@requires_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.strip("_"))
def test_triton_launcher_runs_the_same_check_once(case, monkeypatch):
    import importlib

    _, check_name, module, launcher_call = case()
    launchers = importlib.import_module(f"specdec_kernels.triton.{module}")
    assert getattr(launchers, check_name) is getattr(checks, check_name)
    calls = _counting(monkeypatch, launchers, check_name)
    launcher_call(launchers)
    assert calls == [check_name]


def test_launcher_checks_only_cuda():
    assert checks.launcher_checks(torch.device("cuda", 0))
    assert not checks.launcher_checks(torch.device("cpu"))
    assert not checks.launcher_checks(torch.device("meta"))


# ---------------------------------------------------------------------------------------
# Memory shared by two arguments (outputs over inputs, a cache layer given twice).
# ---------------------------------------------------------------------------------------


def test_shares_memory_reports_what_certainly_overlaps():
    buf = torch.zeros(4, 8)
    assert checks.shares_memory(buf, buf)
    assert checks.shares_memory(buf[1:3], buf[2:])  # dense, overlapping byte ranges
    assert checks.shares_memory(buf.t(), buf)  # one start address
    assert not checks.shares_memory(buf[:2], buf[2:])  # adjacent rows
    assert not checks.shares_memory(buf[:, 0::2], buf[:, 1::2])  # interleaved, no common element
    assert not checks.shares_memory(buf, torch.zeros(4, 8))
    assert not checks.shares_memory(buf[:0], buf)  # no elements
    meta = torch.zeros(4, 8, device="meta")
    assert not checks.shares_memory(meta, meta)  # no data


def test_outputs_sharing_memory_with_inputs_name_both():
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match="out must not share memory with x"):
        specdec_kernels.skinny_linear(x, torch.randn(4, 4), out=x)
    parents = torch.tensor([[-1, 0, 0, 1]], dtype=i32)
    tokens = torch.randint(0, 16, (1, 4))
    with pytest.raises(ValueError, match="output_token_ids must not share memory with tree_token_ids"):
        specdec_kernels.tree_rejection_sample(parents, tokens, torch.tensor([4], dtype=i32), torch.randn(1, 4, 16),
                                              output_token_ids=tokens)
    accepted = torch.empty(1, 4, dtype=i32)
    with pytest.raises(ValueError, match="accepted_nodes must not share memory with num_accepted"):
        specdec_kernels.tree_rejection_sample(parents, tokens, torch.tensor([4], dtype=i32), torch.randn(1, 4, 16),
                                              accepted_nodes=accepted[:, :3], num_accepted=accepted[:, 2])
    drafts = torch.randint(0, 16, (1, 3))
    with pytest.raises(ValueError, match="num_accepted must not share memory with num_draft_tokens"):
        counts = torch.tensor([3], dtype=i32)
        specdec_kernels.chain_rejection_sample(drafts, counts, torch.randn(1, 4, 16), num_accepted=counts)


def test_cache_layers_given_twice_name_both():
    k = [torch.zeros(4, 4, 1, 8) for _ in range(2)]
    v = [torch.zeros(4, 4, 1, 8) for _ in range(2)]
    rest = (torch.tensor([[0, 1]], dtype=i32), torch.tensor([2], dtype=i32), torch.tensor([[1, 2]], dtype=i32),
            torch.tensor([2], dtype=i32))
    with pytest.raises(ValueError, match=r"k_caches\[1\] and v_caches\[0\] share memory"):
        specdec_kernels.compact_kv(k, [k[1], v[1]], *rest)
    pool = torch.zeros(4, 4, 4, 1, 8)  # layer-minor: the layers interleave, sharing no element
    specdec_kernels.compact_kv([pool[:, :, 0], pool[:, :, 1]], [pool[:, :, 2], pool[:, :, 3]], *rest)


@requires_triton
def test_launcher_refuses_meta_logits():
    from specdec_kernels.triton import rejection_sampling as tr

    with pytest.raises(ValueError, match="logits is a meta tensor"):
        tr.apply_top_k_top_p(torch.zeros(2, 8, device="meta"), None, None, None)
