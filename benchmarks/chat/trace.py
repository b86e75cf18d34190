"""The trace of a multi-turn chat run (one Record per request) and what is measured on it: latency percentiles,
hit rates against the trace's oracle, the first re-tokenization mismatch per turn, and the issue's targets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Reply:
    """What one request returned: absolute perf_counter times, completion ids and text, the server's token counts
    (None where it does not report them). completion_tokens: the server's count where output_ids are re-tokenized
    from the text (None: len(output_ids) is the count)."""

    t_first: float | None
    t_end: float
    output_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None = None

    @property
    def num_output(self) -> int:
        return len(self.output_ids) if self.completion_tokens is None else self.completion_tokens


@dataclass
class Record:
    """One request of the trace (turn is 1-based)."""

    conv: int
    turn: int
    t_submit: float
    messages: list[dict[str, str]]
    reply: Reply
    prompt_ids: list[int] = field(default_factory=list)


def oracle_cached(records: list[Record], block_size: int, include_inflight: bool = False) -> list[int]:
    """Per record: the longest prefix of prompt_ids equal to a prefix of (prompt_ids + output_ids) of a record that
    finished (t_end <= t_submit) before it was sent, in whole blocks, at most len(prompt_ids) - 1 tokens.
    include_inflight: also match the prompt_ids of records sent earlier and not finished yet (what a server that
    shares in-flight prefixes can reach, e.g. simultaneous first turns sharing the system prompt).

    Block-level chained hashes of every finished sequence go in a set; a query walks its own chain. O(total tokens)."""

    def chain(ids: list[int], n_blocks: int):
        h = 0
        for k in range(n_blocks):
            h = hash((h, tuple(ids[k * block_size : (k + 1) * block_size])))
            yield h

    events = sorted(
        [(r.reply.t_end, 0, i) for i, r in enumerate(records)] + [(r.t_submit, 1, i) for i, r in enumerate(records)]
    )
    seen: set[int] = set()
    out = [0] * len(records)
    for _, kind, i in events:
        r = records[i]
        if kind == 0:
            full = r.prompt_ids + r.reply.output_ids
            seen.update(chain(full, len(full) // block_size))
            continue
        n = 0
        for h in chain(r.prompt_ids, (len(r.prompt_ids) - 1) // block_size):
            if h not in seen:
                break
            n += 1
        out[i] = n * block_size
        if include_inflight:
            seen.update(chain(r.prompt_ids, len(r.prompt_ids) // block_size))
    return out


def first_mismatches(records: list[Record]) -> dict[tuple[int, int], int | None]:
    """(conv, turn) -> first index where turn's prompt ids differ from turn-1's prompt + output ids (None: equal
    over the shorter length). Turn 1 has no previous turn and is left out."""
    by_key = {(r.conv, r.turn): r for r in records}
    out = {}
    for (conv, turn), r in by_key.items():
        prev = by_key.get((conv, turn - 1))
        if prev is None:
            continue
        before = prev.prompt_ids + prev.reply.output_ids
        pairs = enumerate(zip(before, r.prompt_ids, strict=False))
        out[(conv, turn)] = next((k for k, (a, b) in pairs if a != b), None)
    return out


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


def summarize(records: list[Record], wall_s: float, block_size: int) -> dict[str, Any]:
    """The per-target metrics of the JSON (seconds, tokens, fractions)."""
    oracle = oracle_cached(records, block_size)
    oracle_inflight = oracle_cached(records, block_size, include_inflight=True)
    mismatch = first_mismatches(records)
    ttft = [r.reply.t_first - r.t_submit for r in records if r.reply.t_first is not None]
    tpot = [
        (r.reply.t_end - r.reply.t_first) / (r.reply.num_output - 1)
        for r in records
        if r.reply.t_first is not None and r.reply.num_output > 1
    ]
    prompt = [r.reply.prompt_tokens if r.reply.prompt_tokens is not None else len(r.prompt_ids) for r in records]
    cached = [r.reply.cached_tokens or 0 for r in records]
    out_tokens = sum(r.reply.num_output for r in records)
    per_turn = []
    for turn in sorted({r.turn for r in records}):
        idx = [i for i, r in enumerate(records) if r.turn == turn]
        t_ttft = [records[i].reply.t_first - records[i].t_submit for i in idx if records[i].reply.t_first is not None]
        found = [mismatch[(records[i].conv, turn)] for i in idx if mismatch.get((records[i].conv, turn)) is not None]
        per_turn.append(
            {
                "turn": turn,
                "requests": len(idx),
                "ttft_p50_s": _pct(t_ttft, 50),
                "hit_rate": round(sum(cached[i] for i in idx) / max(1, sum(prompt[i] for i in idx)), 4),
                "oracle_hit_rate": round(
                    sum(oracle[i] for i in idx) / max(1, sum(len(records[i].prompt_ids) for i in idx)), 4
                ),
                "oracle_inflight_hit_rate": round(
                    sum(oracle_inflight[i] for i in idx) / max(1, sum(len(records[i].prompt_ids) for i in idx)), 4
                ),
                "first_mismatch": min(found) if found else None,
                "mismatched_conversations": len(found),
            }
        )
    return {
        "requests": len(records),
        "wall_s": round(wall_s, 2),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "ttft_p99_s": _pct(ttft, 99),
        "ttft_turn2plus_p50_s": _pct(
            [r.reply.t_first - r.t_submit for r in records if r.turn >= 2 and r.reply.t_first is not None], 50
        ),
        "tpot_s": _pct(tpot, 50),
        "e2e_p50_s": _pct([r.reply.t_end - r.t_submit for r in records], 50),
        "req_per_s": round(len(records) / wall_s, 4),
        "output_tok_per_s": round(out_tokens / wall_s, 2),
        "prompt_tokens": sum(prompt),
        "cached_tokens": sum(cached),
        "hit_rate": round(sum(cached) / max(1, sum(prompt)), 4),
        "oracle_hit_rate": round(sum(oracle) / max(1, sum(len(r.prompt_ids) for r in records)), 4),
        "oracle_inflight_hit_rate": round(sum(oracle_inflight) / max(1, sum(len(r.prompt_ids) for r in records)), 4),
        "prompt_tokens_agree": sum(r.reply.prompt_tokens in (None, len(r.prompt_ids)) for r in records),
        "per_turn": per_turn,
        "trace": [
            [r.conv, r.turn, len(r.prompt_ids), c, o, r.reply.num_output, r.reply.finish_reason]
            for r, c, o in zip(records, cached, oracle, strict=True)
        ],
    }


def targets_met(targets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets where the needed targets ran: hit rate >= 0.95 x oracle (radixserve, engine); TTFT p50 on
    turns >= 2 at least 2x lower with caching on than off; output tokens/s with caching on >= off; output tokens/s
    through HTTP (radixserve-http) >= 0.95 x through ZeroMQ (radixserve), with the TTFT p50 difference beside it."""
    out: dict[str, Any] = {}
    for name in ("radixserve", "engine"):
        t = targets.get(name)
        if t and t["oracle_hit_rate"]:
            ratio = t["hit_rate"] / t["oracle_hit_rate"]
            out[f"{name}_hit_rate_over_oracle"] = {"value": round(ratio, 4), "target": 0.95, "met": ratio >= 0.95}
            if t["oracle_inflight_hit_rate"]:  # informational: the oracle that also counts in-flight prompts
                out[f"{name}_hit_rate_over_inflight_oracle"] = round(t["hit_rate"] / t["oracle_inflight_hit_rate"], 4)
    for name, t in targets.items():  # issue 8: cache-aware routing keeps the single replica's hit rate
        single = targets.get("radixserve")
        if name.startswith("router=cache_aware") and single and single["hit_rate"]:
            ratio = t["hit_rate"] / single["hit_rate"]
            out[f"{name}_hit_rate_over_single"] = {"value": round(ratio, 4), "target": 0.95, "met": ratio >= 0.95}
    http = targets.get("radixserve-http")  # issue 13: the HTTP front door costs little
    zmq = targets.get("radixserve")
    if http and zmq and zmq["output_tok_per_s"]:
        ratio = http["output_tok_per_s"] / zmq["output_tok_per_s"]
        out["http_output_tok_per_s_over_zmq"] = {"value": round(ratio, 4), "target": 0.95, "met": ratio >= 0.95}
        if http["ttft_p50_s"] is not None and zmq["ttft_p50_s"] is not None:  # informational on this workload
            out["http_ttft_p50_minus_zmq_s"] = round(http["ttft_p50_s"] - zmq["ttft_p50_s"], 4)
    on = targets.get("radixserve")
    off = targets.get("radixserve-nocache")
    if on and off and on["ttft_turn2plus_p50_s"] and off["ttft_turn2plus_p50_s"]:
        speedup = off["ttft_turn2plus_p50_s"] / on["ttft_turn2plus_p50_s"]
        out["ttft_turn2plus_speedup"] = {"value": round(speedup, 3), "target": 2.0, "met": speedup >= 2.0}
        ratio = on["output_tok_per_s"] / off["output_tok_per_s"]
        out["output_tok_per_s_on_over_off"] = {"value": round(ratio, 3), "target": 1.0, "met": ratio >= 1.0}
    return out
