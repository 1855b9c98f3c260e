"""Build of specdec_kernels._C: the op schemas and the C++ CPU kernels.

Every file in csrc/ and csrc/cpu/ is compiled into one extension; adding a kernel file
needs no change here.
"""
import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
# -ffp-contract=off: every product is rounded before it is added, as written (the kernels use
# explicit fmadd where they want one). Otherwise GCC fuses exp(l * s - m) into an FMA whose
# unrounded product makes the largest logit's weight exp(error) instead of 1: for |l / T|
# beyond ~1e9 that weight is 0 or inf and a valid row read as invalid (found by fuzzing).
extra_compile_args = ["-O3", "-std=c++20", "-fopenmp", "-ffp-contract=off", "-Wno-unknown-pragmas", "-march=x86-64-v2",
                      "-mavx2", "-mfma", "-mf16c",
                      # Select ATen's AVX2 at::vec specialisations (the default is the generic one).
                      "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
if os.uname().machine != "x86_64":
    extra_compile_args = ["-O3", "-std=c++20", "-fopenmp", "-ffp-contract=off"]
# -g0: no debug info, though Python's own CFLAGS ask for -g: with torch's headers, debug info
# is most of the compile time (kv_compaction.cpp: 53 s of CPU with -g, 21 s without).
extra_compile_args.append("-g0")
# SPECDEC_CXXFLAGS: compiler flags after the ones above, so they win (CFLAGS come before them):
# .ci/sanitizers.sh builds with -O1.
extra_compile_args += os.environ.get("SPECDEC_CXXFLAGS", "").split()


class BuildExt(BuildExtension.with_options(use_ninja=True)):
    """SPECDEC_BUILD_TEMP: the folder of the compiled objects (and ninja's files), kept across
    builds. Unset, setuptools picks it (a temporary one for an editable install). CI sets it so
    that the wheel build after the editable install relinks the objects instead of compiling
    them again (same sources, flags and torch: ninja finds every object up to date)."""

    def finalize_options(self):
        super().finalize_options()
        if os.environ.get("SPECDEC_BUILD_TEMP"):
            self.build_temp = os.path.abspath(os.environ["SPECDEC_BUILD_TEMP"])

# Name, version, packages, package data and the `specdec` script are in pyproject.toml.
setup(
    ext_modules=[
        CppExtension(
            "specdec_kernels._C",
            sources,
            include_dirs=[os.path.abspath("csrc")],
            extra_compile_args=extra_compile_args,
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
