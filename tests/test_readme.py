"""The README's Python code runs as written (```python blocks, in order, in one namespace;
```bash blocks, and ```py blocks that need software the test venv does not have, such as
vLLM, are not run)."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_python_blocks_are_found():
    blocks = python_blocks("text\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = x\n```\n")
    assert blocks == ["x = 1\n", "y = x\n"]


def test_readme_python_blocks_run(capsys):
    text = README.read_text()
    blocks = python_blocks(text)
    assert blocks, "the README has no ```python block"
    assert "## Use from Python" in text
    namespace = {"__name__": "readme"}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    printed = capsys.readouterr().out
    assert "tree_attention" in printed  # the op listing
    assert namespace["num_accepted"].shape == (2,) and namespace["attn"].shape == (7, 4, 16)
