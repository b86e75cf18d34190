"""Fused CPU paged decode attention (kernels/cpu_decode.c): build on first use, ctypes binding, dispatch rule.

The C kernel reads each sequence's K/V blocks in place through its block table, so the decode path needs no gather
into a workspace (the reference's index_select). It is compiled on first use with the system C compiler into
``$RADIXSERVE_CACHE/kernels`` (default ``~/.cache/radixserve/kernels``), under a name keyed by a hash of the source,
the compiler, its flags and the machine, written atomically (a temporary file, then a rename). If no compiler is
found or the build fails, one warning is logged and ``load_library`` returns None: the torch path stays in use.

Only contiguous float32 CPU caches take this path (see ``supports``); everything else keeps kernels/reference.py.
Set ``RADIXSERVE_CPU_DECODE=0`` (read once, at import) or ``ENABLED = False`` to turn it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.errors import KernelInputError

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
COMPILER = os.environ.get("CC", "cc")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c99", "-fPIC", "-shared")
ENABLED = os.environ.get("RADIXSERVE_CPU_DECODE", "1") != "0"
SYMBOL = "radixserve_paged_decode_f32"

# Loaded library per (compiler, cache dir), or None after a failed build (so the warning is logged once).
_libraries: dict[tuple[str, str], ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    """Folder of the compiled kernels: $RADIXSERVE_CACHE/kernels (default ~/.cache/radixserve/kernels)."""
    root = os.environ.get("RADIXSERVE_CACHE") or str(Path.home() / ".cache" / "radixserve")
    return Path(root) / "kernels"


def _machine_key() -> str:
    # -march=native ties the binary to this CPU: key on its model and feature flags, not only the architecture.
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return f"{platform.machine()}|{platform.system()}|{cpu}"


def library_path(source: bytes) -> Path:
    """Path of the shared library for ``source`` built by COMPILER with CFLAGS on this machine."""
    key = hashlib.sha256(b"\0".join([source, COMPILER.encode(), " ".join(CFLAGS).encode(), _machine_key().encode()]))
    return cache_dir() / f"cpu_decode-{key.hexdigest()[:16]}.so"


def _build(path: Path) -> None:
    """Compile SOURCE into path atomically; raises OSError or subprocess.CalledProcessError on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp.so")
    os.close(fd)
    try:
        subprocess.run([COMPILER, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None (one warning logged) if it cannot be built or loaded."""
    key = (COMPILER, str(cache_dir()))
    if key in _libraries:
        return _libraries[key]
    lib = None
    try:
        path = library_path(SOURCE.read_bytes())
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
        fn = getattr(lib, SYMBOL)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        fn.argtypes += [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        fn.argtypes += [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int]
    except (OSError, AttributeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        logger.warning("CPU decode kernel unavailable (%s); using the torch path: %s", COMPILER, detail)
        lib = None
    _libraries[key] = lib
    return lib


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True if the C kernel may run these inputs: ENABLED, float32 CPU tensors, contiguous caches, q rows with a
    contiguous head_dim; does not build the kernel."""
    return (
        ENABLED
        and q.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and q.stride(-1) == 1
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor | None:
    """Decode attention, one query token per sequence, read in place from the paged cache.

    Args:
        q: float32 [num_seqs, num_heads, head_dim] (head_dim contiguous), CPU.
        k_cache, v_cache: contiguous float32 [num_blocks, block_size, num_kv_heads, head_dim].
        block_tables: integer [num_seqs, >= max blocks]; entry j of row i is sequence i's j-th block.
        seq_lens: num_seqs ints, tokens of each sequence (>= 1), the new token included.
        scale: softmax scale (usually head_dim ** -0.5).

    Returns:
        float32 [num_seqs, num_heads, head_dim], a new tensor; None if the kernel could not be built (the caller
        takes the torch path). Uses torch.get_num_threads() OpenMP threads. Mutates nothing.

    Raises:
        KernelInputError: a block table too narrow for a sequence, or naming a block outside the cache.
    """
    lib = load_library()
    if lib is None:
        return None
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    if seq_lens and max(seq_lens) > block_tables.shape[1] * block_size:
        raise KernelInputError(f"block table of {block_tables.shape[1]} blocks is too short for {max(seq_lens)} tokens")
    tables = block_tables.to(torch.int64).contiguous()
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    out = torch.empty(q.shape, dtype=q.dtype)
    bad = getattr(lib, SYMBOL)(
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
        num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim, block_size, scale, torch.get_num_threads(),
    )  # fmt: skip
    if bad:
        raise KernelInputError(f"a block table names a block outside the cache's {num_blocks} blocks")
    return out
