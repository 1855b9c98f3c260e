"""What this machine offers the package: the CPU features the compiled kernels need, and
whether Triton is installed. (Kept out of ``specdec_kernels/__init__.py`` so that the
package's namespace holds only its API.)"""
import importlib.util
import os
import platform

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


def check_cpu_features() -> None:
    """Raise ImportError if the CPU lacks a feature the kernels use: without it a kernel
    would die with SIGILL mid-run."""
    missing = missing_cpu_features()
    if missing:
        raise ImportError(f"specdec_kernels' C++ kernels are compiled for x86-64 CPUs with "
                          f"{', '.join(REQUIRED_X86_FEATURES)}; this CPU lacks {', '.join(missing)}")


def has_triton() -> bool:
    """Triton is optional: CPU-only installs work without it. (The probe must not import
    it: importing triton reads TRITON_INTERPRET, which the tests set first.)"""
    return importlib.util.find_spec("triton") is not None
