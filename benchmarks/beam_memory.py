"""KV memory of beam search: blocks shared across forked beams against each beam holding a full private copy.

The real Engine (Scheduler, KVCacheManager, ModelRunner) runs beam search (SamplingParams(use_beam_search=True, n=K,
ignore_eos=True): every beam reaches gen_tokens) one request at a time on a model. After every step the live beams'
block tables are read from the manager: shared = distinct blocks over the beams' tables (what the pool holds: forked
beams share the prompt and every full block they have in common), private = the sum of the tables' lengths (what K
beams each holding its own copy of its context would hold). Peaks over the request's steps, and the saving
1 - peak_shared / peak_private, are put beside the PagedAttention paper's 37.6-55.2% for beam search (Kwon et al.,
SOSP 2023, sec. 6.3, beam widths 2-6). Forks and copy-on-write copies are counted from the ForwardBatches sent.

Called by benchmarks/kv_memory.py (its "beam_search" rows); alone:
    .venv/bin/python -m benchmarks.beam_memory --model smollm2 --gen-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

PAPER_SAVING = (0.376, 0.552)  # Kwon et al. 2023, sec. 6.3: KV memory saved by sharing, beam search
PROMPTS = [
    "What is the capital of France? Answer in two sentences.",
    "Write a short poem about the sea.",
    "Explain in simple words how a bicycle stays upright.",
]


def measure_request(engine, prompt_ids: list[int], width: int, gen_tokens: int) -> dict:
    """One beam search request of `width` beams and gen_tokens tokens on engine; its peak blocks shared / private."""
    from runtime.sampling_params import SamplingParams

    batches: list = []
    execute = engine.runner.execute

    def recording(batch):
        batches.append(batch)
        return execute(batch)

    engine.runner.execute = recording
    params = SamplingParams(use_beam_search=True, n=width, temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
    rid = engine.add_request(input_ids=prompt_ids, sampling_params=params)
    peak_shared = peak_private = 0
    savings = []
    try:
        while rid not in engine._done:
            engine.step()
            req = engine.scheduler.requests.get(rid)
            if req is None or req.beam is None:
                continue
            tables = [engine.manager.block_table(b.seq_id) for b in req.beam.running if b.status.value == "running"]
            shared, private = len({b for t in tables for b in t}), sum(len(t) for t in tables)
            peak_shared, peak_private = max(peak_shared, shared), max(peak_private, private)
            if len(tables) == width:
                savings.append(1 - shared / private)
    finally:
        engine.runner.execute = execute
    out = engine.result(rid)
    return {
        "width": width,
        "prompt_tokens": len(prompt_ids),
        "generated_tokens": len(out.outputs[0].token_ids),
        "peak_shared_blocks": peak_shared,
        "peak_private_blocks": peak_private,
        "saving": round(1 - peak_shared / peak_private, 4),
        "mean_step_saving": round(statistics.mean(savings), 4) if savings else 0.0,
        "forks": sum(len(b.forks) for b in batches),
        "cow_copies": sum(len(b.copies) + len(b.fork_copies) for b in batches),
        "registrations": sum(s.sampling_params is not None for b in batches for s in b.seqs),
    }


def run(
    model: str, widths: Sequence[int], gen_tokens: int, num_prompts: int, block_size: int = 16, **engine_kw
) -> dict:
    """Rows per (width, prompt) and a total per width (peaks summed over the prompts); JSON-ready."""
    from runtime.engine import Engine

    t0 = time.perf_counter()
    engine = Engine(model, block_size=block_size, num_blocks=2048, enable_prefix_caching=False, **engine_kw)
    tok = engine.tokenizer
    prompts = [
        list(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)["input_ids"])
        if tok is not None
        else list(range(10, 40 + 7 * i))
        for i, c in enumerate(PROMPTS[:num_prompts])
    ]
    rows = [measure_request(engine, p, k, gen_tokens) for k in widths for p in prompts]
    totals = {}
    for k in widths:
        mine = [r for r in rows if r["width"] == k]
        shared, private = sum(r["peak_shared_blocks"] for r in mine), sum(r["peak_private_blocks"] for r in mine)
        totals[str(k)] = {
            "peak_shared_blocks": shared,
            "peak_private_blocks": private,
            "saving": round(1 - shared / private, 4),
        }
    engine.shutdown()
    return {
        "model": model,
        "dtype": engine_kw.get("dtype", "auto"),
        "block_size": block_size,
        "gen_tokens": gen_tokens,
        "paper_saving": list(PAPER_SAVING),
        "rows": rows,
        "by_width": totals,
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--widths", default="2,4,8")
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=3)
    ns = parser.parse_args(argv)
    result = run(ns.model, [int(w) for w in ns.widths.split(",")], ns.gen_tokens, ns.prompts)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
