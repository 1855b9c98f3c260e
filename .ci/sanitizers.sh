#!/usr/bin/env bash
# CI: the C++ kernels under AddressSanitizer + UndefinedBehaviorSanitizer.
#
# Builds a copy of the package (csrc/, specdec_kernels/, python_ref/, tests/) in a temporary
# directory with -fsanitize=address,undefined, so the normal in-place extension of the
# checkout is left alone, and runs the test files that exercise the C++ kernels there with
# libasan preloaded into the Python process (the interpreter is not instrumented; ASan's
# runtime must be loaded before anything else). Any ASan or UBSan report aborts the test
# process, so this script fails on any report.
#
# Usage: .ci/sanitizers.sh (in the venv that has torch and the test dependencies).
# SANITIZER_KEEP=1 keeps the temporary directory (its path is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/specdec-sanitizers.XXXXXX")
if [[ -z "${SANITIZER_KEEP:-}" ]]; then
  trap 'rm -rf "$WORK"' EXIT
fi
echo "sanitizers: building an ASan/UBSan copy of the package in $WORK"

# A copy of the sources, without the checkout's compiled extension, build tree and caches.
tar -C "$ROOT" --exclude='*.so' --exclude='__pycache__' --exclude='.hypothesis' \
  -cf - setup.py pyproject.toml csrc specdec_kernels python_ref tests | tar -C "$WORK" -xf -

SAN_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
# distutils adds CFLAGS to every compile command and LDFLAGS to the link command.
# -O1 (SPECDEC_CXXFLAGS comes after setup.py's -O3): the level ASan's documentation suggests;
# every access is instrumented as at -O3 (fewer are optimised away, if anything), with less
# optimisation work on linear.cpp's templates, this build's long pole (~17 min at -O3 on a
# loaded 2-core machine).
# SPECDEC_BUILD_TEMP is dropped: the normal build's objects (.ci/run) are not for this build.
(
  cd "$WORK"
  env -u SPECDEC_BUILD_TEMP CFLAGS="$SAN_FLAGS" SPECDEC_CXXFLAGS="-O1" LDFLAGS="-fsanitize=address,undefined" \
    MAX_JOBS="${MAX_JOBS:-2}" python setup.py -q build_ext --inplace >build.log 2>&1 || { tail -40 build.log; exit 1; }
)
echo "sanitizers: built in $((SECONDS)) s"
if [[ $(nm -D "$WORK"/specdec_kernels/_C*.so | grep -c __asan_report) == 0 ]]; then
  echo "sanitizers: the extension was built without ASan instrumentation" >&2
  exit 1
fi

# ASan's runtime has to come first in the process; the extension links libubsan itself.
# libstdc++ is preloaded too: the interpreter does not link it, and without it at start-up
# ASan's __cxa_throw interceptor aborts at the first C++ exception (a TORCH_CHECK) with
# "CHECK failed: real___cxa_throw".
ASAN_LIB=$(gcc -print-file-name=libasan.so)
STDCXX_LIB=$(gcc -print-file-name=libstdc++.so)
# detect_leaks=0: CPython and torch's caching allocators keep memory alive until the process
# exits (interned objects, module state, thread pools), which LeakSanitizer reports as leaks
# that are not ours. Use-after-free, out-of-bounds and double frees are still reported.
# halt_on_error / -fno-sanitize-recover: the first report ends the process with an error.
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=23"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=24"

# The test files whose tests run the C++ kernels (the Triton-interpreter tests are
# deselected: they run no code of ours in C++).
TESTS=(
  tests/test_rng.py
  tests/test_rejection_sampling.py
  tests/test_rejection_sampling_cpu_paths.py
  tests/test_rejection_sampling_flat.py
  tests/test_rejection_sampling_stats.py
  tests/test_apply_top_k_top_p.py
  tests/test_tree_attention.py
  tests/test_kv_compaction.py
  tests/test_kv_cache.py
  tests/test_medusa.py
  tests/test_linear.py
  tests/test_int8_activation_linear.py
  tests/test_registration.py
  tests/test_min_temperature.py
  tests/test_rms_norm.py
  tests/test_silu_and_mul.py
  tests/test_decoder_step.py
)
for f in "$ROOT"/tests/test_fuzz_*.py "$ROOT"/tests/test_concurrency.py; do
  [[ -e "$f" ]] && TESTS+=("tests/$(basename "$f")")
done

cd "$WORK"
echo "sanitizers: running ${#TESTS[@]} test files with $ASAN_LIB preloaded"
# --capture=sys: pytest captures Python's output only, so a report (written to file descriptor
# 2 by the sanitizer runtime just before it ends the process) reaches the log.
LD_PRELOAD="$ASAN_LIB $STDCXX_LIB" python -m pytest -q -p no:cacheprovider --capture=sys -x -k "not triton and not real_models" "${TESTS[@]}"
echo "sanitizers: no ASan/UBSan report"
