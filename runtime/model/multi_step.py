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
Where the scheduler keeps a sequence running that stopped early here (a stop id before min_tokens), it releases the
slots not run, and the worker's table is cut by the same rule: cdiv(computed tokens, block_size) blocks.
What is saved is the round trip: one message each way and one scheduler pass per N tokens instead of per token.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import msgspec

from radix.blocks import cdiv
from runtime.model.isolation import run_isolated
from runtime.model.spec_verify import Sampled
from runtime.model.worker_seqs import WorkerSeqs
from runtime.protocol import ScheduledSeq

Run = Callable[[list[ScheduledSeq]], dict[int, Sampled]]


class MultiStep:
    """The worker's multi-step runs (see the module docstring).

    Args:
        live: the runner's WorkerSeqs (each sequence's params; block tables cut after an early stop).
        eos_token_ids: the model's EOS ids.
        priors: the runner's dict that its sample() reads: seq_id -> the tokens drawn earlier in the step.
    """

    def __init__(self, live: WorkerSeqs, eos_token_ids: Collection[int], priors: dict[int, list[int]]) -> None:
        self._live = live
        self._eos = frozenset(eos_token_ids)
        self._priors = priors

    def run(
        self, seqs: list[ScheduledSeq], run: Run, sampled: dict[int, Sampled], failed: dict[int, str]
    ) -> tuple[list[ScheduledSeq], int]:
        """Run seqs' step: all of them once (a sequence with slots as a plain one-token decode), then the sub-steps
        of the sequences with slots (run_decode_steps). run goes through run_isolated: a sequence that raises fails
        alone. Returns (the ScheduledSeqs run first: copies with num_draft_slots 0 where seqs had slots, the tokens
        the later sub-steps ran). Mutates sampled, failed. seqs are not changed."""
        slots = {s.seq_id: s.num_draft_slots for s in seqs if s.num_draft_slots > 0}
        seqs = [msgspec.structs.replace(s, num_draft_slots=0) if s.num_draft_slots else s for s in seqs]
        run_isolated(seqs, run, sampled, failed)
        return seqs, self.run_decode_steps(seqs, slots, run, sampled, failed)

    def run_decode_steps(
        self,
        seqs: list[ScheduledSeq],
        slots: dict[int, int],
        run: Run,
        sampled: dict[int, Sampled],
        failed: dict[int, str],
    ) -> int:
        """The sub-steps after the first (sampled holds its draws). A sequence with k slots that sampled and did not
        fail runs up to k more one-token steps, each a copy of its ScheduledSeq with start_pos past the tokens run
        before and token_ids [the token drawn last], priors[seq_id] the tokens drawn so far in this step. It leaves
        the loop at a token that ends it (stops) or when its slots are spent.
        Mutates: priors (emptied at the end), sampled (each such sequence's entry becomes Sampled(last token, its
        logprobs, the tokens before it, their logprobs where asked)), failed. Returns the tokens run.
        O(sub-steps x sequences)."""
        draws = {s.seq_id: [sampled[s.seq_id]] for s in seqs if s.seq_id in slots and s.seq_id in sampled}
        active = [s for s in seqs if s.seq_id in draws and s.seq_id not in failed]
        active = [s for s in active if not self.stops(s.seq_id, draws[s.seq_id][-1].token_id)]
        extra = 0
        step = 0
        while active:
            step += 1
            active = [_next(s, draws[s.seq_id][-1].token_id) for s in active]
            for s in active:
                self._priors[s.seq_id] = [d.token_id for d in draws[s.seq_id]]
            extra += len(active)
            drawn: dict[int, Sampled] = {}
            run_isolated(active, run, drawn, failed)
            for seq_id, d in drawn.items():
                draws[seq_id].append(d)
            active = [s for s in active if s.seq_id in drawn and s.seq_id not in failed and slots[s.seq_id] > step]
            active = [s for s in active if not self.stops(s.seq_id, drawn[s.seq_id].token_id)]
        self._priors.clear()
        for seq_id, ds in draws.items():
            if seq_id not in failed:
                sampled[seq_id] = _joined(ds)
        return extra

    def stops(self, seq_id: int, token: int) -> bool:
        """Whether token ends seq_id's completion: an EOS id (unless ignore_eos) or one of its stop_token_ids.
        O(stop ids)."""
        params = self._live.seqs[seq_id].params
        if token in self._eos and not params.ignore_eos:
            return True
        return token in (params.stop_token_ids or ())

    def finish(
        self,
        seqs: list[ScheduledSeq],
        sampled: dict[int, Sampled],
        accepted: dict[int, list[int]],
        drafts: dict[int, list[int]],
    ) -> None:
        """For each of seqs (the ScheduledSeqs run first) with a multi-step Sampled: its earlier tokens into accepted
        and drafts (the scheduler puts the draft in its slots' place and accepts it whole), and its block table cut
        to the blocks of its computed tokens (start + tokens run + accepted), as the scheduler cuts its own.
        O(len(seqs))."""
        for s in seqs:
            got = sampled.get(s.seq_id)
            if got is None or got.accepted is None or s.seq_id not in self._live.seqs:
                continue
            accepted[s.seq_id] = got.accepted
            drafts[s.seq_id] = got.accepted
            computed = s.start_pos + len(s.token_ids) + len(got.accepted)
            self._live.truncate(s.seq_id, cdiv(computed, self._live.block_size))


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
