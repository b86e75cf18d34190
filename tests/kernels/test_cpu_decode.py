"""The fused CPU decode operator (kernels/cpu_decode.py, torch.ops.radixserve.paged_decode) against dense attention;
its build cache and lock; the torch fallback when it cannot be built.

The operator is built once per machine into the default cache folder (``python -m kernels.cpu_decode``, run by
``make install``); the first test here builds it if that has not happened.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import kernels
from kernels import cpu_decode
from kernels.errors import KernelInputError
from tests.kernels.kernel_cases import PAIRWISE, dense_attention, make_batch
from tests.paths import ROOT

BF16_RTOL = 2**-8  # bfloat16's unit roundoff: the output is rounded once, to 8 significant bits
F32_TOL = 1e-5  # float32 scores, softmax and accumulation over <= a few hundred tokens


def decode_spec(block_size: int) -> list[tuple[int, int]]:
    """(cached_tokens, 1) per sequence: lengths at, one under and one over block multiples, and one-token sequences,
    in no order (the kernel takes sequences in any order)."""
    bs = block_size
    lengths = [bs, bs - 1, bs + 1, 2 * bs, 3 * bs - 1, 3 * bs + 1, 1, 5 * bs + 7, 1, 2]
    return [(n - 1, 1) for n in lengths]


@pytest.fixture(autouse=True)
def enabled(monkeypatch):
    """The kernel on, whatever RADIXSERVE_CPU_DECODE says."""
    monkeypatch.setattr(cpu_decode, "ENABLED", True)


def run_op(batch) -> torch.Tensor:
    out = cpu_decode.paged_decode(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.scale
    )
    assert out is not None, "the operator did not build (see the warning logged by kernels.cpu_decode)"
    return out


@pytest.mark.parametrize(("ratio", "head_dim", "block_size"), PAIRWISE)
def test_float32_matches_dense(ratio: int, head_dim: int, block_size: int) -> None:
    batch = make_batch(decode_spec(block_size), block_size, num_kv_heads=2, group=ratio, head_dim=head_dim, seed=ratio)
    out = run_op(batch)
    assert out.dtype == torch.float32 and out.shape == batch.q.shape
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=F32_TOL, rtol=F32_TOL)


@pytest.mark.parametrize(("ratio", "head_dim", "block_size"), PAIRWISE[::2] + [(5, 80, 16), (3, 48, 16)])
def test_bfloat16_matches_float_math_on_the_same_inputs(ratio: int, head_dim: int, block_size: int) -> None:
    """bf16 q and caches; the oracle is float64 attention over the same bf16 values. Scores, softmax and the
    accumulator are float32, so the only large error is the output's rounding to bf16: at most half an ulp, i.e.
    BF16_RTOL relative. head_dim 80 and 48 end with a half chunk (the kernel reads bf16 rows 2 x 16 at a time)."""
    spec = decode_spec(block_size)
    batch = make_batch(
        spec, block_size, num_kv_heads=2, group=ratio, head_dim=head_dim, dtype=torch.bfloat16, seed=ratio
    )
    out = run_op(batch)
    want = dense_attention(batch)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, atol=F32_TOL, rtol=BF16_RTOL)
    # Almost always the very value float64 math rounds to (else one ulp off: the float32 result near a rounding tie).
    assert (out == want.bfloat16()).double().mean() > 0.999


def test_paged_attention_takes_the_kernel_for_both_dtypes(monkeypatch) -> None:
    calls = []
    original = cpu_decode.paged_decode
    monkeypatch.setattr(cpu_decode, "paged_decode", lambda *a: calls.append(a[0].dtype) or original(*a))
    for dtype in (torch.float32, torch.bfloat16):
        batch = make_batch(decode_spec(16), 16, num_kv_heads=3, group=3, head_dim=64, dtype=dtype, seed=7)
        out = kernels.paged_attention(*batch.args())
        torch.testing.assert_close(out.double(), dense_attention(batch), atol=F32_TOL, rtol=BF16_RTOL)
    assert calls == [torch.float32, torch.bfloat16]


@pytest.mark.slow
def test_one_and_two_threads_give_identical_results() -> None:
    """Batches past the kernel's parallel threshold: fewer sequences than threads (work items are kv heads) and
    more (work items are sequences), ragged and unsorted."""
    saved = torch.get_num_threads()
    for spec in ([(700, 1)], [(n, 1) for n in (300, 17, 450, 64, 5, 200, 333)]):
        for dtype in (torch.float32, torch.bfloat16):
            batch = make_batch(spec, 16, num_kv_heads=3, group=3, head_dim=64, dtype=dtype, seed=len(spec))
            outs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                try:
                    outs.append(run_op(batch))
                finally:
                    torch.set_num_threads(saved)
            assert torch.equal(outs[0], outs[1])
            torch.testing.assert_close(outs[0].double(), dense_attention(batch), atol=F32_TOL, rtol=BF16_RTOL)


def test_strided_q_and_int64_tables() -> None:
    batch = make_batch(decode_spec(8), 8, num_kv_heads=4, group=2, head_dim=64, seed=3)
    qkv = torch.cat([batch.q, torch.randn(batch.q.shape[0], 4, 64)], dim=1)  # q as a view of a fused projection
    batch.q = qkv[:, :8]
    batch.block_tables = batch.block_tables.long()
    batch.seq_lens = batch.seq_lens.long()
    torch.testing.assert_close(run_op(batch).double(), dense_attention(batch), atol=F32_TOL, rtol=F32_TOL)


def test_supports() -> None:
    batch = make_batch(decode_spec(16), 16, num_kv_heads=2, group=2, head_dim=64)
    q, k, v = batch.q, batch.k_cache, batch.v_cache
    assert cpu_decode.supports(q, k, v) and cpu_decode.supports(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert not cpu_decode.supports(q.half(), k.half(), v.half())
    assert not cpu_decode.supports(q, k.bfloat16(), v.bfloat16())
    assert not cpu_decode.supports(q, k.transpose(1, 2), v.transpose(1, 2))
    assert not cpu_decode.supports(q[..., :40], k[..., :40].contiguous(), v[..., :40].contiguous())  # not 16 x n


def test_bad_inputs_raise_kernel_input_error() -> None:
    batch = make_batch(decode_spec(8), 8, num_kv_heads=1, group=1, head_dim=64)
    tables = batch.block_tables.clone()
    tables[0, 0] = batch.k_cache.shape[0]
    args = (batch.q, batch.k_cache, batch.v_cache)
    with pytest.raises(KernelInputError, match=f"block {batch.k_cache.shape[0]} is outside the cache"):
        cpu_decode.paged_decode(*args, tables, batch.seq_lens, batch.scale)
    tables[0, 0] = -1
    with pytest.raises(KernelInputError, match="block -1 is outside the cache"):
        cpu_decode.paged_decode(*args, tables, batch.seq_lens, batch.scale)
    with pytest.raises(KernelInputError, match="block table of 1 blocks is too short for 9 tokens"):
        cpu_decode.paged_decode(*args, batch.block_tables[:, :1], batch.seq_lens, batch.scale)
    with pytest.raises(KernelInputError, match="share one dtype"):
        cpu_decode.paged_decode(batch.q.bfloat16(), *args[1:], batch.block_tables, batch.seq_lens, batch.scale)


def test_one_openmp_runtime_in_the_process() -> None:
    """The operator parallelizes on torch's pool: loading it maps no second OpenMP runtime."""
    run_op(make_batch(decode_spec(16), 16, num_kv_heads=1, group=1, head_dim=64))
    with open("/proc/self/maps", encoding="utf-8") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line or "libomp" in line}
    assert len(runtimes) <= 1, runtimes


