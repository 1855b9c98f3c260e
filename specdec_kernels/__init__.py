"""specdec_kernels: kernels for lossless speculative decoding.

Importing the package loads the compiled library (``specdec_kernels._C``), which registers
the ``torch.ops.specdec.*`` schemas and their C++ CPU kernels, then the fakes (``ops``)
and, when Triton is installed, the Triton kernels for the CUDA key.
"""
import importlib.util

import torch  # noqa: F401  (loads libtorch, which _C links against)

from . import _C  # noqa: F401  (registers torch.ops.specdec.*)
from . import ops
from .ops import *  # noqa: F401,F403

# Triton is optional: CPU-only installs work without it. (The probe must not bind the name
# `triton` here: `from . import triton` would then return the top-level package instead of
# specdec_kernels/triton/, and no Triton kernel would be registered.)
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    from . import triton as _triton_kernels  # noqa: F401  (registers the CUDA kernels)

__version__ = "0.1.0"
