"""KV memory: paged blocks (the real radix/ KVCacheManager) against a contiguous allocator sized for the max context.

Replays the worked estimate of the design notes ("PagedAttention and the KV memory manager"): a pool of 1,000 KV
blocks of 16 tokens (16,000 token slots), a 2,048-token maximum context, request lengths drawn with mean 300 tokens.
The contiguous allocator reserves 2,048 contiguous slots per admitted request (first fit over the slot address
space); the paged side is radix.manager.KVCacheManager (num_blocks = 1,001: block 0 is the reserved null block, so
both sides hold 16,000 slots), driven with the operations the scheduler performs (runtime/scheduler/scheduler.py): admit
with add_sequence once the whole prompt's blocks fit, commit_computed after each step, allocate + prepare_write one slot
per decode step, preempt the most recently admitted sequence by recompute when a block cannot be had, free at the end.

Three measurements (every figure is a slot count over the 16,000 slots, or a fraction of them):
- static: the design notes' arithmetic, replayed: requests at their final length admitted in order until one does
  not fit. Contiguous: floor(16000 / 2048) = 7 sequences; paged: about 16000 / (300 + 7.5) sequences.
- dynamic: continuous batching of `--requests` requests (one prefill step, then one token per step), averaged over
  the steps at which a request waits for memory (the memory-bound steady state). Waste is split into
  reservation (slots reserved for tokens the sequence has not produced yet), internal fragmentation (reserved slots
  past the sequence's final length; for paged, the unfilled tail of the last block) and external fragmentation (free
  slots in holes too small for the waiting request). For paged, the mean waste per sequence is compared with the
  (B - 1) / 2 = 7.5 expected tail of a uniform L mod B, and its maximum with B - 1 (Kwon et al., SOSP 2023, sec. 4.2).
- parallel sampling: n = 4 samples over one shared 512-token prompt, forked as the scheduler forks them (prefill of
  prompt[:-1], fork, each child writes the last prompt token through prepare_write: copy-on-write of the shared
  partial block), against 4 full copies; blocks in use after the prompt and at the end of generation.
- hybrid KV memory (benchmarks/kv_hybrid.py): Gemma 3 270M's shapes, KV bytes per sequence and concurrent sequences
  at a fixed memory, all-full against sliding-window groups, at 1k / 4k / 8k contexts, beside the issue's formula.
- beam search (benchmarks/beam_memory.py): the real Engine on a model (default the embedded SmolLM2), K = 2, 4, 8
  beams, 3 prompts, 64 and 256 generated tokens: peak blocks shared by the forked beams against each beam holding a
  full private copy, and the saving beside the PagedAttention paper's 37.6-55.2%.

    .venv/bin/python -m benchmarks.kv_memory            # 1,000 requests -> results/kv_memory.json + kv_memory.png
    .venv/bin/python -m benchmarks.kv_memory --smoke    # a second; writes nothing unless --out is given
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

from benchmarks.cli import output_path
from benchmarks.kv_hybrid import hybrid_rows
from benchmarks.kv_replay import VOCAB, ContiguousSim, PagedSim, draw_requests, static_replay, token_ids
from radix.blocks import cdiv
from radix.manager import KVCacheManager

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results" / "kv_memory.json"


def parallel_sampling(n: int, prompt_len: int, gen_tokens: int, block_size: int) -> dict:
    """Blocks in use for n samples of one prompt: forked with copy-on-write (as the scheduler does) vs n full copies.

    Shared: add_sequence(prompt, prefill prompt[:-1]), commit, fork n children, free the parent; each child writes the
    last prompt token through prepare_write (a copy of the shared partial block for all but the last writer), then
    gen_tokens tokens. Full copies: n independent sequences of the same prompt.
    """
    prompt = token_ids(10**6, prompt_len)
    num_blocks = n * cdiv(prompt_len + gen_tokens, block_size)  # room for the full copies
    shared = KVCacheManager(num_blocks + 1, block_size, enable_prefix_caching=False)
    shared.add_sequence(0, shared.match_prefix(shared.block_keys(prompt)), num_new_tokens=prompt_len - 1)
    shared.commit_computed(0, prompt_len - 1)
    children = list(range(1, n + 1))
    for c in children:
        shared.fork(0, c)
    shared.free(0)
    copies = 0
    for c in children:
        shared.allocate(c, 1)
        copies += len(shared.prepare_write(c, prompt_len - 1, prompt_len))
        shared.commit_computed(c, prompt_len)
    after_prompt = shared.stats().in_use_blocks
    full = KVCacheManager(num_blocks + 1, block_size, enable_prefix_caching=False)
    for c in children:
        full.add_sequence(c, full.match_prefix(full.block_keys(prompt)))
        full.commit_computed(c, prompt_len)
    full_after_prompt = full.stats().in_use_blocks
    for mgr in (shared, full):
        for step in range(gen_tokens):
            for c in children:
                pos = prompt_len + step
                mgr.allocate(c, 1)
                pairs = mgr.prepare_write(c, pos, pos + 1)
                copies += len(pairs) if mgr is shared else 0
                mgr.append_tokens(c, [(c * 131 + step) % VOCAB])
                mgr.commit_computed(c, pos + 1)
        mgr.check_invariants()
    end = shared.stats().in_use_blocks
    full_end = full.stats().in_use_blocks
    return {
        "n": n,
        "prompt_tokens": prompt_len,
        "generated_tokens_per_sample": gen_tokens,
        "cow_block_copies": copies,
        "after_prompt": {
            "shared_blocks": after_prompt,
            "full_copy_blocks": full_after_prompt,
            "saved_fraction": round(1 - after_prompt / full_after_prompt, 4),
        },
        "end_of_generation": {
            "shared_blocks": end,
            "full_copy_blocks": full_end,
            "saved_fraction": round(1 - end / full_end, 4),
        },
    }


def _slot_fraction(summary: dict, part: str) -> float:
    """The fraction of the KV slots in `part` (live, free, or a kind of waste) of one allocator's dynamic summary."""
    if part == "live":
        return summary["live_fraction"]
    if part == "free":
        return summary["free_fraction"]
    return summary["waste_fraction"][part]


