"""specdec_kernels: kernels for lossless speculative decoding.

Importing the package loads the compiled library (``specdec_kernels._C``), which registers
the ``torch.ops.specdec.*`` schemas and their C++ CPU kernels, then the fakes (``ops``)
and, when Triton is installed, the Triton kernels for the CUDA key. ``list_ops()`` names
the ops; the typed wrappers of the same names (``specdec_kernels.tree_attention(...)``
etc.) are the friendlier way to call them.

The model and the decode loop are here too, imported on first use (so ``import
specdec_kernels`` loads only the ops): ``load_model(name_or_path) -> (Llama, Tokenizer)``,
``generate(model, tokenizer, prompt) -> str``, ``Generator``, ``make_drafter``,
``SamplingParams``.
"""
try:
    from . import _platform
    from ._platform import missing_cpu_features

    _platform.exit_on_ctrl_c_while_loading()

    import torch as _torch  # loads libtorch, which _C links against

    _platform.check_cpu_features()  # an ImportError naming the missing feature, not SIGILL mid-run

    from . import _C  # noqa: F401  (registers torch.ops.specdec.*)
    from . import ops
    from .ops import *  # noqa: F401,F403

    HAS_TRITON = _platform.has_triton()
    if HAS_TRITON and _platform.triton_kernels_usable():
        # (Bound under another name: `triton` would read as the top-level package.)
        from . import triton as _triton_kernels  # noqa: F401  (registers the CUDA kernels)
except KeyboardInterrupt:
    from ._platform import exit_if_command_line

    exit_if_command_line()  # Ctrl-C while `specdec` starts: exit 130, no traceback
    raise


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

# The end-to-end entry points, imported on first use: {name: (module, attribute)}.
_LAZY = {"load_model": ("models", "load_model"), "generate": ("decoding.text", "generate"),
         "Generator": ("decoding", "Generator"), "make_drafter": ("decoding", "make_drafter"),
         "SamplingParams": ("decoding", "SamplingParams")}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [*ops.__all__, "list_ops", "missing_cpu_features", "HAS_TRITON", *_LAZY]
