"""Hierarchical KV cache: what the host tier buys when a multi-turn chat's KV overflows the device pool.

Workload (fixed, seeded; float32 so greedy outputs can be compared token for token): `--conversations` chats of
`--turns` turns. Every chat starts with the same short system prompt (`--system-tokens`) and a long first user
message of its own (`--first-user-tokens`: background text, a pasted document), later user turns are short
(`--user-tokens`), replies are greedy and exactly `--max-tokens` tokens (ignore_eos). Each turn's prompt is the
previous prompt + its reply + the next user message, as token ids in SmolLM2's ChatML format, so every turn can reuse
its whole history. Arrival order is fixed and one request runs at a time: turn t of every chat, round robin, then
turn t + 1. The device pool is a quarter of the KV working set (the full blocks of every chat's final history): while
the other chats take their turns, a chat's history is evicted by LRU before its next turn, so the device pool alone
keeps little more than the shared system prompt; that is the pressure (device_only's hit rate falls well below the
unlimited pool's, the JSON's `pressure` says by how much).

Three configurations of the in-process Engine, measured side by side in one run (each request of the fixed order runs
on the three engines in turn, so a change of machine load hits all three alike; speed figures are still disturbed by
whatever else runs on the machine: compare the ratios):
  device_only     the small pool (num_blocks), no host tier: evicted history is recomputed
  with_host_tier  the same num_blocks plus a host tier holding the whole working set: evicted blocks are written back
                  and loaded back on the next turn
  unlimited       a device pool holding everything
Per configuration: num_blocks, hit_rate (cached prompt tokens / prompt tokens), ttft_p50_late_s (TTFT p50 over turns
>= 2), ttft_p50_first_s, prefill_tokens_computed, loaded_back_blocks, written_back_blocks, evicted_blocks. Top level:
outputs_equal (greedy outputs of with_host_tier == unlimited, every request), the workload, pressure and targets:
with_host_tier's hit rate >= 0.95x unlimited's, late-turn TTFT p50 device_only / with_host_tier >= 2, its prefill
tokens computed <= 1.1x unlimited's, loaded_back_blocks > 0, and device_only pressured (hit rate <= 0.6x unlimited).

    .venv/bin/python -m benchmarks.hicache                 # the default workload -> results/hicache.json
    .venv/bin/python -m benchmarks.hicache --smoke --model <tiny model folder> --out /tmp/hicache.json
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.chat.workload import BACKGROUND, QUESTIONS, SYSTEM_BRIEF, fit_text
from benchmarks.cli import output_path
from radix.blocks import cdiv

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results" / "hicache.json"
CONFIGS = ("device_only", "with_host_tier", "unlimited")
SMOKE = {
    "conversations": 3,
    "turns": 3,
    "system_tokens": 12,
    "first_user_tokens": 24,
    "user_tokens": 6,
    "max_tokens": 3,
    "block_size": 4,
}
USER_OPEN, USER_CLOSE = "<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Config:
    """The benchmark's settings (saved in the JSON); token counts are of the message text before the template."""

    model: str = "smollm2"
    conversations: int = 8
    turns: int = 4
    system_tokens: int = 64
    first_user_tokens: int = 256
    user_tokens: int = 48
    max_tokens: int = 16
    block_size: int = 16
    seed: int = 0
    pool_fraction: float = 0.25  # device pool / KV working set


def build_turns(tokenizer: Any, cfg: Config) -> list[list[list[int]]]:
    """turns[c][t]: the token ids that turn t of chat c adds after the history (the whole templated prompt for t = 0:
    system + first user message + the assistant header; later: end of reply, user message, assistant header)."""
    from runtime.text.prompt import apply_chat_template

    rng = random.Random(cfg.seed)
    system = fit_text(tokenizer, SYSTEM_BRIEF, cfg.system_tokens, None)
    out = []
    for _ in range(cfg.conversations):
        row = []
        for t in range(cfg.turns):
            size = cfg.first_user_tokens if t == 0 else cfg.user_tokens
            text = fit_text(tokenizer, BACKGROUND, size, rng, tail=rng.choice(QUESTIONS))
            if t == 0:
                row.append(
                    apply_chat_template(
                        tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": text}]
                    )
                )
            else:
                row.append(tokenizer.encode(USER_OPEN + text + USER_CLOSE, add_special_tokens=False))
        out.append(row)
    return out


