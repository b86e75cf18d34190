"""Multi-step decoding in the worker (ServerArgs.num_scheduler_steps = N > 1; vLLM's multi-step scheduling).

The scheduler reserves N - 1 slots after a decode's one token and sends them as ScheduledSeq.num_draft_slots, as it
does for a draft model's draft (runtime/scheduler/speculation.py). Here those slots are not drafted and verified:
the sequence runs N plain one-token decode steps, each fed the token the step before sampled, at positions
start_pos, start_pos + 1, ... of its own block table. The first N - 1 tokens go back as a draft accepted whole
(ForwardResult.draft_token_ids and accepted_token_ids), the last as the step's token, so the scheduler appends them
one by one as plain decoding would (EOS, stop ids, max_tokens cut inside the run).

Each sub-step samples exactly as a step of its own would: the token index of the seed advances with start_pos, and
the penalties and the grammar mask see the tokens the earlier sub-steps drew (the runner's priors, as a draft row's;
the penalty counts and the grammar matcher take all the step's tokens once, in ModelRunner.finish_step). A greedy or
seeded request therefore samples the tokens of N separate steps. A sequence stops early in the worker at a token that
ends it (EOS unless ignore_eos, a stop_token_ids id); max_tokens is the scheduler's (it reserves no slot past it).
What is saved is the round trip: one message each way and one scheduler pass per N tokens instead of per token.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from runtime.model.isolation import run_isolated
from runtime.model.spec_verify import Sampled
from runtime.protocol import ScheduledSeq

Run = Callable[[list[ScheduledSeq]], dict[int, Sampled]]


def take_slots(seqs: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], dict[int, int]]:
    """(copies of seqs with num_draft_slots 0: they run plain one-token steps, seq_id -> num_draft_slots of each
    sequence that had slots). seqs are not changed. O(len(seqs))."""
    slots = {s.seq_id: s.num_draft_slots for s in seqs if s.num_draft_slots > 0}
    return [msgspec.structs.replace(s, num_draft_slots=0) if s.num_draft_slots else s for s in seqs], slots


def run_decode_steps(
    seqs: list[ScheduledSeq],
    slots: dict[int, int],
    run: Run,
    sampled: dict[int, Sampled],
    failed: dict[int, str],
    stops: Callable[[int, int], bool],
    priors: dict[int, list[int]],
) -> int:
    """The sub-steps after the first (which ran every one of seqs: sampled holds its draws). A sequence with k slots
    that sampled and did not fail runs up to k more one-token steps, each as a copy of its ScheduledSeq whose
    start_pos is past the tokens run before and whose token_ids is [the token drawn last]; priors[seq_id] holds the
    tokens drawn so far in this step (the runner's sample reads it); run goes through run_isolated, so a sequence that
    raises fails alone. A sequence leaves the loop once stops(seq_id, token) is true for its last token, or its slots
    are spent.

    Mutates: priors (emptied at the end), sampled (each multi-step sequence's entry becomes Sampled(last token, its
    logprobs, the tokens before it, their logprobs where asked)), failed. seqs are not changed.
    Returns the tokens run after the first sub-step (for the forward-token count). O(sub-steps x sequences).
    """
    draws = {s.seq_id: [sampled[s.seq_id]] for s in seqs if s.seq_id in slots and s.seq_id in sampled}
    active = [s for s in seqs if s.seq_id in draws and s.seq_id not in failed]
    active = [s for s in active if not stops(s.seq_id, draws[s.seq_id][-1].token_id)]
    extra = 0
    step = 0
    while active:
        step += 1
        active = [_next(s, draws[s.seq_id][-1].token_id) for s in active]
        for s in active:
            priors[s.seq_id] = [d.token_id for d in draws[s.seq_id]]
        extra += len(active)
        drawn: dict[int, Sampled] = {}
        run_isolated(active, run, drawn, failed)
        for seq_id, d in drawn.items():
            draws[seq_id].append(d)
        active = [s for s in active if s.seq_id in drawn and s.seq_id not in failed and slots[s.seq_id] > step]
        active = [s for s in active if not stops(s.seq_id, drawn[s.seq_id].token_id)]
    priors.clear()
    for seq_id, ds in draws.items():
        if seq_id not in failed:
            sampled[seq_id] = _joined(ds)
    return extra


def _next(s: ScheduledSeq, token: int) -> ScheduledSeq:
    """s one token on: a decode of token at the position after s's tokens."""
    return msgspec.structs.replace(s, token_ids=[token], start_pos=s.start_pos + len(s.token_ids))


def _joined(draws: list[Sampled]) -> Sampled:
    """One Sampled for a sequence's sub-step draws: the last draw as the token, the earlier ones as accepted."""
    last = draws[-1]
    earlier = draws[:-1]
    asked = last.logprobs is not None
    lps = [d.logprobs for d in earlier if d.logprobs is not None] if asked else None
    return Sampled(last.token_id, last.logprobs, [d.token_id for d in earlier], lps)
