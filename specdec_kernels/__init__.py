"""specdec_kernels: kernels for lossless speculative decoding.

Importing the package loads the compiled library (``specdec_kernels._C``), which registers
the ``torch.ops.specdec.*`` schemas and their C++ CPU kernels, then the fakes (``ops``)
and, when Triton is installed, the Triton kernels for the CUDA key.
"""
import torch  # noqa: F401  (loads libtorch, which _C links against)

from . import _C  # noqa: F401  (registers torch.ops.specdec.*)
from . import ops
from .ops import *  # noqa: F401,F403

try:
    import triton  # noqa: F401
except ImportError:  # Triton is optional: CPU-only installs work without it.
    HAS_TRITON = False
else:
    HAS_TRITON = True
    from . import triton as _triton_kernels  # noqa: F401

__version__ = "0.1.0"
