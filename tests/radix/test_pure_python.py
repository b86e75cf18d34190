"""radix/ is pure Python: importing every module of it loads no torch (the scheduler process starts without it)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_radix_imports_no_torch():
    code = (
        "import sys, radix, radix.block_pool, radix.block_supply, radix.events, radix.hashing, radix.host_tier, "
        "radix.invariants, radix.keys, radix.manager, radix.no_cache, radix.prefix_cache, radix.prefix_match, "
        "radix.sequence, radix.stats, radix.swap, radix.tier_moves, radix.tree, radix.tree_nodes; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
