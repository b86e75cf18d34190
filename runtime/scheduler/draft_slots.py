"""DraftSlots: the scheduler's proposer for speculative decoding with a draft model (method "draft_model"). Pure
Python (no torch).

The draft model runs in the worker (runtime/model/draft_runner.py), so the scheduler cannot know the draft when it
plans a step: it proposes k placeholder tokens (DRAFT_SLOT), the ChunkPlanner reserves 1 + k slots for them as for
any draft, StepPlan.add sends them as ScheduledSeq.num_draft_slots (not as token ids), and the draft the worker ran
comes back in ForwardResult.draft_token_ids, where the Scheduler puts it in their place before Speculation.on_verified.
"""

from __future__ import annotations

from collections.abc import Sequence

DRAFT_SLOT = -1  # a draft token the worker's draft model fills (never a token id)


def is_slots(draft: Sequence[int]) -> bool:
    """Whether draft is a draft model's placeholders (DraftSlots.propose's), not tokens. O(1)."""
    return bool(draft) and draft[0] == DRAFT_SLOT


class DraftSlots:
    """Proposes max_tokens placeholders: the worker's draft model drafts them."""

    def propose(self, seq_id: int, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """[DRAFT_SLOT] * max_tokens ([] when max_tokens < 1); seq_id and token_ids are unused (the worker holds the
        draft model's state). O(max_tokens)."""
        return [DRAFT_SLOT] * max(0, max_tokens)

    def release(self, seq_id: int) -> None:
        """Nothing to release (the worker drops the draft model's state with the sequence)."""
