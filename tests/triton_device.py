"""Runs the tests' Triton launchers on a real device (``SPECDEC_TRITON_DEVICE=cuda``).

The tests call the Triton launchers of ``specdec_kernels.triton`` with CPU tensors, which the
Triton interpreter runs (``TRITON_INTERPRET=1``). With ``SPECDEC_TRITON_DEVICE`` set,
tests/conftest.py calls ``install(device)`` before any test module is imported: every public
launcher (every public plain function defined in a module of ``specdec_kernels.triton``; the
``@triton.jit`` kernels are not plain functions) is replaced in its module by a wrapper that

- copies the CPU tensor arguments (positional, keyword, inside lists / tuples / dicts) to the
  device, each CPU storage once, whole, and rebuilds every tensor on its copy with its own
  offset and strides: non-contiguous views stay non-contiguous, aliasing views (one tensor
  given twice, outputs over inputs) alias on the device too, so the launchers' stride and
  aliasing checks see what they see on the CPU, and the poison around tests.helpers.guarded
  tensors travels along (a kernel writing outside its tensor is still caught);
- calls the real launcher there, then copies every storage back into the CPU one (the
  launchers write into caller-given outputs);
- returns the result with its tensors on the CPU (an argument returned comes back as the
  caller's own CPU tensor).

Tensors already on another device (or meta) pass through untouched, and a call without CPU
tensors (a launcher calling another on device tensors) goes straight to the launcher. The
CUDA-key registrations (torch.ops on CUDA tensors) captured the launchers at import and are
not wrapped. So the same tests, references and tolerances check the compiled kernels on a GPU
(.ci/gpu_check.sh). With ``SPECDEC_TRITON_DEVICE=cpu`` the wrapper copies to fresh CPU
tensors under the interpreter: a check of the plumbing itself (``calls`` counts launches).

Tests that launch a ``@triton.jit`` kernel themselves put their tensors on ``device()``.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
import pkgutil

import torch

calls = 0  # launches that went through the wrapper (the plumbing check reads it)
wrapped: list[str] = []  # "module.function" of every launcher wrapped by install()


def device() -> str:
    """Where tests that launch a Triton kernel themselves put its tensors: the device of
    ``SPECDEC_TRITON_DEVICE``, else the CPU (the interpreter)."""
    return os.environ.get("SPECDEC_TRITON_DEVICE") or "cpu"


def _movable(obj) -> bool:
    return (type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu"
            and obj.layout == torch.strided)


class _Moved:
    """The CPU tensors of one call and their device copies: each CPU storage copied once,
    whole; each tensor rebuilt on the copy with its own dtype, offset, shape and strides."""

    def __init__(self, dev: str):
        self.device = torch.device(dev)
        self.storages = {}  # CPU storage address -> (CPU bytes, device bytes)
        self.tensors = {}  # id(CPU tensor) -> (CPU tensor, device tensor)
        self.returned = {}  # id(device tensor) -> CPU tensor

    def to_device(self, obj):
        if isinstance(obj, torch.Tensor):
            if not _movable(obj):
                return obj  # on a device already, meta, sparse, a subclass: as it is
            if id(obj) not in self.tensors:
                storage = obj.untyped_storage()
                key = storage.data_ptr() or ("empty", id(obj))
                if key not in self.storages:
                    cpu_bytes = torch.empty(0, dtype=torch.uint8).set_(storage)
                    self.storages[key] = (cpu_bytes, cpu_bytes.to(self.device, copy=True))
                dev_bytes = self.storages[key][1]
                on_device = torch.empty(0, dtype=obj.dtype, device=self.device).set_(
                    dev_bytes.untyped_storage(), obj.storage_offset(), obj.shape, obj.stride())
                self.tensors[id(obj)] = (obj, on_device)
                self.returned[id(on_device)] = obj
            return self.tensors[id(obj)][1]
        return _map(self.to_device, obj)

    def copy_back(self):
        for cpu_bytes, dev_bytes in self.storages.values():
            if cpu_bytes.numel():
                cpu_bytes.copy_(dev_bytes)

    def to_cpu(self, obj):
        if isinstance(obj, torch.Tensor):
            if id(obj) in self.returned:
                return self.returned[id(obj)]  # an argument returned: the caller's tensor
            return obj.cpu() if obj.device.type != "meta" else obj
        return _map(self.to_cpu, obj)


def _map(fn, obj):
    """fn over the items of a list, tuple, namedtuple or dict (else obj as it is)."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(fn(o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(fn(o) for o in obj)
    if isinstance(obj, dict):
        return {k: fn(v) for k, v in obj.items()}
    return obj


def _has_cpu_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return _movable(obj)
    if isinstance(obj, (list, tuple)):
        return any(_has_cpu_tensor(o) for o in obj)
    if isinstance(obj, dict):
        return any(_has_cpu_tensor(o) for o in obj.values())
    return False


def _wrap(fn, dev: str):
    @functools.wraps(fn)
    def on_device(*args, **kwargs):
        global calls
        if not _has_cpu_tensor(args) and not _has_cpu_tensor(kwargs):
            return fn(*args, **kwargs)  # nothing to move (a launcher calling another)
        calls += 1
        moved = _Moved(dev)
        with torch.no_grad():
            result = fn(*moved.to_device(args), **moved.to_device(kwargs))
            moved.copy_back()  # synchronises: a kernel's fault shows up here, in this test
        return moved.to_cpu(result)

    on_device.__wrapped_for_device__ = dev
    return on_device


def launchers():
    """(module, name) of every public plain function defined in a specdec_kernels.triton module."""
    import specdec_kernels.triton as package

    found = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if (not name.startswith("_") and inspect.isfunction(obj) and obj.__module__ == module.__name__):
                found.append((module, name))
    return found


def install(dev: str) -> None:
    """Wraps every launcher (once) so that it runs on ``dev``."""
    for module, name in launchers():
        fn = getattr(module, name)
        if not hasattr(fn, "__wrapped_for_device__"):
            setattr(module, name, _wrap(fn, dev))
            wrapped.append(f"{module.__name__.rsplit('.', 1)[1]}.{name}")