@pytest.mark.slow
def test_build_command_prints_the_library(tmp_path) -> None:
    """`python -m kernels.cpu_decode` (make install) finds or builds the library and says where, with no runpy
    warning about a module imported twice."""
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.cpu_decode"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    path = cpu_decode.library_path(cpu_decode.source_bytes())
    assert proc.stdout.startswith(f"{path}: ") and path.exists()
    assert "RuntimeWarning" not in proc.stderr


def test_library_name_keys_on_source_flags_and_torch(monkeypatch) -> None:
    first = cpu_decode.library_path(b"source")
    assert first.parent == cpu_decode.cache_dir() and first.name.startswith("radixserve_cpu_decode-")
    assert cpu_decode.library_path(b"other source") != first
    monkeypatch.setattr(cpu_decode, "CFLAGS", ("-O2",))
    assert cpu_decode.library_path(b"source") != first
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert cpu_decode.library_path(b"source") != first


def test_concurrent_first_builds_compile_once(tmp_path) -> None:
    """Four builders at once (the router starts several workers): one compiles under the lock, the others wait and
    find its library; nobody sees a partial file."""
    path = tmp_path / "kernels" / "lib.so"
    compiles = []

    def slow_compile(target: Path) -> None:
        compiles.append(threading.get_ident())
        time.sleep(0.3)
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(b"x" * 1000)
        os.replace(tmp, target)

    results: list[cpu_decode.Built] = []
    threads = [
        threading.Thread(target=lambda: results.append(cpu_decode.ensure_built(path, slow_compile))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(compiles) == 1
    assert sorted(r.built for r in results) == [False, False, False, True]
    assert {r.path for r in results} == {path} and path.read_bytes() == b"x" * 1000
    assert cpu_decode.ensure_built(path, slow_compile).built is False and len(compiles) == 1


def test_failed_compile_leaves_no_library(tmp_path) -> None:
    path = tmp_path / "kernels" / "lib.so"

    def failing(target: Path) -> None:
        raise RuntimeError("compiler said no")

    with pytest.raises(RuntimeError, match="compiler said no"):
        cpu_decode.ensure_built(path, failing)
    assert not path.exists()


def test_build_failure_warns_once_and_keeps_the_torch_path(tmp_path, monkeypatch, caplog) -> None:
    """A real cpp_extension build with a compiler that does not exist (into an empty cache folder)."""
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "radixserve-no-such-cxx")
    monkeypatch.setattr(cpu_decode, "_op", None)
    monkeypatch.setattr(cpu_decode, "_failed", False)
    monkeypatch.setattr(cpu_decode, "_registered", lambda: False)  # as in a process that never loaded it
    batch = make_batch(decode_spec(16), 16, num_kv_heads=3, group=3, head_dim=64, seed=5)
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_decode"):
        first = kernels.paged_attention(*batch.args())
        second = kernels.paged_attention(*batch.args())
    warnings = [r for r in caplog.records if r.name == "kernels.cpu_decode" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "radixserve-no-such-cxx" in warnings[0].getMessage()
    assert cpu_decode.load_op() is None
    assert list((tmp_path / "kernels").glob("*.so")) == []
    torch.testing.assert_close(first.double(), dense_attention(batch), atol=F32_TOL, rtol=F32_TOL)
    torch.testing.assert_close(second, first, atol=0, rtol=0)
