"""WorkerHealth: the scheduler's half of a health check that reaches the worker (docs/ARCHITECTURE.md, "Processes and
sockets").

A health request never waits behind a step: while a step is in flight the worker is busy, not dead, and the answer
comes at once from the step's age (step_status): "ok" while the step is younger than its limit, "worker unresponsive
for N s" once it is older (no step progress for N s: wedged). The limit scales with the step: STEP_SLACK times its
tokens times the slowest seconds per token of the last RECENT_STEPS steps (FIRST_STEP_S before any step), and never
below timeout_s: on an overloaded machine every step is slow, and a step as slow as its predecessors is progress, not
a wedge. An idle worker is probed: a HealthRequest from the
tokenizer sends a WorkerProbe down the worker's link (one probe at a time: requests that arrive while one is out wait
for the same reply), which the worker's loop answers at once, so every request waiting is answered "ok" when the reply
comes; a request that waited timeout_s seconds without one is answered "worker unresponsive for N s" (N: seconds since
the probe went out). A router in front (router/) keeps a busy replica in rotation and takes a wedged one out.
"""

from __future__ import annotations

from collections import deque

from runtime import protocol as p

STEP_SLACK = 4.0  # a step in flight is wedged past this many times what its tokens took recently (and timeout_s)
RECENT_STEPS = 32
FIRST_STEP_S = 60.0  # the limit of a step before any step was timed (the first steps also warm the model up)


class WorkerHealth:
    """Health requests waiting for the worker. Pure bookkeeping: the caller sends the probes and the answers.

    timeout_s: seconds a request waits for the worker's reply before it is answered "worker unresponsive for N s".
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.probe_id = 0
        self.probe_sent: float | None = None  # monotonic time of the unanswered probe (None: none is out)
        self.waiting: dict[str, float] = {}  # rid -> arrival time, in arrival order
        self.recent_steps: deque[float] = deque(maxlen=RECENT_STEPS)  # seconds per token of the last steps

    def on_step(self, seconds: float, tokens: int) -> None:
        """Records how long a step of tokens input tokens took (sent to result). O(1)."""
        self.recent_steps.append(seconds / max(1, tokens))

    def step_limit_s(self, tokens: int) -> float:
        """Seconds a step of tokens input tokens may run before it counts as no progress: max(timeout_s,
        STEP_SLACK x tokens x the slowest recent seconds per token), FIRST_STEP_S before any step. O(RECENT_STEPS)."""
        if not self.recent_steps:
            return max(self.timeout_s, FIRST_STEP_S)
        return max(self.timeout_s, STEP_SLACK * max(1, tokens) * max(self.recent_steps))

    def step_status(self, step_sent: float | None, tokens: int, now: float) -> str | None:
        """The answer to a health request while a step of tokens input tokens, sent at step_sent (monotonic
        seconds; None: no step in flight), runs: "ok" while it is younger than step_limit_s(tokens), "worker
        unresponsive for N s" once it is older; None when no step is in flight (the caller probes the worker).
        O(RECENT_STEPS)."""
        if step_sent is None:
            return None
        age = now - step_sent
        return "ok" if age < self.step_limit_s(tokens) else f"worker unresponsive for {age:.1f} s"

    def on_request(self, rid: str, now: float) -> p.WorkerProbe | None:
        """Registers health request rid (arrived at `now`, monotonic seconds). Returns the probe to send to the
        worker, or None when one is already out (rid waits for its reply). O(1)."""
        self.waiting[rid] = now
        if self.probe_sent is not None:
            return None
        self.probe_id += 1
        self.probe_sent = now
        return p.WorkerProbe(self.probe_id)

    def on_reply(self, reply: p.WorkerProbeReply) -> list[p.HealthResponse]:
        """The worker answered: HealthResponse "ok" for every request waiting, in arrival order (none for the reply
        to a probe other than the last one sent). O(waiting)."""
        if reply.probe_id != self.probe_id or self.probe_sent is None:
            return []
        self.probe_sent = None
        answers = [p.HealthResponse(rid, "ok") for rid in self.waiting]
        self.waiting.clear()
        return answers

    def expire(self, now: float) -> list[p.HealthResponse]:
        """Answers every request that has waited timeout_s seconds or more with "worker unresponsive for N s"; the
        probe stays out (a late reply still answers later requests). O(expired)."""
        answers = []
        while self.waiting and self.probe_sent is not None:
            rid, since = next(iter(self.waiting.items()))
            if now - since < self.timeout_s:
                break
            del self.waiting[rid]
            answers.append(p.HealthResponse(rid, f"worker unresponsive for {now - self.probe_sent:.1f} s"))
        return answers
