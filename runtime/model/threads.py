"""The worker's thread policy: how many torch intra-op threads a step runs on, and how idle ones wait.

torch runs its CPU ops on an OpenMP pool (libgomp in the PyPI wheels: `torch.__config__.parallel_info()`) whose
work is split statically: a parallel op ends when its slowest thread does. Beside a process that holds one of the
cores, the thread that shares that core is descheduled for whole time slices and every op of the step waits for it,
while the threads that finished spin (libgomp's default: GOMP_SPINCOUNT 300000 before a futex sleep), taking
cycles from the very process that holds the core. Three parts, chosen by benchmarks/thread_policy.py (the README's
"Threads beside other processes" has the figures; on the shared 2-core VM, batch-1 decode with 2 threads ran 0.4
tok/s spinning, 5.9 with PASSIVE, 5.5-5.7 with 1 thread, and the tuner matched or beat the best fixed count):

- Waiting: the worker process starts with OMP_WAIT_POLICY=PASSIVE unless its environment sets OMP_WAIT_POLICY or
  GOMP_SPINCOUNT itself (worker_omp_env; libgomp reads them once, when torch loads it, so they are set before the
  worker imports torch).
- The most threads: every usable core, less one left to the HTTP, tokenizer and scheduler processes where there
  are four or more (cpu_threads); $RADIXSERVE_THREADS fixes the count instead (no tuning).
- Tuning (ThreadTuner, opt-in: RADIXSERVE_THREAD_TUNING=1): measured on a quiet machine it cost the multi-turn
  side-by-side (gemma3-270m, 2 conversations, `benchmarks.vs_llama_server`) 0.90-0.95x llama-server's output tok/s
  against 1.44x with PASSIVE and a fixed count and 1.58-1.62x spinning, so it is off by default. Between 1 and that
  most, the count a step runs on is probed now and then (the neighbouring counts alternate step by step for a few steps,
  and the fastest per token wins), and at once when a step runs twice slower per token than the last probe found; so a
  core taken by another process costs the step the thread that shares it, not every op's wait for it.

- Decode steps beside the frontend (decode_threads): in a server's worker on fewer than FRONTEND_CORE_FROM cores, a
  step whose sequences each run one token (and a speculative draft) runs on one thread fewer than prefill steps, as
  llama-server's -t (generation) and -tb (batch) threads differ. Each decoded token also wakes the scheduler,
  tokenizer and HTTP processes; on 2 cores with both threads in the decode they wait for a core every token. Measured
  on the 2-core AVX-512 VM, quiet, SmolLM2 int4 over HTTP, 128 streamed tokens after a 741-token prompt, median of 5:
  30.3 tok/s with 2 threads, 62.3 with 1 (spinning waits: 4.5-64, erratic). Prefill keeps every thread. The
  in-process Engine (no frontend processes) keeps one count.

- The second core in decode steps (wants_helper): where decode steps run on one thread of two or more, the qgemv
  op shares each quantized GEMV's weight rows, and the paged decode attention its sequences (or one sequence's kv
  heads), with a helper thread of the qgemv op's (kernels/cpu_share.h) that runs under
  SCHED_IDLE, so it takes the core only while the frontend processes and other programs leave it idle, and that the
  step never waits for (blocks are stolen back, a block it was computing is taken over). Measured over HTTP, SmolLM2
  int4 single stream, servers with it on and off alternating (README, "A second core in decode steps"): quiet
  1.08-1.19x, beside a busy core 0.95-1.02x. $RADIXSERVE_QGEMV_HELPER=0 turns it off.

No pinning (os.sched_setaffinity): a thread pinned to the core the other process holds could not move off it.
"""

from __future__ import annotations

# torch is imported inside the functions that need it: worker_omp_env runs before torch loads (worker_process.py)
import logging
import os
import statistics
from collections.abc import Callable, Mapping

from runtime.config import InvalidConfig

TUNING_ENV = "RADIXSERVE_THREAD_TUNING"  # "1": the ThreadTuner probes thread counts at run time
THREADS_ENV = "RADIXSERVE_THREADS"  # fixes the worker's torch intra-op threads: an integer >= 1 (no tuning)
FRONTEND_CORE_FROM = 4  # from this many usable cores on, one is left to the frontend processes
WAIT_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}  # the worker's OpenMP wait, unless its environment sets one (WAIT_KEYS)
WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
HELPER_ENV = "RADIXSERVE_QGEMV_HELPER"  # "0": decode steps' quantized GEMVs stay on their one thread
logger = logging.getLogger(__name__)


