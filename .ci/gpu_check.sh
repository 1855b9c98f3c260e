#!/usr/bin/env bash
# The Triton kernels compiled and run on a CUDA GPU (not part of CI, which has none).
#
#   bash .ci/gpu_check.sh [pytest -k expression, default "triton"]
#
# Run from anywhere on a machine with a CUDA GPU, python3 with torch (CUDA), triton, pytest,
# hypothesis, numpy, scipy (pytest-xdist, pytest-timeout, ninja used when present); no network
# needed. Steps:
#  1. pure-Python test dependencies missing here (gguf and its pyyaml; pytest-timeout; ninja
#     for a parallel build) are installed from the wheels in .whl/ (if any) into a temporary
#     folder on PYTHONPATH / PATH; test files whose imports still fail are left out, named;
#  2. the C++ extension is built in place against this machine's torch (build_ext --inplace);
#  3. the Triton tests of the kernel test files run with SPECDEC_TRITON_DEVICE=cuda
#     TRITON_INTERPRET=0: tests/conftest.py wraps every launcher of specdec_kernels.triton
#     (tests/triton_device.py) so that the tests' CPU tensors run through the compiled kernels
#     on the GPU, against the same references and tolerances as under the interpreter.
#     A failure is printed the moment it happens (one line), all of them again at the end,
#     with their tracebacks in $OUT/tests.log.
# Logs go to $OUT (default /tmp/gpu_check): build.log, tests.log, junit.xml, failed.txt.
# GPU_CHECK_DEVICE=cpu SKIP_BUILD=1: the same run on CPU copies under the interpreter (a check
# of this script and of the wrapping on a machine without a GPU; slow: pick files with TEST_FILES).
# Environment: GPU_TEST_TIMEOUT (s, all tests, default 330), PER_TEST_TIMEOUT (s, default 120,
# needs pytest-timeout), MAXFAIL (default 40), WORKERS (default 8), TEST_FILES (override).
# Exit status: 0 all passed; 1 build or test failures; 2 setup problems.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
t0=$SECONDS
DEVICE=${GPU_CHECK_DEVICE:-cuda}
INTERPRET=0
[[ $DEVICE == cpu ]] && INTERPRET=1
say() { echo "gpu_check [$((SECONDS - t0)) s]: $*"; }

