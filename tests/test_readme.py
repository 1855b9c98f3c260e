"""The README's and docs/' Python code runs as written (```python blocks, in order, one
namespace per file; ```bash blocks, and ```py blocks that need software the test venv does
not have, such as vLLM, are not run), and the README stays a short page whose links work."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def run_blocks(path: pathlib.Path) -> dict:
    blocks = python_blocks(path.read_text())
    assert blocks, f"{path.name} has no ```python block"
    namespace = {"__name__": "readme"}
    for block in blocks:
        exec(compile(block, str(path), "exec"), namespace)
    return namespace


def test_python_blocks_are_found():
    blocks = python_blocks("text\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = x\n```\n")
    assert blocks == ["x = 1\n", "y = x\n"]


def test_readme_python_blocks_run(capsys):
    text = README.read_text()
    assert "## Use from Python" in text
    namespace = run_blocks(README)
    answer = capsys.readouterr().out
    assert answer.strip()  # the model's answer, text out
    assert type(namespace["model"]).__name__ == "Llama"


def test_ops_example_runs(capsys):
    namespace = run_blocks(ROOT / "docs" / "ops.md")
    assert "tree_attention" in capsys.readouterr().out  # the op listing
    assert namespace["num_accepted"].shape == (2,) and namespace["attn"].shape == (7, 4, 16)


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "ops.md" and python_blocks(d.read_text())],
                         ids=lambda d: d.name)
def test_docs_python_blocks_run(doc):
    run_blocks(doc)


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 160
    pages = [(README, ROOT, r"\]\(((?:docs/)?[\w.-]+\.md)?(?:#([\w.-]+))?\)")]
    pages += [(doc, ROOT / "docs", r"\]\(([\w.-]+\.md)?(?:#([\w.-]+))?\)") for doc in DOCS]
    for doc, base, link in pages:  # links to pages and their anchors, within a page too
        for page, anchor in re.findall(link, doc.read_text()):
            if not page and not anchor:
                continue
            target = base / page if page else doc
            assert target.exists(), f"{doc.name} -> {page}"
            if anchor:
                headings = [re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                            for h in re.findall(r"^#+ (.*)$", target.read_text(), flags=re.M)]
                assert anchor in headings, f"{doc.name} -> {page}#{anchor}"


def test_every_command_of_the_readme_exists():
    """The `specdec` subcommands and bench scripts the README names are real."""
    from specdec_kernels.cli import build_parser

    text = README.read_text()
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    for name in re.findall(r"`specdec ([a-z-]+)", text):
        assert name in commands, name
    for script in re.findall(r"python (bench/\w+\.py)", text):
        assert (ROOT / script).exists(), script
