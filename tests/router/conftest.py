"""Router fixtures: two tiny replicas (real launcher processes on 127.0.0.1, KV events on TCP).

The replicas serve the tiny random Llama of tests/conftest.py; they are session-scoped and shared by the routing and
resync tests, which keep their caches apart with distinct cache_salts. The failover test starts its own replicas.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.router.router_cases import start_replica


@pytest.fixture(scope="session")
def replicas(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two replicas of the tiny Llama (512 blocks of 16 tokens each)."""
    logs = tmp_path_factory.mktemp("router_logs")
    pair = [start_replica(tiny_llama_dir, logs / f"replica{i}.log") for i in range(2)]
    yield pair
    for r in pair:
        r.stop()
