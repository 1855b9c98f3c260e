"""The repository's text points at nothing outside it: no path into the parent folder's
shared directory and no copy of its design file's name (the design document is docs/design.md).
Every tracked text file is read, this one included; the patterns are split so it holds neither."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = ("../" + "shared", "shared/" + "DESIGN")  # split so that this file holds neither


def tracked_text_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = []
    for name in names.decode().split("\0"):
        path = ROOT / name
        if name and path.is_file():
            data = path.read_bytes()
            if b"\0" not in data[:8192]:  # text, not a binary such as a PNG or safetensors file
                files.append(path)
    return files


def test_no_reference_outside_the_repository():
    files = tracked_text_files()
    assert any(f.name == "README.md" for f in files)
    hits = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in files
            for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
            if any(p in line for p in FORBIDDEN)]
    assert not hits, "references outside the repository:\n" + "\n".join(hits)
