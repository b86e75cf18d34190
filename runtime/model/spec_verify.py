"""Verification of speculative drafts in the worker: one forward over each sequence's last token and its draft
d_1..d_k (an extend on its own paged blocks), then the rows' draws decide how much of the draft stands.

The rule is the rejection sampling of Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding", sec. 2.3) and Chen et al. 2023 ("Accelerating Large Language Model Decoding with Speculative Sampling",
alg. 2) for a draft that is a point mass q = 1[x = d_j] (prompt lookup proposes tokens, not distributions):

    accept d_j with probability min(1, p_j(d_j) / q(d_j)) = p_j(d_j); on rejection draw from norm(max(0, p_j - q)),
    which is p_j with d_j removed and renormalised; after k acceptances draw a bonus token from p_{k+1}.

Row j draws x_j from the target p_j exactly as plain decoding draws that token (every sampling option applied by the
Sampler, its uniform from the same seed and completion-token index), and the draft stands while x_j == d_j. That is
the rule above: P(x_j = d_j) = p_j(d_j), and x_j given x_j != d_j is distributed as norm(max(0, p_j - q)); the first
x_j that differs (or x_k after the last draft) is the extra token. So a seeded request samples exactly the tokens
plain decoding samples, and a greedy row accepts the longest prefix of the draft equal to its argmaxes.
Every option of the target is applied to row j as plain decoding would have after d_1..d_j-1 (rows counted from 1):
the penalties count those draft tokens as output (PenaltyState.rows' prior), the grammar's mask is the matcher's
state after them (GrammarState.rows), min_tokens and the seed read row j's completion-token index; logprobs are the
raw log-softmax of each emitted token's row, as plain decoding's. Beam search stays plain (draft_problem refuses it).
"""

from __future__ import annotations

from typing import NamedTuple

from runtime.protocol import ScheduledSeq, TokenLogprobs
from runtime.sampling_params import SamplingParams


class Sampled(NamedTuple):
    """One sequence's draw in the worker: the sampled token id and its logprobs (None: not asked); after a
    speculative draft, the draft tokens accepted before it (None: no draft) and their logprobs (one per accepted
    token where asked, else None)."""

    token_id: int
    logprobs: TokenLogprobs | None
    accepted: list[int] | None = None
    accepted_logprobs: list[TokenLogprobs] | None = None

    @property
    def emitted(self) -> list[int]:
        """The tokens the sequence gains: the accepted draft tokens, then token_id."""
        return [*(self.accepted or []), self.token_id]


class Verified(NamedTuple):
    """One sequence's verified draft: accepted (the draft's longest prefix that stands, maybe empty) and token (the
    token drawn after it)."""

    accepted: list[int]
    token: int


def draft_tokens(s: ScheduledSeq) -> list[int]:
    """s's draft d_1..d_k: the last num_draft_tokens of its input tokens ([] without a draft). O(k)."""
    k = s.num_draft_tokens
    return list(s.token_ids[len(s.token_ids) - k :]) if k else []


def row_priors(s: ScheduledSeq) -> list[list[int]]:
    """The draft tokens each of s's 1 + num_draft_tokens logits rows comes after: [], [d_1], ..., [d_1..d_k] (the
    output a row's penalties and grammar state see on top of the sequence's own). O(k^2)."""
    draft = draft_tokens(s)
    return [draft[:j] for j in range(len(draft) + 1)]


def logits_rows(seqs: list[ScheduledSeq]) -> list[int] | None:
    """The rows of the flat token batch of seqs whose logits the step needs when some sequence runs a draft: for
    each sequence that samples, in batch order, its last 1 + num_draft_tokens rows (the last token before the draft
    and each draft token); None when no sequence runs a draft (the last row of each sampling sequence then). O(rows)."""
    if not any(s.num_draft_tokens for s in seqs):
        return None
    rows: list[int] = []
    end = 0
    for s in seqs:
        end += len(s.token_ids)
        if s.sample:
            rows.extend(range(end - 1 - s.num_draft_tokens, end))
    return rows


def draft_problem(s: ScheduledSeq, params: SamplingParams) -> str | None:
    """Why s's draft cannot be verified, if it cannot: a draft on a step that does not sample or without a token
    before it, or params with beam search (a beam's candidates are not one draw per row). O(1)."""
    k = s.num_draft_tokens
    if k == 0:
        return None
    if k < 0 or not s.sample or k >= len(s.token_ids):
        return f"seq {s.seq_id}: {k} draft tokens in a step of {len(s.token_ids)} tokens (sample={s.sample})"
    if params.use_beam_search:
        return f"seq {s.seq_id}: a draft with beam search"
    return None


def row_token_indexes(s: ScheduledSeq, prompt_len: int) -> range:
    """The completion-token index each of s's logits rows draws (1 + num_draft_tokens rows; the Sampler's seed
    input): row j draws the token after position start_pos + len(token_ids) - 1 - num_draft_tokens + j."""
    first = s.start_pos + len(s.token_ids) - s.num_draft_tokens - prompt_len
    return range(first, first + s.num_draft_tokens + 1)


def sampled(s: ScheduledSeq, drawn: list[int], logprobs: list[TokenLogprobs | None], asked: bool) -> Sampled:
    """s's Sampled from its rows' draws drawn and their logprobs (1 + num_draft_tokens each, in row order; None
    where not asked): without a draft, row 0's draw; with one, accept's verification, the extra token with its
    row's logprobs and, when asked (params.logprobs set), each accepted token's row's logprobs. O(rows)."""
    if not s.num_draft_tokens:
        return Sampled(drawn[0], logprobs[0])
    verified = accept(s, drawn)
    a = len(verified.accepted)
    kept = [lp for lp in logprobs[:a] if lp is not None]
    return Sampled(verified.token, logprobs[a], verified.accepted, kept if asked else None)


def accept(s: ScheduledSeq, drawn: list[int]) -> Verified:
    """The verification of s's draft from its rows' draws drawn (1 + num_draft_tokens token ids, in order): the
    draft stands while drawn[j] equals draft token j; the first draw that differs, or the last, is the token.
    O(num_draft_tokens)."""
    k = s.num_draft_tokens
    draft = draft_tokens(s)
    a = 0
    while a < k and drawn[a] == draft[a]:
        a += 1
    return Verified(draft[:a], drawn[a])
