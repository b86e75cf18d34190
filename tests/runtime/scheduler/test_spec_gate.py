"""SpeculationGate (runtime/scheduler/spec_gate.py): the measured cost ratios' envelope and interpolation, the gate
closing where 1 + acceptance * k falls below the verify step's cost (at a batch size that falls as drafts are
rejected), one probe draft every PROBE_EVERY closed steps, and vLLM's fixed disable_by_batch_size in place of the rule
when given."""

from __future__ import annotations

import pytest

from runtime.scheduler.spec_gate import (
    PRIOR_ACCEPTANCE,
    PROBE_EVERY,
    VERIFY_COST_RATIOS,
    SpeculationGate,
    verify_cost_ratio,
)

RATIOS = ((1, 1.5), (2, 2.0), (4, 1.8), (8, 4.0))  # B = 4 measured below B = 2: the envelope holds 2.0


def test_verify_cost_ratio_interpolates_the_running_maximum():
    assert [verify_cost_ratio(b, 4, RATIOS) for b in (1, 2, 3, 4, 6, 8, 64)] == pytest.approx(
        [1.5, 2.0, 2.0, 2.0, 3.0, 4.0, 4.0]
    )
    assert verify_cost_ratio(0, 4, RATIOS) == 1.5
    assert verify_cost_ratio(8, 2, RATIOS) == pytest.approx(2.5)  # half the draft: half the extra cost
    assert verify_cost_ratio(1, 4) == VERIFY_COST_RATIOS[0][1]  # the shipped measurement, at k = 4


def test_gate_closes_where_the_expected_tokens_do_not_pay():
    gate = SpeculationGate(4, None, RATIOS)
    assert gate.acceptance == PRIOR_ACCEPTANCE
    # 1 + 0.5 * 4 = 3 tokens per step: pays up to ratio 3 (B = 6), not past it
    assert [gate.open(b) for b in (1, 2, 4, 6, 7, 8)] == [True, True, True, True, False, False]
    for _ in range(200):  # every draft rejected
        gate.on_verified(4, 0)
    assert gate.acceptance < 0.01
    assert gate.open(1) is False  # ratio(1) = 1.5 > 1 + 4 * acceptance
    for _ in range(200):  # every draft accepted
        gate.on_verified(4, 4)
    assert gate.acceptance > 0.95
    assert gate.open(8) is True  # ratio(8) = 4 <= 5


def test_one_probe_every_probe_every_closed_steps():
    gate = SpeculationGate(4, None, RATIOS)
    probes = []
    for _ in range(3 * PROBE_EVERY):
        assert gate.open(64) is False
        probes.append(gate.probe())
    assert [i + 1 for i, p in enumerate(probes) if p] == [PROBE_EVERY, 2 * PROBE_EVERY, 3 * PROBE_EVERY]
    assert gate.open(1) is True and gate.probe() is False


def test_fixed_disable_by_batch_size_replaces_the_rule():
    gate = SpeculationGate(4, 3, RATIOS)
    for _ in range(200):
        gate.on_verified(4, 0)
    assert [gate.open(b) for b in (1, 2, 3, 4)] == [True, True, False, False]
    assert not any(gate.probe() for _ in range(2 * PROBE_EVERY) if not gate.open(5))
