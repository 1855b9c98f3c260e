"""The package's layout: no module imports another that imports it back (directly or through
others), and no module imports another one's private (underscore) names.

Imports are read from the source (``ast``), function-level (lazy) imports included: a lazy
import only hides a cycle until both modules are loaded."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "specdec_kernels"
# Our own top-level packages: private names of third-party modules are not our concern here.
OWN = (PACKAGE, "python_ref", "tests", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(*tops: str) -> dict:
    """{module name: path} of every .py file under the given top-level folders."""
    return {module_name(p): p for top in tops for p in sorted((ROOT / top).rglob("*.py"))}


def imports(name: str, path: Path, known: dict):
    """(line, imported module, imported names) for every import statement of ``name``. The
    imported module is resolved to a file of ``known`` where there is one: ``from .x import
    y`` imports module ``pkg.x.y`` when that is a file, else names of ``pkg.x``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    yield node.lineno, sub, []
                else:
                    yield node.lineno, target, [alias.name]


def import_graph() -> dict:
    """{module: {package modules it imports}} over the package's modules."""
    known = modules(PACKAGE)
    graph = {name: set() for name in known}
    for name, path in known.items():
        for _, target, _ in imports(name, path, known):
            if target in known and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_relative_and_lazy_imports():
    graph = import_graph()
    assert f"{PACKAGE}.ops" in graph[f"{PACKAGE}.models.block"]  # from .. import ops
    assert f"{PACKAGE}.ops" in graph[f"{PACKAGE}.kv_cache"]  # lazy, inside PagedKVCache.compact
    assert f"{PACKAGE}.decoding.registry" in graph[f"{PACKAGE}.cli"]
    assert f"{PACKAGE}.triton" in graph[PACKAGE]  # from . import triton as _triton_kernels


def test_no_import_cycle_between_package_modules():
    found = cycles(import_graph())
    assert not found, "modules that import each other (directly or through others): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_no_private_names_imported_across_modules():
    known = modules(*OWN)
    found = []
    for name, path in known.items():
        for line, target, names in imports(name, path, known):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target != name and target.split(".")[0] in OWN:
                found.append(f"{path.relative_to(ROOT)}:{line}: {private} from {target}")
    assert not found, "\n".join(found)
