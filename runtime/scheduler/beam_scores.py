"""Beam search's arithmetic: the candidates of a beam step, hypothesis scores, and a request's final ranked outputs.
Pure functions over BeamState (no blocks, no queues, no torch); runtime/scheduler/beam_search.py drives the steps.

The semantics are transformers' `GenerationMixin._beam_search` (the vectorised one of v4.50+, as in v5) under
do_sample=False, early_stopping=True and num_return_sequences = num_beams = K:
  - every running beam b, with cumulative logprob s_b, offers candidates (t, s_b + logprob_b(t)), the sum rounded to
    float32 as transformers' float32 tensors do; the best C = max(2, 1 + num_eos) * K over all beams are kept, best
    first (ties: lower beam rank, then lower token id: the order of torch.topk over the flattened [beam, vocab]
    scores where it is stable). Logprobs are the float32 log-softmax over the whole vocabulary; under ignore_eos the
    EOS ids are then masked (transformers' min_new_tokens), so EOS is never a candidate.
  - a candidate ends when its token is EOS (not under ignore_eos) or its completion reaches the length limit
    (max_tokens, capped by max_model_len). Each of the first K candidates that ends becomes a finished hypothesis of
    score s / length ** length_penalty (length: completion tokens, its last one included); the request keeps the K
    best hypotheses.
  - the next running beams are the first K candidates that do not end; the request is done when it holds K
    hypotheses (early_stopping=True) or no candidate continues.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import msgspec

from runtime.protocol import TokenLogprobs, TokenOutput
from runtime.scheduler.request import BeamState, Hypothesis, RequestState

PRUNED = "pruned"  # the internal finish reason of a beam that leaves (no output of its own)


_F32_MAX = 3.4028234663852886e38


def f32(x: float) -> float:
    """x rounded to the nearest float32 (the precision of transformers' beam scores); beyond float32's range: +-inf,
    as a float32 tensor overflows."""
    if abs(x) > _F32_MAX and x == x:
        return math.copysign(math.inf, x)
    return float(struct.unpack("f", struct.pack("f", x))[0])


class Candidate(NamedTuple):
    """A continuation: cumulative logprob (float32) after appending token to the beam of rank `beam`."""

    score: float
    beam: int
    token: int


def best_candidates(scores: list[float], offers: list[TokenLogprobs], keep: int) -> list[Candidate]:
    """The `keep` best continuations of beams with cumulative logprobs `scores` and offered (token, logprob) pairs,
    best first (ties: lower beam rank, then lower token id); -inf candidates (masked EOS) are never kept.
    O(sum of offers * log)."""
    cands = [
        Candidate(f32(s + lp), b, t)
        for b, (s, o) in enumerate(zip(scores, offers, strict=True))
        for t, lp in zip(o.top_token_ids, o.top_logprobs, strict=True)
        if lp != float("-inf")
    ]
    cands.sort(key=lambda c: (-c.score, c.beam, c.token))
    return cands[:keep]


def penalised(logprob: float, length: int, length_penalty: float) -> float:
    """transformers' hypothesis score: logprob / length ** length_penalty, in float32."""
    return f32(logprob / f32(float(length) ** length_penalty))


def beam_outputs(req: RequestState, st: BeamState, reason: str | None) -> list[TokenOutput]:
    """The request's K final outputs, best first: its hypotheses, then (fewer than K) its running beams by score,
    each with all its completion tokens and its score (TokenOutput.score). reason None: each hypothesis's own; else
    every output ends with it. Reads req and st only; O(K log K + their tokens)."""
    prompt_len = len(req.prompt_ids)
    length_penalty = req.params.length_penalty
    ranked = list(st.finished)
    live = sorted(st.running, key=lambda b: -st.scores.get(b.seq_id, 0.0))
    for b in live[: max(0, st.width - len(ranked))]:
        score = penalised(st.scores.get(b.seq_id, 0.0), max(1, b.num_output), length_penalty)
        ranked.append(Hypothesis(score, b.token_ids[prompt_len:], "length"))
    usage = st.running[0].usage()
    outs = [
        TokenOutput(
            req.rid,
            i,
            h.token_ids,
            reason or h.reason,
            msgspec.structs.replace(usage, completion_tokens=len(h.token_ids)),
            score=h.score,
        )
        for i, h in enumerate(ranked[: st.width])
    ]
    for i in range(len(outs), st.width):  # ended before it had K beams (an abort on the prompt): empty ones
        outs.append(TokenOutput(req.rid, i, [], reason or "abort", msgspec.structs.replace(usage, completion_tokens=0)))
    return outs
