"""What this machine offers the package: the CPU features the compiled kernels need, and
whether Triton is installed. (Kept out of ``specdec_kernels/__init__.py`` so that the
package's namespace holds only its API.)"""
import importlib.util
import os
import platform
import sys

# setup.py compiles the x86-64 extension with AVX2, FMA and F16C.
REQUIRED_X86_FEATURES = ("avx2", "fma", "f16c")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The first CPU's feature flags (x86 "flags", Arm "Features"); None where unreadable."""
    if not os.path.exists(cpuinfo):
        return None
    with open(cpuinfo) as f:
        for line in f:
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    return None


def missing_cpu_features(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The x86-64 features the compiled kernels use that this CPU lacks ([] elsewhere)."""
    flags = cpu_flags(cpuinfo) if platform.machine() == "x86_64" else None
    return [] if flags is None else [feat for feat in REQUIRED_X86_FEATURES if feat not in flags]


def has_bf16_products(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16 on x86-64, BF16 on
    Arm). Without it torch's bf16 matrix products on CPU widen every element in software: on
    an AVX2 Zen 3 a [2048, 1536] x [1536, 1536] product took 12 s in bf16 against 0.07 s in fp32."""
    flags = cpu_flags(cpuinfo) or set()
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


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


def triton_kernels_usable() -> bool:
    """Whether importing the package should load the Triton kernels: when a CUDA device is
    there to run them, or under ``TRITON_INTERPRET=1`` (they then run on CPU tensors, as in
    the tests). Elsewhere importing triton would only cost startup time (~1 s), so a CPU-only
    process skips it; ``import specdec_kernels.triton`` still loads them on demand."""
    import torch

    return os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


def user_cache_dir() -> "Path":
    """Where ``specdec`` commands write what nobody asked to keep elsewhere (benchmark results,
    trained heads, generated training data): $XDG_CACHE_HOME/specdec_kernels, by default
    ~/.cache/specdec_kernels. Never inside the package or the working directory, so that no
    command overwrites a tracked file unless its path is passed explicitly."""
    from pathlib import Path

    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec_kernels"


def is_command_line() -> bool:
    """Whether this process is the ``specdec`` command (the installed script, or ``python -m
    specdec_kernels.cli``), as seen while the package is still being imported."""
    argv = getattr(sys, "orig_argv", sys.argv)
    if os.path.basename(sys.argv[0] if sys.argv else "") == "specdec":
        return True
    return any(a == "-m" and b == "specdec_kernels.cli" for a, b in zip(argv, argv[1:]))


def _exit_interrupted(signum, frame) -> None:
    sys.stderr.write("\n[interrupted]\n")
    sys.stderr.flush()
    os._exit(130)


def exit_on_ctrl_c_while_loading() -> None:
    """In the ``specdec`` command, make Ctrl-C during start-up end the process at once (one
    line, exit status 130). A KeyboardInterrupt raised there is not reliable: torch imports
    numpy from C++ and, when that import fails (as an interrupt inside it makes it), warns and
    goes on with a half-initialised numpy, so the run later dies of an AttributeError. The
    command's ``main`` puts Python's own handler back (``restore_ctrl_c``). A library user's
    program keeps its handler."""
    import signal

    if is_command_line() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_interrupted)


def restore_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt again (the command's own handling, with statistics)."""
    import signal

    if signal.getsignal(signal.SIGINT) is _exit_interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def exit_if_command_line() -> None:
    """Ctrl-C while the package loads (``import torch`` takes seconds): in the ``specdec``
    command, one line and exit status 130, as Ctrl-C later does; in a library user's
    program, nothing (the KeyboardInterrupt goes on)."""
    if is_command_line():
        sys.stderr.write("\n[interrupted]\n")
        raise SystemExit(130)


def package_cache_dir(kind: str) -> str:
    """Where the package keeps what it makes for itself, per ``kind`` ("cost": measured
    step-cost curves, "models": model files assembled from installed parts):
    $SPECDEC_CACHE_DIR/<kind>, else $XDG_CACHE_HOME/specdec_kernels/<kind>, else
    ~/.cache/specdec_kernels/<kind>. (SPECDEC_CACHE_DIR moves all of it, e.g. the tests put
    it in a temporary directory.)"""
    root = os.environ.get("SPECDEC_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "specdec_kernels")
    return os.path.join(root, kind)
