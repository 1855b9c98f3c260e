"""Real-model tests cannot be skipped silently in CI: under CI=true tests/conftest.py turns the
skip of a test marked ``real_model``, or of any test skipped by ``require_real_model``, into a
failure; elsewhere they skip with the reason. Checked on a throwaway test module run with the
real conftest, in a subprocess."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CASES = '''
import pytest
from tests.helpers import real_model, require_real_model

@real_model
def test_marked_and_skipped():
    pytest.skip("the file is missing")

def test_skipped_by_require_real_model():
    require_real_model()  # SPECDEC_SKIP_REAL_MODEL=1 here

def test_other_skip():
    pytest.skip("no GPU here")

@real_model
def test_marked_and_run():
    pass
'''


def outcomes(tmp_path, ci: str) -> dict:
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CI": ci, "SPECDEC_SKIP_REAL_MODEL": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    found = dict(re.findall(r"^test_cases\.py::(\w+) (PASSED|FAILED|SKIPPED|ERROR)", proc.stdout, re.M))
    assert len(found) == 4, proc.stdout + proc.stderr
    return found, proc.stdout


@pytest.mark.parametrize("ci", ["true", "false", ""])
def test_real_model_skips_fail_under_ci(tmp_path, ci):
    found, out = outcomes(tmp_path, ci)
    real = "FAILED" if ci == "true" else "SKIPPED"
    assert found == {"test_marked_and_skipped": real, "test_skipped_by_require_real_model": real,
                     "test_other_skip": "SKIPPED", "test_marked_and_run": "PASSED"}, out
    if ci == "true":
        assert "a real-model test was skipped under CI=true" in out and "2 failed, 1 passed, 1 skipped" in out
