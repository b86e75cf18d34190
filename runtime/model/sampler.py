"""The batched sampler: greedy, temperature, top-k, top-p (Holtzman et al. 2020), min-p (Nguyen et al. 2024).

Each non-greedy row is sampled by inverse-CDF over its filtered distribution sorted by probability, with a single
uniform number u per draw. For a request with a seed, u = hash(seed, sample_index, token_index) (blake2b), so a draw
depends only on those three numbers and the logits row: never on the batch composition, the step, or other requests.
Rows without a seed take u from the sampler's own generator (seeded by ServerArgs.seed).

Penalties (frequency, presence, repetition: runtime/model/penalties.py) come first, on the raw logits of the rows
that have them, as in vLLM's sampler; greedy rows take the argmax of the penalised logits. Then the filters, in the
order the Hugging Face and vLLM samplers apply them: temperature, then top-k, then top-p and min-p on the top-k
renormalised distribution. In the descending order each filter keeps a prefix, so the kept set is the first
`keep` sorted tokens, keep = min(k, n_top_p, n_min_p) >= 1, and the draw is clamped into it.
"""

from __future__ import annotations

import hashlib
import random
import struct
from typing import NamedTuple

import torch

from runtime.model.grammar import GrammarRows, apply_token_bitmask
from runtime.model.logit_bias import apply_logit_bias
from runtime.model.penalties import PenaltyRows
from runtime.protocol import TokenLogprobs
from runtime.sampling_params import SamplingParams

_TWO_POW_53 = float(2**53)
CHUNK = 256  # row_argmax's chunk: amax runs over V / CHUNK chunks, argmax over V / CHUNK + CHUNK values
ARGMAX_MIN_ROWS = 4  # fewer rows take torch's argmax: there the chunked ops' dispatch costs more than the scan


class SampleRequest(NamedTuple):
    """One row to sample: its params, which of the request's n samples it is, and its completion-token index."""

    params: SamplingParams
    sample_index: int
    token_index: int


class SamplerOutput(NamedTuple):
    """token_ids: one per row. logprobs: per row (None where not asked), or None when no row asked."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None


def seeded_uniform(seed: int, sample_index: int, token_index: int) -> float:
    """A uniform float in [0, 1) that depends only on (seed, sample_index, token_index) (53 random bits); a negative
    seed is taken as its two's-complement 64-bit word (SamplingParams.seed_word)."""
    key = struct.pack("<QQQ", seed & (2**64 - 1), sample_index & (2**64 - 1), token_index & (2**64 - 1))
    bits = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 11
    return bits / _TWO_POW_53


