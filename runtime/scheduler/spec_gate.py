"""SpeculationGate: whether a step's drafts can pay for their verification, decided per step (the scheduler's
speculation disable rule). Pure Python (no torch).

The cost is measured, not guessed (benchmarks/spec_verify_cost.py; figures in README and
benchmarks/results/spec_verify_cost.json): VERIFY_COST_RATIOS holds, by batch size B, the cost of a step of B
sequences each verifying 1 + 4 tokens, in plain decode steps of B sequences, made non-decreasing in B (a running
maximum: the measurement is noisy, and a larger batch never makes verification relatively cheaper, as the weights'
read is shared by more tokens), linearly interpolated between the measured B and held past the last. For k draft
tokens the extra cost scales with the draft: ratio(B, k) = 1 + (ratio(B, 4) - 1) * k / 4.

A verify step yields 1 + acceptance * k tokens per sequence where a decode step yields 1, so speculation runs in a
step when 1 + acceptance * k >= ratio(B, k) (the walltime analysis of Leviathan et al. 2023 weighs the same trade,
with the draft model's cost added; prompt lookup's draft costs no forward). acceptance is a running estimate:
accepted / proposed draft tokens, both sums decayed by ACCEPTANCE_DECAY per verified draft, starting from
PRIOR_ACCEPTANCE over PRIOR_TOKENS tokens. While the gate is closed, one sequence still drafts every PROBE_EVERY
steps, so the estimate follows a workload that becomes copy-heavy.

With an explicit disable_by_batch_size (vLLM's rule) the gate is that fixed limit alone: a step with at least that
many running sequences proposes nothing.
"""

from __future__ import annotations

# (B, verify / decode step CPU cost with k = 4): SmolLM2-135M, bfloat16 with int4 weights (the defaults), on the
# 2-core AVX-512 VM near idle (load 1), benchmarks/spec_verify_cost.py --repeats 2, the mean of its two rounds, with
# the quantized GEMV op on by default (one-row decode on kernels/cpu_qgemv, the verify's rows on torch's int4 kernel:
# this ratio falls as the multi-row path improves; rerun the benchmark, copy its ratios). Before the op: 2.22, 3.15,
# 4.14, 4.43, 4.53.
VERIFY_COST_RATIOS = ((1, 1.862), (2, 2.575), (4, 4.168), (8, 4.034), (16, 4.445))
MEASURED_K = 4
PRIOR_ACCEPTANCE = 0.5  # before any verified draft (last session's SmolLM2 runs: 0.58 copy, 0.68 chat)
PRIOR_TOKENS = 16.0  # the prior's weight in draft tokens: a few drafts outweigh it
ACCEPTANCE_DECAY = 1.0 - 1.0 / 64  # per verified draft: the estimate follows about the last 64 drafts
PROBE_EVERY = 16  # steps: while closed, one sequence drafts in one step of this many


def verify_cost_ratio(
    batch_size: int, k: int, ratios: tuple[tuple[int, float], ...] = VERIFY_COST_RATIOS, measured_k: int = MEASURED_K
) -> float:
    """The cost of a step of batch_size sequences verifying 1 + k tokens each, in plain decode steps of batch_size
    sequences, from the measured ratios (B ascending; at measured_k draft tokens): their running maximum, linearly
    interpolated in B, held outside the measured range, the extra cost scaled by k / measured_k (module
    docstring). O(len(ratios))."""
    best = 0.0
    envelope = []
    for b, r in ratios:
        best = max(best, r)
        envelope.append((b, best))
    ratio = envelope[-1][1]
    if batch_size <= envelope[0][0]:
        ratio = envelope[0][1]
    for (b0, r0), (b1, r1) in zip(envelope, envelope[1:], strict=False):
        if b0 <= batch_size <= b1:
            ratio = r0 + (r1 - r0) * (batch_size - b0) / (b1 - b0)
            break
    return 1 + (ratio - 1) * k / measured_k


class SpeculationGate:
    """Decides, per step, whether sequences draft (the measured rule, or vLLM's disable_by_batch_size when given).

    Args:
        k: num_speculative_tokens (>= 1).
        disable_by_batch_size: vLLM's fixed limit (None: the measured rule).
        ratios: the measured (B, verify / decode cost at MEASURED_K) pairs (VERIFY_COST_RATIOS; tests set their own).
    """

    def __init__(
        self,
        k: int,
        disable_by_batch_size: int | None,
        ratios: tuple[tuple[int, float], ...] = VERIFY_COST_RATIOS,
    ) -> None:
        self._k = k
        self._disable_at = disable_by_batch_size
        self._ratios = ratios
        self._accepted = PRIOR_ACCEPTANCE * PRIOR_TOKENS
        self._proposed = PRIOR_TOKENS
        self._closed_steps = 0

    @property
    def acceptance(self) -> float:
        """The running acceptance estimate (accepted / proposed draft tokens, decayed), in [0, 1]."""
        return self._accepted / self._proposed

    def open(self, num_running: int) -> bool:
        """Whether every sequence may draft in a step of num_running running sequences. Mutates the probe clock.
        O(1)."""
        if self._disable_at is not None:
            return num_running < self._disable_at
        is_open = 1 + self.acceptance * self._k >= verify_cost_ratio(num_running, self._k, self._ratios)
        self._closed_steps = 0 if is_open else self._closed_steps + 1
        return is_open

    def probe(self) -> bool:
        """Whether one sequence drafts in this closed step (every PROBE_EVERY closed steps of the measured rule;
        never under a fixed disable_by_batch_size). Call once per step, after open()."""
        return self._disable_at is None and self._closed_steps > 0 and self._closed_steps % PROBE_EVERY == 0

    def on_verified(self, proposed: int, accepted: int) -> None:
        """Fold one verified draft (proposed tokens, of which accepted) into the acceptance estimate. O(1)."""
        self._accepted = self._accepted * ACCEPTANCE_DECAY + accepted
        self._proposed = self._proposed * ACCEPTANCE_DECAY + proposed