def plot(result: dict, path: Path) -> None:
    """Bar chart: slot composition (dynamic), concurrency (static and dynamic), parallel-sampling blocks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dyn = result["dynamic"]
    static = result["static"]
    par = result["parallel_sampling"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = ["contiguous", "paged"]
    parts = [
        ("live", "tab:green"),
        ("reservation", "tab:orange"),
        ("internal", "tab:red"),
        ("external", "tab:purple"),
        ("free", "lightgray"),
    ]
    bottom = [0.0, 0.0]
    for part, color in parts:
        vals = [_slot_fraction(dyn[k], part) for k in names]
        axes[0].bar(names, vals, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    axes[0].set_ylabel("fraction of KV slots (steady state)")
    axes[0].legend(fontsize=8)
    slots = result["config"]["num_blocks"] * result["config"]["block_size"]
    axes[0].set_title(f"where the {slots:,} KV slots go")
    x = range(2)
    axes[1].bar([i - 0.2 for i in x], [static[k]["concurrent_sequences"] for k in names], 0.4, label="static")
    axes[1].bar([i + 0.2 for i in x], [dyn[k]["concurrent_sequences_mean"] for k in names], 0.4, label="dynamic")
    axes[1].set_xticks(list(x), names)
    axes[1].set_ylabel("concurrent sequences")
    axes[1].legend(fontsize=8)
    axes[1].set_title("sequences admitted")
    phases = ["after_prompt", "end_of_generation"]
    axes[2].bar([i - 0.2 for i in x], [par[p]["full_copy_blocks"] for p in phases], 0.4, label="full copies")
    axes[2].bar([i + 0.2 for i in x], [par[p]["shared_blocks"] for p in phases], 0.4, label="copy-on-write")
    axes[2].set_xticks(list(x), ["after prompt", "end of generation"])
    axes[2].set_ylabel("blocks in use")
    axes[2].legend(fontsize=8)
    axes[2].set_title(f"n={par['n']} samples, {par['prompt_tokens']}-token prompt")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(
    num_blocks: int,
    block_size: int,
    max_len: int,
    mean_len: int,
    requests: int,
    seed: int,
    gen_tokens: int,
    beam: dict | None = None,
    hybrid: dict | None = None,
) -> dict:
    """All the measurements (beam: beam_memory.run's model, widths, token counts and prompts; None: no beam rows;
    hybrid: kv_hybrid.hybrid_rows' contexts, memory, block_size and chunk; None: none); returns the JSON-ready
    result."""
    from runtime.model.cpu_features import machine_facts

    t0 = time.perf_counter()
    reqs = draw_requests(requests, mean_len, max_len, seed)
    contiguous = ContiguousSim(reqs, num_blocks * block_size, max_len)
    contiguous.run()
    paged = PagedSim(reqs, num_blocks, block_size)
    paged.run()
    paged.mgr.check_invariants()
    result = {
        "config": {
            "num_blocks": num_blocks,
            "block_size": block_size,
            "max_context": max_len,
            "mean_len_target": mean_len,
            "requests": requests,
            "seed": seed,
            "mean_len_drawn": round(statistics.mean(length for _, length in reqs), 1),
            "length_distribution": "final_len ~ Gamma(2) rescaled to the mean, clipped to [2, max_context]; "
            "prompt_len = final_len // 4",
        },
        "static": static_replay(reqs, num_blocks, block_size, max_len, seed=seed),
        "dynamic": {"contiguous": contiguous.summary(), "paged": paged.summary()},
        "parallel_sampling": parallel_sampling(4, 512, gen_tokens, block_size),
    }
    if hybrid is not None:
        result["hybrid_kv"] = hybrid_rows(**hybrid)
    result["machine"] = machine_facts()
    if beam is not None:
        from benchmarks import beam_memory

        result["beam_search"] = [
            beam_memory.run(beam["model"], beam["widths"], n, beam["prompts"], block_size) for n in beam["gen_tokens"]
        ]
    dyn = result["dynamic"]
    result["paged_vs_contiguous_concurrency"] = round(
        dyn["paged"]["concurrent_sequences_mean"] / dyn["contiguous"]["concurrent_sequences_mean"], 2
    )
    result["elapsed_s"] = round(time.perf_counter() - t0, 2)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=1000, help="usable KV blocks (the null block is extra)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--max-context", type=int, default=2048, help="tokens reserved per contiguous sequence")
    parser.add_argument("--mean-len", type=int, default=300, help="mean request length (tokens)")
    parser.add_argument("--requests", type=int, default=1000, help="requests of the dynamic replay")
    parser.add_argument("--gen-tokens", type=int, default=300, help="tokens per parallel sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--beam-model", default="smollm2", help="model of the beam search rows ('' for none)")
    parser.add_argument("--beam-tokens", default="64,256", help="generated tokens of the beam search rows")
    parser.add_argument("--hybrid-contexts", default="1024,4096,8192", help="contexts of the hybrid rows ('' none)")
    parser.add_argument("--hybrid-memory", type=int, default=2 * 2**30, help="KV bytes of the hybrid concurrency")
    parser.add_argument("--quick", action="store_true", help="300 requests")
    parser.add_argument("--smoke", action="store_true", help="100 blocks, 40 requests; writes nothing by default")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {RESULTS}; none in --smoke)")
    ns = parser.parse_args(argv)
    if ns.quick:
        ns.requests = 300
    if ns.smoke:
        ns.num_blocks = 100
        ns.max_context = 512
        ns.requests = 40
        ns.gen_tokens = 40
        ns.hybrid_contexts = "256,1024"
        ns.hybrid_memory = 64 * 2**20
    beam = (
        {
            "model": ns.beam_model,
            "widths": [2, 4, 8],
            "prompts": 3,
            "gen_tokens": [int(n) for n in ns.beam_tokens.split(",")],
        }
        if ns.beam_model
        else None
    )
    if ns.smoke and beam is not None:
        beam.update(widths=[2], prompts=1, gen_tokens=[8])
    hybrid = None
    if ns.hybrid_contexts:
        contexts = [int(n) for n in ns.hybrid_contexts.split(",")]
        hybrid = {"contexts": contexts, "memory": ns.hybrid_memory, "block_size": ns.block_size, "chunk": 512}
    result = run(
        ns.num_blocks, ns.block_size, ns.max_context, ns.mean_len, ns.requests, ns.seed, ns.gen_tokens, beam, hybrid
    )
    print(json.dumps(result, indent=1))
    path = output_path(ns.out, ns.smoke, RESULTS)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        plot(result, path.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