def row_argmax(scores: torch.Tensor) -> torch.Tensor:
    """int64 [N]: the argmax of each row of scores float32 [N, V], equal to scores.argmax(dim=-1) (the first index
    of the maximum; a NaN counts as the maximum) but faster on CPU for N >= ARGMAX_MIN_ROWS.

    torch's CPU argmax along a row is not vectorized, while amax is (benchmarks/step_breakdown.py times the sampling
    this is part of). So on CPU, with V a multiple of 64: the maxima of chunks of CHUNK (or 128, 64) columns (amax),
    the first chunk holding the row's maximum (argmax over V / CHUNK values), and the first maximum inside it (argmax
    over CHUNK). The first chunk holding the maximum holds its first occurrence, so ties resolve as argmax's. Its six
    ops each pay a dispatch right after a forward, more than argmax's scan of fewer than ARGMAX_MIN_ROWS rows; those,
    other devices and other widths take argmax itself.
    """
    n, width = scores.shape
    chunk = next((c for c in (CHUNK, 128, 64) if width % c == 0), 0)
    if scores.device.type != "cpu" or n < ARGMAX_MIN_ROWS or not chunk or width <= chunk:
        return scores.argmax(dim=-1)
    chunks = scores.reshape(n, width // chunk, chunk)
    best = chunks.amax(dim=-1).argmax(dim=-1)
    return best * chunk + chunks[torch.arange(n), best].argmax(dim=-1)


def beam_candidates(width: int, num_eos: int) -> int:
    """Candidates a beam search row returns: max(2, 1 + num_eos) * width, as transformers' _beam_search keeps (so
    at least width of them do not end in EOS)."""
    return max(2, 1 + num_eos) * width


class Sampler:
    """Samples one token per logits row. Holds the generator of unseeded draws (mutated by each such draw) and the
    model's EOS ids (beam search rows mask them under ignore_eos)."""

    def __init__(self, seed: int = 0, eos_token_ids: list[int] | tuple[int, ...] = ()) -> None:
        self._rng = random.Random(seed)
        self.eos_token_ids = list(eos_token_ids)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SampleRequest],
        penalties: PenaltyRows | None = None,
        token_bitmask: GrammarRows | None = None,
    ) -> SamplerOutput:
        """Sample logits float32 [N, vocab] (N == len(rows)); returns N token ids (and logprobs where asked).

        penalties: the rows with frequency / presence / repetition penalties and their token state (PenaltyState.rows);
        None (no row has them) costs nothing. logits is not changed.
        token_bitmask: the rows with structured outputs and their grammar's allowed tokens (GrammarState.rows);
        the others become -inf after the penalties (runtime/model/grammar/bitmask.py); None costs nothing.

        Rows whose params are greedy (temperature below GREEDY_TEMPERATURE, 0 included) take the argmax: the
        sampler never divides by such a temperature (logits / 1e-38 overflows float32 into inf/nan, whose draw is
        junk). Every int of the params that enters a tensor is clamped to the vocabulary first (top_k, logprobs);
        SamplingParams bounds the rest (temperature in [1e-5, 1e4] here, seed an int64).
        Logprobs are the natural log-softmax of the raw logits (before penalties, temperature and filters: vLLM's
        default logprobs_mode "raw_logprobs").
        Raises ValueError when the row count differs from len(rows).
        """
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sample requests")
        scores = logits if penalties is None else penalties.apply(logits)
        scores = apply_logit_bias(scores, rows, self.eos_token_ids)  # stage 3: logit_bias and min_tokens
        scores = apply_token_bitmask(scores, token_bitmask, owned=scores is not logits)
        token_ids = row_argmax(scores)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
            uniforms = [self._uniform(rows[i]) for i in random_rows]
            token_ids[idx] = self._sample_rows(
                scores.index_select(0, idx), [rows[i].params for i in random_rows], uniforms
            )
        ids = token_ids.tolist()
        return SamplerOutput(ids, _logprobs(logits, rows, ids, self.eos_token_ids))

    def _uniform(self, row: SampleRequest) -> float:
        if row.params.seed is None:
            return self._rng.random()
        return seeded_uniform(row.params.seed, row.sample_index, row.token_index)

    @staticmethod
    def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p and the inverse-CDF draw for M rows [M, V] -> token ids int64 [M]."""
        m, vocab = logits.shape
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        vals, order = torch.sort(logits / temps[:, None], dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab, device=dev)
        top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=dev)
        vals = vals.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
        probs = torch.softmax(vals, dim=-1)
        keep = top_k
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
            mass_before = torch.cumsum(probs, dim=-1) - probs
            n_top_p = (mass_before < top_p[:, None]).sum(dim=-1)
            n_top_p = torch.where(top_p >= 1.0, torch.full_like(n_top_p, vocab), n_top_p)
            keep = torch.minimum(keep, n_top_p)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
            keep = torch.minimum(keep, (probs >= min_p[:, None] * probs[:, :1]).sum(dim=-1))
        keep = keep.clamp(min=1)
        probs = probs.masked_fill(ranks[None, :] >= keep[:, None], 0.0)
        cdf = torch.cumsum(probs, dim=-1)
        u = torch.tensor(uniforms, dtype=torch.float32, device=dev)
        target = u * cdf.gather(1, (keep - 1)[:, None]).squeeze(1)
        pick = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
        pick = torch.minimum(pick, keep - 1)
        return order.gather(1, pick[:, None]).squeeze(1)


def _logprobs(
    logits: torch.Tensor, rows: list[SampleRequest], ids: list[int], eos: list[int]
) -> list[TokenLogprobs | None] | None:
    """Per asked row: the float32 log-softmax of its raw logits at the sampled token and its top `logprobs`; a beam
    search row's top are its beam_candidates(n, len(eos)) best tokens, EOS masked to -inf after the log-softmax
    under ignore_eos (as transformers' min_new_tokens does)."""
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None or r.params.use_beam_search]
    if not asked:
        return None
    out: list[TokenLogprobs | None] = [None] * len(rows)
    lp = torch.log_softmax(logits.index_select(0, torch.tensor(asked, device=logits.device)), dim=-1)
    for j, i in enumerate(asked):
        p = rows[i].params
        if p.use_beam_search and p.ignore_eos and eos:
            lp[j, eos] = float("-inf")
        wanted = p.logprobs or 0
        if p.use_beam_search:
            wanted = beam_candidates(p.n, len(eos))
        n = min(wanted, lp.shape[-1])
        top_ids: list[int] = []
        top_lps: list[float] = []
        if n:
            top = torch.topk(lp[j], n)
            top_ids = top.indices.tolist()
            top_lps = top.values.tolist()
        out[i] = TokenLogprobs(logprob=float(lp[j, ids[i]]), top_token_ids=top_ids, top_logprobs=top_lps)
    return out
