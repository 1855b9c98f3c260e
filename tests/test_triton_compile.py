"""Every Triton kernel of specdec_kernels/triton/ compiles for sm_90 (no GPU needed).

The other tests run the kernels under TRITON_INTERPRET=1, which accepts code the compiler
rejects; tests/triton_compile_check.py compiles each kernel in the variants its launcher uses
(see its docstring). It runs in a subprocess because conftest.py sets TRITON_INTERPRET=1 for
this process before triton is imported.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import requires_triton

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).with_name("triton_compile_check.py")
CANNOT_COMPILE = 77  # the script's exit status when this Triton cannot compile for CUDA here


@requires_triton
def test_all_triton_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    if proc.returncode == CANNOT_COMPILE:
        pytest.skip(f"this Triton cannot compile for CUDA here: {(proc.stdout + proc.stderr).strip()[-500:]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all Triton kernels compiled" in proc.stdout
