"""The worker's thread policy (runtime/model/threads.py): the most threads, the OpenMP wait policy of the worker's
environment, and the ThreadTuner's choices on a simulated machine whose second core another process takes and gives
back (exact thread count per step), and that libgomp in the worker reads the wait policy the worker sets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.config import InvalidConfig
from runtime.model.cpu_features import usable_cores
from runtime.model.threads import (
    THREADS_ENV,
    TUNING_ENV,
    WAIT_ENV,
    ThreadTuner,
    cpu_threads,
    decode_threads,
    set_cpu_threads,
    thread_tuner,
    wants_helper,
    worker_omp_env,
)

ROOT = Path(__file__).resolve().parents[3]


def test_cpu_threads_default_frontend_core_and_override():
    assert [cpu_threads(c, 64, None) for c in (1, 2, 3, 4, 16)] == [1, 2, 3, 3, 15]  # a core left from 4 on
    assert cpu_threads(16, 8, None) == 8  # torch's own count (physical cores, OMP_NUM_THREADS) caps it
    assert cpu_threads(2, 2, "") == 2 and cpu_threads(2, 2, " 2 ") == 2 and cpu_threads(2, 1, "3") == 3
    assert cpu_threads(16, 64, "16") == 16  # the override takes every core when asked
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(InvalidConfig, match=f"^{THREADS_ENV}="):
            cpu_threads(2, 2, bad)


def test_set_cpu_threads_and_the_tuner_read_the_environment(monkeypatch):
    saved = torch.get_num_threads()
    try:
        monkeypatch.setenv(THREADS_ENV, "1")
        assert set_cpu_threads() == 1 and torch.get_num_threads() == 1
        assert not thread_tuner("cpu").active  # a fixed count is not tuned
        assert not thread_tuner("cuda").active
        monkeypatch.delenv(THREADS_ENV)
        torch.set_num_threads(2)
        assert not thread_tuner("cpu").active  # tuning is opt-in
        monkeypatch.setenv(TUNING_ENV, "1")
        assert thread_tuner("cpu").active == (usable_cores() > 1)
    finally:
        torch.set_num_threads(saved)


def test_worker_omp_env_is_passive_unless_the_user_chose():
    assert worker_omp_env({"PATH": "/bin"}) == WAIT_ENV == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert worker_omp_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert worker_omp_env({"GOMP_SPINCOUNT": "10000"}) == {}


class FakeMachine:
    """Two cores; seconds per token by thread count, quiet or with the second core taken by another process."""

    PER_TOKEN = {False: {1: 0.015, 2: 0.010}, True: {1: 0.016, 2: 0.100}}  # busy -> threads -> seconds per token

    def __init__(self) -> None:
        self.threads = 2
        self.sets: list[int] = []

    def set(self, n: int) -> None:
        self.threads = n
        self.sets.append(n)

    def run(self, tuner: ThreadTuner, busy: bool, steps: int, tokens: int = 1) -> list[int]:
        """steps steps through the tuner; the thread count each ran on."""
        counts = []
        for _ in range(steps):
            tuner.before_step()
            counts.append(self.threads)
            tuner.after_step(self.PER_TOKEN[busy][self.threads] * tokens, tokens)
        return counts


def _tuner(machine: FakeMachine, **kw) -> ThreadTuner:
    return ThreadTuner(2, lambda: machine.threads, machine.set, period=4, max_period=16, probe_steps=2, **kw)


def test_tuner_keeps_two_threads_quiet_drops_one_when_a_core_is_taken_and_takes_it_back():
    m = FakeMachine()
    tuner = _tuner(m)
    # 4 steps, a probe (1, 2 in turn: 2 wins, the period doubles to 8), 2 more steps
    assert m.run(tuner, busy=False, steps=10) == [2, 2, 2, 2, 1, 2, 1, 2, 2, 2]
    assert (tuner.count, tuner.period, tuner.reference) == (2, 8, 0.010)
    # another process takes a core: 2 slow steps (> 2 x 10 ms) start a probe at once; 1 thread wins (period 4)
    assert m.run(tuner, busy=True, steps=6) == [2, 2, 1, 2, 1, 2]
    assert (tuner.count, tuner.period, tuner.reference) == (1, 4, 0.016)
    # 4 steps on 1, a probe that keeps 1 (period 8)
    assert m.run(tuner, busy=True, steps=8) == [1, 1, 1, 1, 1, 2, 1, 2]
    assert (tuner.count, tuner.period) == (1, 8)
    # the core is free again: the next periodic probe (8 steps on) finds 2 faster
    assert m.run(tuner, busy=False, steps=14) == [1] * 8 + [1, 2, 1, 2] + [2, 2]
    assert (tuner.count, tuner.period) == (2, 4)


def test_tuner_compares_only_steps_of_the_probes_token_count_for_the_slow_trigger():
    m = FakeMachine()
    tuner = _tuner(m)
    m.run(tuner, busy=False, steps=8)  # the probe's steps had 1 token each
    assert (tuner.count, tuner.reference_tokens) == (2, 1)
    # steps of 8 tokens at 2 threads busy are 10x slower per token, but not comparable: no probe before the period
    assert m.run(tuner, busy=True, steps=8, tokens=8) == [2] * 8
    assert tuner.plan == [1, 2, 1, 2]  # the periodic one (8 steps) starts now


def test_tuner_stops_when_someone_else_sets_the_count_and_with_tune_false():
    m = FakeMachine()
    tuner = _tuner(m)
    m.run(tuner, busy=False, steps=4)
    assert tuner.plan == [1, 2, 1, 2]
    m.threads = 1  # a benchmark fixes its own count
    assert m.run(tuner, busy=False, steps=10) == [1] * 10
    assert not tuner.active and m.sets == []
    fixed = FakeMachine()
    assert fixed.run(_tuner(fixed, tune=False), busy=True, steps=12) == [2] * 12
    assert fixed.sets == []
    single = FakeMachine()
    single.threads = 1
    one = ThreadTuner(1, lambda: single.threads, single.set)
    assert single.run(one, busy=True, steps=40) == [1] * 40 and not one.active


WORKER_START = """
import os, sys
from runtime.serve import worker_process
assert "torch" not in sys.modules  # the worker sets its OpenMP environment before torch loads libgomp
os.environ.update(worker_process.worker_omp_env(os.environ))
import torch
torch.ones(100000).sum()
"""


@pytest.mark.parametrize("user_env,want", [({}, "'PASSIVE'"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "'ACTIVE'")])
def test_libgomp_reads_the_wait_policy_the_worker_sets(user_env, want):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(user_env, OMP_DISPLAY_ENV="TRUE", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", WORKER_START], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"OMP_WAIT_POLICY = {want}" in done.stderr  # libgomp prints its settings at start-up


def test_decode_threads_one_fewer_beside_the_frontend_below_four_cores():
    assert decode_threads(2, 2, shares_cores=True, env=None) == 1
    assert decode_threads(3, 3, shares_cores=True, env=None) == 2
    assert decode_threads(1, 1, shares_cores=True, env=None) == 1
    assert decode_threads(3, 4, shares_cores=True, env=None) == 3  # a core is left to the frontend already
    assert decode_threads(2, 2, shares_cores=False, env=None) == 2  # the in-process Engine
    assert decode_threads(2, 2, shares_cores=True, env="2") == 2  # RADIXSERVE_THREADS fixes every step's count


def test_the_qgemv_helper_runs_when_decode_steps_leave_a_core():
    assert wants_helper(most=2, decode=1, env=None)  # 2 cores beside the frontend: decode on 1 thread + the helper
    assert not wants_helper(most=1, decode=1, env=None)  # one core, or RADIXSERVE_THREADS=1
    assert not wants_helper(most=3, decode=2, env=None)  # decode steps run on torch's pool (the helper is unused)
    assert not wants_helper(most=2, decode=2, env=None)  # the in-process Engine, or RADIXSERVE_THREADS=2
    assert not wants_helper(most=2, decode=1, env="0")  # RADIXSERVE_QGEMV_HELPER=0
    assert wants_helper(most=2, decode=1, env="1")


def test_untuned_decode_steps_run_on_the_decode_count_prefill_on_most():
    m = FakeMachine()
    tuner = ThreadTuner(2, lambda: m.threads, m.set, tune=False, decode_count=1)
    counts = []
    for decode in (False, True, True, False, True):
        tuner.before_step(decode)
        counts.append(m.threads)
    assert counts == [2, 1, 1, 2, 1]
    assert m.sets == [1, 2, 1]  # set only on a change
    same = ThreadTuner(2, lambda: m.threads, m.set, tune=False)
    m.sets.clear()
    same.before_step(True)
    assert m.sets == []  # decode_count defaults to most: nothing set