def pool_sizes(turns: list[list[list[int]]], cfg: Config) -> dict[str, int]:
    """Device blocks of each configuration and the host tier's blocks, from the exact final history lengths (every
    reply has max_tokens tokens). working_set_blocks: full blocks of all final histories together."""
    bs = cfg.block_size
    finals = [sum(len(ids) for ids in row) + cfg.turns * cfg.max_tokens for row in turns]
    working_set = sum(n // bs for n in finals)
    largest = max(cdiv(n, bs) for n in finals)  # the longest request's blocks (prompt + reply)
    small = max(int(working_set * cfg.pool_fraction) + 1, largest + 2)
    return {
        "working_set_blocks": working_set,
        "largest_request_blocks": largest,
        "device_only": small,
        "with_host_tier": small,
        "unlimited": working_set + 2 * largest + 1,
        "host_cache_blocks": working_set + largest,
    }


def run(cfg: Config) -> dict[str, Any]:
    """Runs the workload on the three configurations side by side; returns the result dict (see the module doc)."""
    from runtime.engine import Engine
    from runtime.model.cpu_features import machine_facts
    from runtime.model.loader import load_tokenizer
    from runtime.sampling_params import SamplingParams

    tokenizer = load_tokenizer(cfg.model)
    turns = build_turns(tokenizer, cfg)
    sizes = pool_sizes(turns, cfg)
    common = {"model": cfg.model, "dtype": "float32", "block_size": cfg.block_size}
    engines = {
        name: Engine(
            num_blocks=sizes[name],
            num_host_cache_blocks=sizes["host_cache_blocks"] if name == "with_host_tier" else 0,
            **common,
        )
        for name in CONFIGS
    }
    greedy = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True)
    history = {name: [[] for _ in range(cfg.conversations)] for name in CONFIGS}
    trace: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    start = time.perf_counter()
    for t in range(cfg.turns):
        for c in range(cfg.conversations):
            for name, engine in engines.items():
                prompt = history[name][c] + turns[c][t]
                res = engine.generate(input_ids=[prompt], sampling_params=greedy)[0]
                trace[name].append(
                    {
                        "conv": c,
                        "turn": t + 1,
                        "prompt_tokens": len(prompt),
                        "ttft_s": res.ttft_s,
                        "cached_tokens": res.usage.cached_tokens,
                        "host_cached_tokens": res.usage.host_cached_tokens,
                        "output": res.token_ids,
                    }
                )
                history[name][c] = prompt + res.token_ids
        logger.info("turn %d of %d done after %.0f s", t + 1, cfg.turns, time.perf_counter() - start)
    result: dict[str, Any] = {name: summarize(engines[name], trace[name], sizes[name]) for name in CONFIGS}
    result["outputs_equal"] = [r["output"] for r in trace["with_host_tier"]] == [
        r["output"] for r in trace["unlimited"]
    ]
    result["device_only_outputs_equal"] = [r["output"] for r in trace["device_only"]] == [
        r["output"] for r in trace["unlimited"]
    ]
    result["targets"] = targets(result)
    result["pressure"] = {
        "working_set_blocks": sizes["working_set_blocks"],
        "device_pool_blocks": sizes["device_only"] - 1,
        "working_set_over_pool": round(sizes["working_set_blocks"] / (sizes["device_only"] - 1), 2),
        "host_cache_blocks": sizes["host_cache_blocks"],
        "device_only_hit_rate_over_unlimited": result["targets"]["device_only_pressured"]["value"],
    }
    result["config"] = asdict(cfg)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    result["machine"] = machine_facts()
    result["trace"] = {name: [{k: v for k, v in r.items() if k != "output"} for r in trace[name]] for name in CONFIGS}
    return result


def summarize(engine: Any, trace: list[dict[str, Any]], num_blocks: int) -> dict[str, Any]:
    """One configuration's figures from its Engine's ServerStats and its requests' TTFTs."""
    stats = engine.stats()
    late = [r["ttft_s"] for r in trace if r["turn"] >= 2]
    first = [r["ttft_s"] for r in trace if r["turn"] == 1]
    return {
        "num_blocks": num_blocks,
        "num_host_cache_blocks": stats.num_host_cache_blocks,
        "hit_rate": round(stats.hit_rate, 4),
        "ttft_p50_late_s": round(statistics.median(late), 4),
        "ttft_p50_first_s": round(statistics.median(first), 4),
        "prefill_tokens_computed": stats.prefill_tokens_computed,
        "loaded_back_blocks": stats.num_loaded_back_blocks,
        "written_back_blocks": stats.num_written_back_blocks,
        "evicted_blocks": stats.num_evicted_blocks,
        "host_cached_tokens": stats.host_cached_tokens,
        "prompt_tokens": stats.prompt_tokens,
        "cached_tokens": stats.cached_tokens,
    }


def targets(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The issue's targets, each with its value and whether it is met."""
    dev, tier, unl = r["device_only"], r["with_host_tier"], r["unlimited"]

    def ratio(a: float, b: float) -> float:
        return round(a / b, 3) if b else float("inf")

    checks = {
        "hit_rate_vs_unlimited": (ratio(tier["hit_rate"], unl["hit_rate"]), ">= 0.95", lambda v: v >= 0.95),
        "late_ttft_p50_device_only_over_tier": (
            ratio(dev["ttft_p50_late_s"], tier["ttft_p50_late_s"]),
            ">= 2",
            lambda v: v >= 2,
        ),
        "prefill_tokens_vs_unlimited": (
            ratio(tier["prefill_tokens_computed"], unl["prefill_tokens_computed"]),
            "<= 1.1",
            lambda v: v <= 1.1,
        ),
        "loaded_back_blocks": (tier["loaded_back_blocks"], "> 0", lambda v: v > 0),
        "device_only_pressured": (ratio(dev["hit_rate"], unl["hit_rate"]), "<= 0.6", lambda v: v <= 0.6),
        "outputs_equal": (r["outputs_equal"], "true", bool),
    }
    return {name: {"value": v, "target": t, "met": bool(ok(v))} for name, (v, t, ok) in checks.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Config()
    for name, value in asdict(defaults).items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=type(value),
            default=None,
            help=f"default {value} (--smoke: {SMOKE.get(name, value)})",
        )
    parser.add_argument("--smoke", action="store_true", help="a few seconds on a small workload; writes only --out")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {RESULTS}; none in --smoke)")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    base = {**asdict(defaults), **(SMOKE if ns.smoke else {})}
    cfg = Config(**{k: getattr(ns, k) if getattr(ns, k) is not None else v for k, v in base.items()})
    result = run(cfg)
    summary = {k: result[k] for k in (*CONFIGS, "outputs_equal", "pressure", "targets", "wall_s")}
    print(json.dumps(summary, indent=1))
    path = output_path(ns.out, ns.smoke, RESULTS)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
