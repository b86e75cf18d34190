"""Runs the Triton kernel cases (triton_interpreter_cases.py) under TRITON_INTERPRET=1 in a subprocess.

A subprocess keeps the interpreter setting (read when triton.jit decorates a kernel) out of this test process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.slow  # seconds per test: make test-fast leaves it out

HERE = Path(__file__).resolve().parent


def test_triton_kernels_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cases = str(HERE / "triton_interpreter_cases.py")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", cases]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and "failed" not in result.stdout and "skipped" not in result.stdout
