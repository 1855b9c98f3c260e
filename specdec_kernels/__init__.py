"""specdec_kernels: kernels for lossless speculative decoding.

Importing the package loads the compiled library (``specdec_kernels._C``), which registers
the ``torch.ops.specdec.*`` schemas and their C++ CPU kernels, then the fakes (``ops``)
and, when Triton is installed, the Triton kernels for the CUDA key. ``list_ops()`` names
the ops; the typed wrappers of the same names (``specdec_kernels.tree_attention(...)``
etc.) are the friendlier way to call them.
"""
import torch as _torch  # loads libtorch, which _C links against

from . import _platform
from ._platform import missing_cpu_features

_platform.check_cpu_features()  # an ImportError naming the missing feature, not SIGILL mid-run

from . import _C  # noqa: E402,F401  (registers torch.ops.specdec.*)
from . import ops  # noqa: E402
from .ops import *  # noqa: E402,F401,F403

HAS_TRITON = _platform.has_triton()
if HAS_TRITON and _platform.triton_kernels_usable():
    # (Bound under another name: `triton` would read as the top-level package.)
    from . import triton as _triton_kernels  # noqa: E402,F401  (registers the CUDA kernels)


def list_ops() -> list[str]:
    """The names of the ``torch.ops.specdec`` ops, sorted (e.g. ``"tree_attention"`` for
    ``torch.ops.specdec.tree_attention``)."""
    return sorted(name.split("::", 1)[1] for name in _torch._C._dispatch_get_all_op_names()
                  if name.startswith("specdec::"))


# torch.ops.specdec creates its attributes on first access: touch every op once so that
# dir(torch.ops.specdec) lists them.
for _name in list_ops():
    getattr(_torch.ops.specdec, _name)
del _name

__version__ = "0.1.0"

__all__ = [*ops.__all__, "list_ops", "missing_cpu_features", "HAS_TRITON"]
