"""The n-gram proposer's cost per decode step (runtime/scheduler/ngram.py), against the whole-context scan it replaced.

A sequence of --context tokens decodes --steps steps; each step appends one token (plain decoding's, or the bonus
token after a rejected draft) and asks for a draft of k = 4 tokens with n in [2, 4] (the spec_decode benchmark's
setting). Two token sources: "random" (uniform over a 49152-token vocabulary: almost nothing recurs, so every look-up
misses: the scan's worst case) and "copy" (the context's second half repeats its first: the longest suffix recurs).

- scan: the proposer before the index (kept here as the baseline): the context packed as int32 bytes and
  bytes.rfind for each n, O(context) per step;
- index: NgramIndex, O(k) look-ups per step plus indexing the new token; its first proposal indexes the whole
  context once (first_call_ms).
Reported: the median microseconds per step (robust to other jobs' interruptions on a shared machine; the means
beside them), the index's first call excluded (reported apart), the two
proposers' drafts equal at every step (same_drafts). machine: runtime.model.cpu_features.machine_facts().

    .venv/bin/python -m benchmarks.ngram_propose             # contexts 2048 and 8192, 400 steps
    .venv/bin/python -m benchmarks.ngram_propose --smoke     # seconds: writes nothing unless --out is given
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from array import array
from pathlib import Path
from typing import Any

from benchmarks.cli import apply_preset, write_result
from runtime.model.cpu_features import machine_facts
from runtime.scheduler.ngram import NgramIndex

RESULTS = Path(__file__).parent / "results" / "ngram_propose.json"
K = 4
MIN_N = 2
MAX_N = 4
VOCAB = 49152
_ITEM = 4  # bytes per token id in the scan's buffer


def scan_propose(token_ids: list[int], max_tokens: int) -> list[int]:
    """The proposer before the index: the same drafts as NgramIndex.propose, by bytes.rfind over the whole
    context packed as int32, a hit kept only at a token boundary."""
    total = len(token_ids)
    if max_tokens < 1 or total < MIN_N + 1:
        return []
    buf = array("i", token_ids).tobytes()
    for last in (total - max_tokens, total - 1):
        for n in range(min(MAX_N, last), MIN_N - 1, -1):
            hit = _rfind_token(buf, buf[(total - n) * _ITEM :], last)
            if hit >= 0:
                return list(token_ids[hit + n : hit + n + max_tokens])
    return []


def _rfind_token(buf: bytes, pattern: bytes, last: int) -> int:
    end = last * _ITEM
    while True:
        hit = buf.rfind(pattern, 0, end)
        if hit < 0 or hit % _ITEM == 0:
            return hit // _ITEM if hit >= 0 else -1
        end = hit + len(pattern) - 1


def make_tokens(source: str, length: int, rng: random.Random) -> list[int]:
    """length token ids: "random" (uniform) or "copy" (a random first half, repeated)."""
    if source == "random":
        return [rng.randrange(VOCAB) for _ in range(length)]
    half = [rng.randrange(VOCAB) for _ in range(length // 2)]
    return (half * 3)[:length]


def measure(source: str, context: int, steps: int, seed: int) -> dict[str, Any]:
    """One row: both proposers over the same steps of one sequence."""
    rng = random.Random(seed)
    tokens = make_tokens(source, context + steps, rng)
    index = NgramIndex(MIN_N, MAX_N)
    start = time.perf_counter()
    index.propose(tokens[:context], K)
    first_call = time.perf_counter() - start
    scan_s: list[float] = []
    index_s: list[float] = []
    same = True
    drafted = 0
    for known in range(context + 1, context + steps + 1):
        seq = tokens[:known]  # the sequence as the scheduler holds it (the slice is outside the timing)
        start = time.perf_counter()
        a = scan_propose(seq, K)
        scan_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        b = index.propose(seq, K)
        index_s.append(time.perf_counter() - start)
        same = same and a == b
        drafted += bool(b)
    return {
        "source": source,
        "context": context,
        "steps": steps,
        "steps_with_a_draft": drafted,
        "scan_us_per_step": round(1e6 * statistics.median(scan_s), 2),
        "index_us_per_step": round(1e6 * statistics.median(index_s), 2),
        "speedup": round(statistics.median(scan_s) / statistics.median(index_s), 1),
        "scan_us_mean": round(1e6 * sum(scan_s) / steps, 2),
        "index_us_mean": round(1e6 * sum(index_s) / steps, 2),
        "index_first_call_ms": round(1e3 * first_call, 2),
        "same_drafts": same,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="seconds: contexts 64 and 256, 20 steps")
    p.add_argument("--out", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        apply_preset(parser, args, {"context": [64, 256], "steps": 20})
    rows = [measure(s, c, args.steps, args.seed) for c in args.context for s in ("random", "copy")]
    result = {
        "benchmark": "ngram_propose",
        "k": K,
        "prompt_lookup_min": MIN_N,
        "prompt_lookup_max": MAX_N,
        "machine": machine_facts(),
        "rows": rows,
    }
    write_result(result, args.out, args.smoke, RESULTS)
    return result


if __name__ == "__main__":
    print(main())