# 1. Missing dependencies from .whl/ (only those not installed already: nothing is shadowed).
SITE=/tmp/specdec_gpu_site
if compgen -G ".whl/*.whl" > /dev/null; then
  mapfile -t MISSING < <("$PY" - .whl/*.whl <<'EOF'
import importlib.metadata as md, re, sys
for path in sys.argv[1:]:
    name = re.sub(r"[-_.]+", "-", path.rsplit("/", 1)[-1].split("-")[0]).lower()
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        print(path)
EOF
)
  if ((${#MISSING[@]})); then
    say "installing from .whl/: ${MISSING[*]}"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${MISSING[@]}" \
      || say "WARNING: pip could not install the wheels"
  fi
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
[[ $DEVICE == cpu ]] || nvidia-smi -L || true
if ! TRITON_INTERPRET=$INTERPRET "$PY" -c "import torch, triton
assert '$DEVICE' == 'cpu' or torch.cuda.is_available(), 'no CUDA device'
print('torch', torch.__version__, 'CUDA', torch.version.cuda, '| triton', triton.__version__, '|',
      torch.cuda.get_device_name() if '$DEVICE' != 'cpu' else 'cpu')"; then
  say "torch / triton / CUDA not usable"; exit 2
fi
HAVE_MOD=""
for m in pytest hypothesis numpy scipy gguf xdist pytest_timeout ninja; do
  "$PY" -c "import $m" 2> /dev/null && HAVE_MOD+=" $m" || say "note: python module '$m' not importable"
done
have() { [[ " ${HAVE_MOD:-} " == *" $1 "* ]]; }
have ninja || command -v ninja > /dev/null || say "WARNING: no ninja: the extension compiles one file at a time (slow)"

# 2. The extension, in place.
start=$SECONDS
if [[ ${SKIP_BUILD:-0} == 1 ]]; then
  say "SKIP_BUILD=1: the extension as it is"
elif ! MAX_JOBS=${MAX_JOBS:-16} "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
  grep -n -m 20 -E "error|Error" "$OUT/build.log"; tail -30 "$OUT/build.log"
  say "the build failed (whole log: $OUT/build.log)"; exit 1
fi
say "extension built in $((SECONDS - start)) s"
if ! SPECDEC_TRITON_DEVICE=$DEVICE TRITON_INTERPRET=$INTERPRET "$PY" -c "
import torch, specdec_kernels as sk
assert sk.HAS_TRITON, 'specdec_kernels.HAS_TRITON is False'
x = torch.randn(4, 256, device='$DEVICE'); w = torch.randn(256, device='$DEVICE')
got = sk.rms_norm(x, w, 1e-6)
ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
print('smoke: specdec_kernels.rms_norm on $DEVICE, max abs diff', (got - ref).abs().max().item())
"; then
  say "the package does not run on $DEVICE (see above)"; exit 2
fi
# A C++ argument error must reach Python as a RuntimeError. On one H200 image (torch 2.11,
# its g++ 13) every error thrown from a C++ extension built there, even a minimal one built
# with torch's default flags, killed the process instead (docs/reliability.md): say so up front,
# since a test expecting such an error then takes its pytest worker down.
"$PY" -c "
import torch, specdec_kernels
try:
    torch.ops.specdec.rms_norm(torch.randn(4, 8), torch.randn(7), 1e-6, torch.empty(4, 8))
except RuntimeError:
    pass
" 2> /dev/null || say "WARNING: an error raised in the C++ extension crashed Python on this machine (exit $?): \
tests that expect a C++ error will crash their worker; see docs/reliability.md"

# 3. The Triton tests on the GPU.
FILES=${TEST_FILES:-"tests/test_rms_norm.py tests/test_silu_and_mul.py tests/test_kv_compaction.py
  tests/test_medusa.py tests/test_rng.py tests/test_apply_top_k_top_p.py tests/test_tree_attention.py
  tests/test_linear.py tests/test_int8_activation_linear.py tests/test_rejection_sampling.py
  tests/test_rejection_sampling_flat.py tests/test_checks.py tests/test_concurrency.py
  tests/test_fuzz_kv_compaction.py tests/test_fuzz_medusa.py tests/test_fuzz_apply_top_k_top_p.py
  tests/test_fuzz_tree_attention.py tests/test_fuzz_linear.py tests/test_fuzz_rejection_sampling.py"}
if ! have gguf; then  # these import gguf at module level
  say "WARNING: no gguf (put its wheel and pyyaml's in .whl/): the linear test files are left out"
  FILES=$(printf '%s\n' $FILES | grep -v -E "test_(fuzz_)?linear.py|test_int8_activation_linear.py")
fi
ARGS=(-p no:cacheprovider -rfE --tb=short -v -k "${1:-triton}" --maxfail "${MAXFAIL:-40}"
      --junitxml="$OUT/junit.xml")
have xdist && ARGS+=(-n "${WORKERS:-8}")
have pytest_timeout && ARGS+=(--timeout "${PER_TEST_TIMEOUT:-120}")
say "pytest ${ARGS[*]} over $(echo $FILES | wc -w) files"
start=$SECONDS
# SIGINT at the time limit: pytest still prints its summary and writes the junit file.
# shellcheck disable=SC2086
SPECDEC_TRITON_DEVICE=$DEVICE TRITON_INTERPRET=$INTERPRET timeout -s INT -k 30 "${GPU_TEST_TIMEOUT:-330}" \
  "$PY" -m pytest "${ARGS[@]}" $FILES > "$OUT/tests.log" 2>&1 &
pid=$!
tail -n +1 -F --pid=$pid "$OUT/tests.log" 2> /dev/null \
  | grep --line-buffered -E "^\[gw[0-9]+\] .*(FAILED|ERROR) |::.* (FAILED|ERROR) +\[" | sed -u 's/^/  live: /' &
live=$!
wait $pid
status=$?
wait $live
echo "================ failures (whole tracebacks: $OUT/tests.log) ================"
sed -n '/^=\+ \(ERRORS\|FAILURES\) =\+$/,/^=\+ short test summary info =\+$/p' "$OUT/tests.log" | head -400
echo "================ summary ================"
sed -n '/^=\+ short test summary info =\+$/,$p' "$OUT/tests.log" | tail -100
# One line per failed test: pytest's summary, or (stopped before it) the progress lines.
grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | sort -u > "$OUT/failed.txt"
[[ -s "$OUT/failed.txt" ]] || grep -E "(FAILED|ERROR)( |$)" "$OUT/tests.log" | sort -u > "$OUT/failed.txt"
[[ -s "$OUT/tests.log" ]] && echo "last line: $(tail -1 "$OUT/tests.log")"
((status == 124 || status == 130)) && say "WARNING: the tests ran past ${GPU_TEST_TIMEOUT:-330} s and were stopped"
say "tests took $((SECONDS - start)) s, pytest exit status $status, $(wc -l < "$OUT/failed.txt") failed"
((status == 0)) && exit 0 || exit 1
