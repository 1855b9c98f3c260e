"""specdec_kernels: kernels for lossless speculative decoding.

Importing the package loads the compiled library (``specdec_kernels._C``), which registers
the ``torch.ops.specdec.*`` schemas and their C++ CPU kernels, then the fakes (``ops``)
and, when Triton is installed, the Triton kernels for the CUDA key.
"""
import importlib.util
import os
import platform

import torch  # noqa: F401  (loads libtorch, which _C links against)

# setup.py compiles the x86-64 extension with AVX2, FMA and F16C.
REQUIRED_X86_FEATURES = ("avx2", "fma", "f16c")


def missing_cpu_features(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The x86-64 features the compiled kernels use that this CPU lacks ([] elsewhere)."""
    if platform.machine() != "x86_64" or not os.path.exists(cpuinfo):
        return []
    with open(cpuinfo) as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return [feat for feat in REQUIRED_X86_FEATURES if feat not in flags]
    return []


# Without them a kernel would die with SIGILL mid-run; say so at import instead.
_missing = missing_cpu_features()
if _missing:
    raise ImportError(f"specdec_kernels' C++ kernels are compiled for x86-64 CPUs with "
                      f"{', '.join(REQUIRED_X86_FEATURES)}; this CPU lacks {', '.join(_missing)}")

from . import _C  # noqa: E402,F401  (registers torch.ops.specdec.*)
from . import ops  # noqa: E402
from .ops import *  # noqa: E402,F401,F403

# Triton is optional: CPU-only installs work without it. (The probe must not bind the name
# `triton` here: `from . import triton` would then return the top-level package instead of
# specdec_kernels/triton/, and no Triton kernel would be registered.)
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    from . import triton as _triton_kernels  # noqa: F401  (registers the CUDA kernels)

__version__ = "0.1.0"
