"""The qgemv op's helper thread (kernels/cpu_share.h): a call on one torch thread shares its weight rows with it, and
the result must be the op's own bits whoever computes which rows: with the helper running beside the caller, with
the helper unable to run (every thread of the process on one core, so the caller steals and takes over its blocks),
and in a forked child (whose helper thread is a new one). Native and AVX2 code alike (the ISAs the flags allow).
The paged decode attention (kernels/cpu_decode.cpp) shares its work items with the same helper once linked
(kernels.cpu_decode.share_helper): its bits too must not change."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from kernels import cpu_decode, cpu_qgemv
from kernels.cpu_qgemv import Q4Weight, Q8Weight, qgemv
from runtime.model.cpu_features import cpu_flags
from tests.kernels.kernel_cases import random_weight

ORDER = ["scalar", "avx2", "avx512_vnni", "avx512_bf16"]
RUNNABLE = ORDER[: ORDER.index(cpu_qgemv.isa_for(cpu_flags())) + 1]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (M, N, K): N rows span many 16 KB blocks with a partial last one (K 256, 4 bits: 192 bytes a row, 85 rows a
# block: 1000 rows are 12 blocks), one block plus a row, and the int8 head's K of SmolLM2
SHAPES = [(1, 1000, 256), (2, 86, 2048), (5, 700, 576), (16, 300, 96)]


@pytest.fixture(scope="module", autouse=True)
def _built():
    enabled = cpu_qgemv.ENABLED
    cpu_qgemv.ENABLED = True
    assert cpu_qgemv.load_op() is not None, "the op must build on a test machine (a C++ compiler is required)"
    yield
    cpu_qgemv.ENABLED = enabled
    cpu_qgemv.set_helper(False)


@contextlib.contextmanager
def one_thread(helper: bool) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    cpu_qgemv.set_helper(helper)
    try:
        yield
    finally:
        cpu_qgemv.set_helper(False)
        torch.set_num_threads(before)


def cases(isa: str) -> Iterator[tuple[torch.Tensor, Q4Weight | Q8Weight]]:
    for seed, (m, n, k) in enumerate(SHAPES):
        for bits in (4, 8):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
                yield x, random_weight(bits, n, k, torch.Generator().manual_seed(seed))[0]


@pytest.mark.parametrize("isa", RUNNABLE)
def test_the_helper_gives_the_callers_bits(isa):
    with one_thread(helper=False):
        alone = [qgemv(x, w, isa) for x, w in cases(isa)]
    with one_thread(helper=True):
        assert cpu_qgemv.helper_on()
        for _ in range(5):  # the blocks fall to the two threads differently from call to call
            shared = [qgemv(x, w, isa) for x, w in cases(isa)]
            for a, b in zip(alone, shared, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)


@contextlib.contextmanager
def all_threads_on_one_core() -> Iterator[None]:
    """Every thread of this process (the helper's too, and any started meanwhile) on one core."""
    cores = os.sched_getaffinity(0)
    one = {min(cores)}
    tasks = os.listdir("/proc/self/task")
    for tid in tasks:
        os.sched_setaffinity(int(tid), one)
    try:
        yield
    finally:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cores)
            except OSError:  # the thread ended
                pass


def test_a_helper_that_cannot_run_costs_nothing_but_time():
    """On one core the helper (SCHED_IDLE) runs only while the caller does not: the caller steals its blocks and
    takes over any it was computing when it lost the core."""
    isa = RUNNABLE[-1]
    with one_thread(helper=False):
        alone = [qgemv(x, w, isa) for x, w in cases(isa)]
    with one_thread(helper=True), all_threads_on_one_core():
        for _ in range(5):
            shared = [qgemv(x, w, isa) for x, w in cases(isa)]
            for a, b in zip(alone, shared, strict=True):
                assert torch.equal(a, b)


def _child(conn, isa: str) -> None:
    torch.set_num_threads(1)
    cpu_qgemv.set_helper(True)
    conn.send([qgemv(x, w, isa).float().tolist() for x, w in cases(isa)])
    conn.close()


def test_a_forked_child_gets_a_helper_of_its_own():
    """The parent's helper thread does not exist in a fork (and its lock may have been held at the fork)."""
    isa = RUNNABLE[-1]
    with one_thread(helper=True):
        parent = [qgemv(x, w, isa).float().tolist() for x, w in cases(isa)]  # the parent's helper has started
        ctx = multiprocessing.get_context("fork")
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child, args=(send, isa))
        child.start()
        send.close()
        assert receive.poll(120), "the forked child did not answer"
        got = receive.recv()
        child.join(30)
    assert child.exitcode == 0
    assert got == parent


def test_set_helper_before_the_op_loads_applies_when_it_loads():
    code = (
        "from kernels import cpu_qgemv\n"
        "cpu_qgemv.set_helper(True)\n"
        "assert not cpu_qgemv.helper_on()\n"  # not loaded yet: nothing built or loaded by set_helper
        "assert cpu_qgemv.load_op() is not None\n"
        "print(cpu_qgemv.helper_on())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def attention_cases() -> Iterator[tuple[torch.Tensor, ...]]:
    """paged_decode inputs over the sharing threshold (1024 K rows): one sequence (items: its kv heads), a batch of
    ragged sequences (items: sequences), a sliding window; float32 and bfloat16; blocks scattered in the cache."""
    gen = torch.Generator().manual_seed(7)
    block, kv_heads, heads, head_dim = 16, 3, 9, 64
    for dtype in (torch.float32, torch.bfloat16):
        for lens, window in (([700], 0), ([500, 600, 30, 900, 1200, 64, 700, 513], 0), ([2000, 100, 900], 256)):
            need = [(n + block - 1) // block for n in lens]
            shape = (sum(need) + 4, block, kv_heads, head_dim)
            k_cache = torch.randn(shape, generator=gen).to(dtype)
            v_cache = torch.randn(shape, generator=gen).to(dtype)
            order = torch.randperm(shape[0], generator=gen)
            tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
            used = 0
            for i, n in enumerate(need):
                tables[i, :n] = order[used : used + n]
                used += n
            q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
            yield q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), torch.tensor(window)


def attend_all() -> list[torch.Tensor]:
    return [
        cpu_decode.paged_decode(q, k, v, tables, lens, 0.125, int(window))
        for q, k, v, tables, lens, window in attention_cases()
    ]


@pytest.mark.parametrize("starved", [False, True])
def test_paged_decode_shared_with_the_helper_gives_the_same_bits(starved):
    """Linked to the helper, the attention's items run on both threads (starved: every thread on one core, the
    caller takes the helper's items over); the output is the unshared call's, bit for bit."""
    assert cpu_decode.share_helper()
    with one_thread(helper=False):
        alone = attend_all()
    with one_thread(helper=True):
        cores = all_threads_on_one_core() if starved else contextlib.nullcontext()
        with cores:
            for _ in range(3):
                for a, b in zip(alone, attend_all(), strict=True):
                    assert a.dtype == b.dtype and torch.equal(a, b)
