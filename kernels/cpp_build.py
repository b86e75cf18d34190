"""Build a torch C++ operator on first use and cache it: the machinery kernels/cpu_decode.py and kernels/cpu_qgemv.py
share.

``torch.utils.cpp_extension.load`` compiles a source into ``$RADIXSERVE_CACHE/kernels`` (default
``~/.cache/radixserve/kernels``) as ``<name>-<key>.so``, key = a hash of the source, the compiler, its flags, torch's
version and the machine (a library built with -march=native runs on this CPU only). Concurrent first builds (several
workers starting at once) are serialized by an flock on a lock file beside it, released by the OS if its holder dies;
the build runs in a private folder and its library is renamed into place, so a reader never sees a partial file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch


class Built(NamedTuple):
    """Where the library is and whether this call compiled it (seconds: time spent building, 0 if it existed)."""

    path: Path
    built: bool
    seconds: float


def cache_dir() -> Path:
    """Folder of the compiled kernels: $RADIXSERVE_CACHE/kernels (default ~/.cache/radixserve/kernels)."""
    root = os.environ.get("RADIXSERVE_CACHE") or str(Path.home() / ".cache" / "radixserve")
    return Path(root) / "kernels"


def compiler() -> str:
    """The C++ compiler cpp_extension uses: $CXX, else c++."""
    return os.environ.get("CXX", "c++")


def machine_key() -> str:
    """This CPU's model and feature flags (/proc/cpuinfo) with the architecture and OS: part of a library's key."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return f"{platform.machine()}|{platform.system()}|{cpu}"


def library_path(name: str, source: bytes, cflags: Sequence[str]) -> Path:
    """Path of library `name` built from ``source`` by compiler() with ``cflags`` against this torch, on this
    machine."""
    parts = [compiler(), " ".join(cflags), torch.__version__, sys.implementation.cache_tag, machine_key()]
    key = hashlib.sha256(b"\0".join([source, *(p.encode() for p in parts)])).hexdigest()[:16]
    return cache_dir() / f"{name}-{key}.so"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created if missing); the OS drops it if the process dies."""
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def compile_library(path: Path, sources: Sequence[Path], cflags: Sequence[str]) -> None:
    """Build ``sources`` with cpp_extension in a private folder beside ``path``, then rename the library to ``path``.

    Loads the new operator into this process (cpp_extension.load does). Raises what the build raises (RuntimeError,
    OSError, subprocess.CalledProcessError)."""
    from torch.utils import cpp_extension  # imported only to build: it costs ~0.3 s

    build = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{path.stem}-build-"))
    try:
        name = path.stem.replace("-", "_")
        files = [str(s) for s in sources]
        cpp_extension.load(name, files, extra_cflags=list(cflags), build_directory=str(build), is_python_module=False)
        os.replace(build / f"{name}.so", path)
    finally:
        shutil.rmtree(build, ignore_errors=True)


def ensure_built(path: Path, compile_fn: Callable[[Path], None]) -> Built:
    """Make sure the library at ``path`` exists, compiling it with compile_fn under the lock if it does not.

    Mutates the file system (cache_dir, the lock file). Safe to call from several processes at once: one compiles,
    the others wait for the lock and then find the file. Raises what compile_fn raises."""
    if path.exists():
        return Built(path, False, 0.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_suffix(".lock")):
        if path.exists():  # built by another process while this one waited
            return Built(path, False, 0.0)
        start = time.perf_counter()
        compile_fn(path)
        return Built(path, True, time.perf_counter() - start)


def load_library(path: Path, compile_fn: Callable[[Path], None]) -> Built:
    """ensure_built(path, compile_fn), then load the library into this process unless the build just did. Raises
    what the build or torch.ops.load_library raises."""
    built = ensure_built(path, compile_fn)
    if not built.built:  # a fresh build was loaded by cpp_extension already
        torch.ops.load_library(str(built.path))
    return built


class OpSource(NamedTuple):
    """A torch operator's C++ sources and flags: what the ops with one source file (kernels/cpu_qgemv.py,
    kernels/cpu_decode_layer.py) need to build, cache and load it."""

    name: str  # the library's name (its file: <name>-<key>.so)
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    headers: tuple[Path, ...] = ()  # what the sources include: part of the key, not compiled on their own

    def library_path(self) -> Path:
        """Where the library built from the sources and headers as they are now lives (library_path)."""
        text = b"\0".join(s.read_bytes() for s in self.sources + self.headers)
        return library_path(self.name, text, self.cflags)

    def compile(self, path: Path) -> None:
        """Build into path (compile_library); loads the operator into this process."""
        compile_library(path, self.sources, self.cflags)

    def load(self) -> Built:
        """Build if needed and load into this process (load_library). Raises what the build or the load raises."""
        return load_library(self.library_path(), self.compile)

    def main(self) -> None:
        """Build (if needed), load, and print where the library is and how long the build took: the module's
        `python -m` entry point."""
        start = time.perf_counter()
        built = self.load()
        verb = f"built in {built.seconds:.1f} s" if built.built else "already built"
        print(f"{built.path}: {verb}; loaded after {time.perf_counter() - start:.1f} s")
