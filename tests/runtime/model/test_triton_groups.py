"""Runs the Triton cases with two KV cache groups (triton_groups_cases.py) under TRITON_INTERPRET=1 in a subprocess.

A subprocess keeps the interpreter setting (read when triton.jit decorates a kernel) out of this test process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.slow  # an interpreted model: make test-fast leaves it out

HERE = Path(__file__).resolve().parent


def test_triton_with_kv_cache_groups_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cases = str(HERE / "triton_groups_cases.py")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", cases]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert "3 passed" in result.stdout and "failed" not in result.stdout and "skipped" not in result.stdout