def worker_omp_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP variables to add to environ (a process's environment) before torch is imported: WAIT_ENV, or none
    when environ sets any of WAIT_KEYS (the user's choice stands)."""
    if any(key in environ for key in WAIT_KEYS):
        return {}
    return dict(WAIT_ENV)


def cpu_threads(cores: int, torch_threads: int, env: str | None) -> int:
    """The worker's most torch intra-op threads: the integer in env ($RADIXSERVE_THREADS) when set, else
    min(torch_threads, cores), less one core when cores >= FRONTEND_CORE_FROM (torch_threads: torch's default, the
    physical cores or OMP_NUM_THREADS).

    Raises InvalidConfig when env is set and not an integer >= 1.
    """
    if env is None or not env.strip():
        spare = 1 if cores >= FRONTEND_CORE_FROM else 0
        return max(1, min(torch_threads, cores - spare))
    threads = 0
    if env.strip().isdecimal():
        threads = int(env)
    if threads < 1:
        raise InvalidConfig(f"{THREADS_ENV}={env!r}: expected an integer >= 1")
    return threads


def decode_threads(most: int, cores: int, shares_cores: bool, env: str | None) -> int:
    """The thread count of decode steps (module docstring): most - 1 (at least 1) in a worker that shares its cores
    with the frontend processes (shares_cores) on fewer than FRONTEND_CORE_FROM cores, unless $RADIXSERVE_THREADS
    (env) fixes the count; else most."""
    if env is not None and env.strip():
        return most
    if shares_cores and cores < FRONTEND_CORE_FROM:
        return max(1, most - 1)
    return most


def wants_helper(most: int, decode: int, env: str | None) -> bool:
    """Whether the qgemv op's helper thread shares decode steps' GEMVs (kernels/cpu_share.h): when decode steps run
    on one thread (decode) while steps may use most >= 2, unless env ($RADIXSERVE_QGEMV_HELPER) is "0"."""
    return decode == 1 and most >= 2 and env != "0"


def set_cpu_threads() -> int:
    """Set torch's intra-op threads to cpu_threads(usable cores, torch's count, $RADIXSERVE_THREADS); returns the
    count. Mutates torch's process-wide setting. Raises InvalidConfig for a malformed RADIXSERVE_THREADS."""
    import torch

    from runtime.model.cpu_features import usable_cores

    threads = cpu_threads(usable_cores(), torch.get_num_threads(), os.environ.get(THREADS_ENV))
    torch.set_num_threads(threads)
    return threads


class ThreadTuner:
    """Picks the thread count of each step between 1 and `most` by timing steps (see the module docstring).

    Call before_step() before each step and after_step(seconds, tokens) after it. A probe runs the next
    probe_steps x 3 steps (x 2 at an end of [1, most]) on the count and its neighbours (count - 1, count + 1 within
    [1, most]) in turn; the one with the lowest median seconds per token becomes the count. A probe starts `period`
    steps after the last (the period doubles up to max_period while probes keep the count, and is back to `period`
    when one changes it), and at once after `slow_steps` steps in a row slower per token than slow_factor x the last
    probe's figure (only steps of as many tokens as the probe's last are compared). get_threads / set_threads are
    torch.get_num_threads / set_num_threads (fakes in tests). tune=False, most == 1, or a count changed by someone
    else (a benchmark fixing its own) leaves the count alone for good. O(1) per step, O(probe_steps) per probe.
    """

    def __init__(
        self,
        most: int,
        get_threads: Callable[[], int],
        set_threads: Callable[[int], None],
        period: int = 16,
        max_period: int = 512,
        probe_steps: int = 3,
        slow_factor: float = 2.0,
        slow_steps: int = 2,
        tune: bool = True,
        decode_count: int | None = None,
    ) -> None:
        assert most >= 1 and period >= 1 and probe_steps >= 1
        self.most = most
        self.count = most
        self.decode_count = most if decode_count is None else decode_count  # decode steps' count when not tuning
        self.get_threads = get_threads
        self.set_threads = set_threads
        self.min_period = period
        self.period = period
        self.max_period = max_period
        self.probe_steps = probe_steps
        self.slow_factor = slow_factor
        self.slow_steps = slow_steps
        self.active = tune and most > 1
        self.plan: list[int] = []  # the counts of the probe's remaining steps
        self.samples: dict[int, list[float]] = {}  # count -> seconds per token in this probe
        self.since_probe = 0
        self.slow_run = 0
        self.reference: float | None = None  # the count's seconds per token at the last probe
        self.reference_tokens = 0  # the tokens of the last probe step (only steps of as many are compared)
        self.last_set = get_threads()

    def before_step(self, decode: bool = False) -> None:
        """Sets the thread count of the next step (the probe's next count, else the chosen one); when not tuning, a
        decode step (decode: every sequence runs one token, and a draft) runs on decode_count, others on most."""
        if not self.active:
            self._split(decode)
            return
        if self.get_threads() != self.last_set:
            self.active = False  # someone else sets the count now
            return
        want = self.plan[0] if self.plan else self.count
        if want != self.last_set:
            self.set_threads(want)
            self.last_set = want

    def _split(self, decode: bool) -> None:
        if self.decode_count == self.most:
            return
        want = self.decode_count if decode else self.most
        if want != self.last_set:
            self.set_threads(want)
            self.last_set = want

    def after_step(self, seconds: float, tokens: int) -> None:
        """Records a step of `tokens` tokens that took `seconds` (wall clock) on the count before_step set."""
        if not self.active or tokens < 1:
            return
        per_token = seconds / tokens
        if self.plan:
            self.samples.setdefault(self.plan.pop(0), []).append(per_token)
            self.reference_tokens = tokens
            if not self.plan:
                self._choose()
            return
        self.since_probe += 1
        slow = tokens == self.reference_tokens and per_token > self.slow_factor * (self.reference or 0.0)
        self.slow_run = self.slow_run + 1 if slow else 0
        if self.since_probe >= self.period or self.slow_run >= self.slow_steps:
            self._start_probe(urgent=self.slow_run >= self.slow_steps)

    def _start_probe(self, urgent: bool) -> None:
        counts = [c for c in (self.count - 1, self.count, self.count + 1) if 1 <= c <= self.most]
        self.plan = counts * self.probe_steps
        self.samples = {}
        if urgent:
            self.period = self.min_period

    def _choose(self) -> None:
        medians = {c: statistics.median(s) for c, s in self.samples.items()}
        best = min(medians, key=lambda c: medians[c])
        if best == self.count:
            self.period = min(self.max_period, 2 * self.period)
        else:
            self.period = self.min_period
            logger.info("torch threads %d -> %d (ms per token by count: %s)", self.count, best, _ms(medians))
        self.count = best
        self.reference = medians[best]
        self.since_probe = 0
        self.slow_run = 0


def thread_tuner(device_type: str, shares_cores: bool = False) -> ThreadTuner:
    """The worker's tuner: on "cpu", torch's threads set to set_cpu_threads(), tuned below that only with
    $RADIXSERVE_THREAD_TUNING=1 (and no $RADIXSERVE_THREADS), decode steps on decode_threads() (shares_cores: a
    server's worker beside the frontend processes); elsewhere (CUDA) an inactive one. Raises InvalidConfig for a
    malformed RADIXSERVE_THREADS."""
    import torch

    if device_type != "cpu":
        return ThreadTuner(torch.get_num_threads(), torch.get_num_threads, torch.set_num_threads, tune=False)
    most = set_cpu_threads()
    fixed = bool(os.environ.get(THREADS_ENV, "").strip())
    tune = os.environ.get(TUNING_ENV) == "1" and not fixed
    from runtime.model.cpu_features import usable_cores

    decode = decode_threads(most, usable_cores(), shares_cores, os.environ.get(THREADS_ENV))
    if wants_helper(most, decode, os.environ.get(HELPER_ENV)):
        from kernels import cpu_decode, cpu_qgemv

        cpu_qgemv.set_helper(True)
        cpu_decode.share_helper()  # the decode attention's work items too
    return ThreadTuner(most, torch.get_num_threads, torch.set_num_threads, tune=tune, decode_count=decode)


def _ms(seconds: dict[int, float]) -> str:
    return ", ".join(f"{c}: {s * 1e3:.2f}" for c, s in sorted(seconds.items()))
