"""vLLM's own KV event classes (vllm/distributed/kv_events.py) for tests that decode what radixserve publishes.

The `vllm` wheel is installed without its dependencies into a folder apart from the venv's site-packages (`make
install`: `pip install --no-deps --target .venv/peers vllm==0.33.0`, the way shared/peers/radix/setup.sh installs it
for the peer benchmarks), so nothing else in the venv sees it; RADIXSERVE_PEERS names another folder. Importing
`vllm` itself would pull its whole config and GPU stack, so the packages on the way (vllm, vllm.distributed,
vllm.config, vllm.utils, vllm.v1, vllm.v1.core) are registered bare, without running their __init__; the modules
kv_events.py imports are vLLM's real ones, except vllm.v1.core.kv_cache_utils (it needs the whole engine config), of
which kv_events.py takes one name: ExternalBlockHash, given here as vLLM defines it (bytes | int). Afterwards every
vllm module leaves sys.modules again, so no other test (transformers probes for vllm) sees a half package.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import types
from pathlib import Path

PEERS_ENV = "RADIXSERVE_PEERS"
VLLM_VERSION = "0.33.0"
_BARE = ("vllm", "vllm.distributed", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core")


def peers_dir() -> Path:
    """Where the test-only peer packages are installed: $RADIXSERVE_PEERS, else <venv>/peers."""
    return Path(os.environ.get(PEERS_ENV) or Path(sys.prefix) / "peers")


@functools.cache
def vllm_kv_events() -> types.ModuleType:
    """vLLM's vllm.distributed.kv_events module (KVEventBatch, BlockStored, ZmqEventPublisher, ...).

    Raises:
        RuntimeError: vllm is not installed in peers_dir() (run `make install`).
    """
    root = peers_dir() / "vllm"
    if not (root / "distributed" / "kv_events.py").is_file():
        raise RuntimeError(
            f"vLLM {VLLM_VERSION} is not installed under {peers_dir()}: run `make install` (or "
            f"`pip install --no-deps --target {peers_dir()} vllm=={VLLM_VERSION}`, or set {PEERS_ENV})"
        )
    saved = {name: mod for name, mod in sys.modules.items() if name == "vllm" or name.startswith("vllm.")}
    try:
        for name in _BARE:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            sys.modules[name] = package
        utils = types.ModuleType("vllm.v1.core.kv_cache_utils")
        utils.ExternalBlockHash = bytes | int  # type: ignore[attr-defined]
        sys.modules[utils.__name__] = utils
        return importlib.import_module("vllm.distributed.kv_events")
    finally:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
        sys.modules.update(saved)
