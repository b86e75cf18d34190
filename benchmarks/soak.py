"""Soak: many concurrent multi-turn chat clients for minutes; nothing may fail, leak blocks or grow memory.

The benchmark starts a server in process (runtime.serve.launch.Launcher, so it knows the children's pids) and runs
`--clients` clients, each its own runtime.client.AsyncClient (its own DEALER socket), for `--minutes` minutes. Each
client runs conversations of `--turns` turns after one shared system prompt (benchmarks/chat/workload.py text); each
turn's request holds the whole history with the previous replies, so the radix cache hits. Every request streams a
reply of max_tokens drawn from `--max-tokens LO:HI`, greedy or seeded sampling (half each); `--cancel-fraction` of
the streams are cancelled after a drawn number of tokens (the client leaves: AbortRequest). Every
`--sample-interval-s` seconds it reads each server process's RSS (/proc/<pid>/status VmRSS) and the server's stats.

Each finished stream is checked against its tokens (check_output): a finish reason other than stop / length, usage
missing, completion_tokens != len(token_ids) or > max_tokens, "length" below max_tokens without the context being
full, cached_tokens > prompt_tokens, prompt_tokens != the chat template's length. Those are bad outputs; an exception
(error type) is an error. After the last client stops, it waits for the server to go idle and takes final stats.

Targets: 0 errors, 0 bad outputs, 0 blocks in use at the end, completed + aborted == requests, RSS of scheduler and
tokenizer within +5% between minute 2 and the end and the worker flat (+5%) after warm-up: the RSS targets apply to
runs of 5 minutes or more (shorter runs report the growth since the first third of the run, unjudged).

    .venv/bin/python -m benchmarks.soak                                    # 64 clients, 10 minutes, default pool
    .venv/bin/python -m benchmarks.soak --num-blocks 64 --preemption-mode swap --num-host-blocks 256
    .venv/bin/python -m benchmarks.soak --quick --out /tmp/soak_quick.json  # 32 clients, 2 minutes
    .venv/bin/python -m benchmarks.soak --smoke --out /tmp/soak.json        # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from benchmarks.chat.workload import ChatWorkload, build_workload
from benchmarks.cli import apply_preset, output_path
from benchmarks.load.outcome import Tally, check_output, token_range
from benchmarks.load.probes import read_rss_kb, sample, wait_idle

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results" / "soak.json"
QUICK = {"clients": 32, "minutes": 2.0, "max_tokens": "16:64"}
SMOKE = {
    "clients": 4,
    "minutes": 0.1,
    "turns": 2,
    "system_prompt_tokens": 32,
    "user_tokens": "8:16",
    "max_tokens": "4:12",
    "sample_interval_s": 1.0,
}
RSS_ROLES = ("worker", "scheduler", "tokenizer")
RSS_JUDGED_S = 300.0  # the RSS targets apply to runs of at least 5 minutes, measured from minute 2
RSS_FROM_S = 120.0
RSS_TOLERANCE = 0.05


@dataclass
class Config:
    """The soak's settings (saved in the JSON). Token ranges are "LO:HI" (uniform, inclusive)."""

    model: str = "smollm2"
    clients: int = 64
    minutes: float = 10.0
    turns: int = 4
    system_prompt_tokens: int = 96
    user_tokens: str = "16:48"
    max_tokens: str = "16:64"
    cancel_fraction: float = 0.2
    num_blocks: int | None = None
    num_host_blocks: int = 0
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    max_model_len: int = 2048
    sample_interval_s: float = 15.0
    seed: int = 0


async def one_turn(
    client: Any, messages: list[dict[str, str]], cfg: Config, rng: random.Random, tokenizer: Any, tally: Tally
) -> str | None:
    """Streams one request and tallies it. Returns the reply text to append to the history (None: end the
    conversation: an error, or nothing to append)."""
    from runtime.text.prompt import apply_chat_template

    max_tokens = rng.randint(*token_range(cfg.max_tokens))
    params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0}
    if rng.random() < 0.5:
        params.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31))
    cancel_at = rng.randint(1, max(1, max_tokens - 1)) if rng.random() < cfg.cancel_fraction else None
    tally.requests += 1
    t0 = time.perf_counter()
    first = None
    ids = 0
    text = ""
    last = None
    try:
        async with contextlib.aclosing(client.stream(messages=messages, **params)) as chunks:
            async for chunk in chunks:
                if first is None and chunk.token_ids:
                    first = time.perf_counter()
                ids += len(chunk.token_ids)
                text += chunk.text
                if chunk.finish_reason is not None:
                    last = chunk
                elif cancel_at is not None and ids >= cancel_at:
                    break  # aclosing sends the AbortRequest
    except Exception as exc:  # every failure is a finding: count it by type and go on
        tally.errors[type(exc).__name__] += 1
        logger.warning("request failed: %s: %s", type(exc).__name__, exc)
        return None
    if last is None:
        tally.aborted += 1
        return text or None
    tally.completed += 1
    tally.ttft_s.append((first or time.perf_counter()) - t0)
    tally.latency_s.append(time.perf_counter() - t0)
    prompt_len = len(apply_chat_template(tokenizer, messages))
    for problem in check_output(last.finish_reason, last.usage, ids, max_tokens, prompt_len, cfg.max_model_len):
        tally.bad_outputs[problem] += 1
        logger.warning(
            "bad output (%s): finish %s usage %s, %d token ids, max_tokens %d, prompt %d",
            problem,
            last.finish_reason,
            last.usage,
            ids,
            max_tokens,
            prompt_len,
        )
    return text or None


async def client_loop(
    cid: int, endpoint: str, cfg: Config, wl: ChatWorkload, tokenizer: Any, tally: Tally, deadline: float
) -> None:
    """One client: conversations of cfg.turns turns until the deadline (the turn in flight then finishes)."""
    from runtime.client import AsyncClient

    rng = random.Random(cfg.seed * 1_000_003 + cid)
    conv = cid
    async with AsyncClient(endpoint, timeout=300.0) as client:
        while time.monotonic() < deadline:
            history = [{"role": "system", "content": wl.system_prompt}]
            row = wl.user_turns[conv % len(wl.user_turns)]
            for turn in range(cfg.turns):
                if time.monotonic() >= deadline:
                    break
                prefix = f"Ticket {conv}. " if turn == 0 else ""  # conversations differ after the system prompt
                history.append({"role": "user", "content": prefix + row[turn]})
                reply = await one_turn(client, list(history), cfg, rng, tokenizer, tally)
                if reply is None:
                    break
                history.append({"role": "assistant", "content": reply})
            conv += cfg.clients


def rss_growth(series: list[list], from_s: float) -> float | None:
    """Relative RSS growth from the first sample at or after from_s to the last sample (None: too few samples)."""
    points = [(t, kb) for t, kb in series if kb is not None]
    start = next((kb for t, kb in points if t >= from_s), None)
    if start is None or len(points) < 2 or points[-1][0] <= from_s:
        return None
    return points[-1][1] / start - 1.0


def evaluate(result: dict[str, Any], duration_s: float) -> dict[str, Any]:
    """The targets, each {"value": ..., "met": bool | None} (None: not judged for this run's length)."""
    judged = duration_s >= RSS_JUDGED_S
    from_s = RSS_FROM_S if judged else duration_s / 3
    targets: dict[str, Any] = {
        "errors == 0": {"value": sum(result["errors"].values()), "met": not result["errors"]},
        "bad_outputs == 0": {"value": sum(result["bad_outputs"].values()), "met": not result["bad_outputs"]},
        "num_used_blocks == 0 at the end": {
            "value": result["final_stats"]["num_used_blocks"],
            "met": result["final_stats"]["num_used_blocks"] == 0,
        },
        "completed + aborted == requests": {
            "value": result["completed"] + result["aborted"],
            "met": result["completed"] + result["aborted"] == result["requests"],
        },
    }
    for role in RSS_ROLES:
        growth = rss_growth(result["rss_kb"][role], from_s)
        ok = None if not judged or growth is None else growth <= RSS_TOLERANCE
        targets[f"{role} RSS growth from {from_s:.0f} s <= +5%"] = {
            "value": None if growth is None else round(growth, 4),
            "met": ok,
        }
    return targets


def run(cfg: Config) -> dict[str, Any]:
    """Starts the server, runs the soak, shuts the server down; returns the JSON-ready result."""
    from runtime.config import ServerArgs
    from runtime.model.loader import load_tokenizer
    from runtime.serve.launch import Launcher

    tokenizer = load_tokenizer(cfg.model)
    lo, hi = token_range(cfg.user_tokens)
    wl = build_workload(tokenizer, max(cfg.clients, 8), cfg.turns, cfg.system_prompt_tokens, lo, hi, cfg.seed)
    args = ServerArgs(
        model=cfg.model,
        port=0,
        num_blocks=cfg.num_blocks,
        num_host_blocks=cfg.num_host_blocks,
        preemption_mode=cfg.preemption_mode,
        max_model_len=cfg.max_model_len,
        seed=cfg.seed,
        log_interval_s=3600.0,
    )
    launcher = Launcher(args)
    load = [os.getloadavg()]
    try:
        endpoint = launcher.start()
        pids = {role: launcher.procs[role].pid for role in RSS_ROLES}
        tally = Tally()
        rss: dict[str, list] = {role: [] for role in RSS_ROLES}
        stats: list[dict[str, Any]] = []

        async def main() -> dict[str, Any]:
            t_start = time.monotonic()
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample(endpoint, pids, t_start, rss, stats, cfg.sample_interval_s, stop))
            deadline = t_start + cfg.minutes * 60
            await asyncio.gather(
                *(client_loop(c, endpoint, cfg, wl, tokenizer, tally, deadline) for c in range(cfg.clients))
            )
            final = await wait_idle(endpoint)
            stop.set()
            await sampler
            for role, pid in pids.items():
                rss[role].append([round(time.monotonic() - t_start, 1), read_rss_kb(pid)])
            return final

        final_stats = asyncio.run(main())
    finally:
        load.append(os.getloadavg())
        launcher.shutdown("soak finished")
    result: dict[str, Any] = {
        **tally.summary(),
        "rss_kb": rss,
        "final_stats": final_stats,
        "stats_samples": stats,
        "config": asdict(cfg),
        "machine": {**_machine_facts(), "load_avg_start": load[0], "load_avg_end": load[1]},
    }
    result["targets"] = evaluate(result, cfg.minutes * 60)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Config()
    parser.add_argument("--model", default=d.model, help="embedded name, Hugging Face folder or .gguf file")
    parser.add_argument("--clients", type=int, default=d.clients, help="concurrent clients")
    parser.add_argument("--minutes", type=float, default=d.minutes, help="how long clients start new requests")
    parser.add_argument("--turns", type=int, default=d.turns, help="turns per conversation")
    parser.add_argument("--system-prompt-tokens", type=int, default=d.system_prompt_tokens)
    parser.add_argument("--user-tokens", default=d.user_tokens, help="LO:HI tokens per user turn")
    parser.add_argument("--max-tokens", default=d.max_tokens, help="LO:HI max_tokens per request")
    parser.add_argument("--cancel-fraction", type=float, default=d.cancel_fraction, help="streams cancelled")
    parser.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV blocks (default: memory budget)")
    parser.add_argument("--num-host-blocks", type=int, default=d.num_host_blocks, help="host blocks for swap")
    parser.add_argument("--preemption-mode", choices=["recompute", "swap"], default=d.preemption_mode)
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len, help="the server's context limit")
    parser.add_argument("--sample-interval-s", type=float, default=d.sample_interval_s, help="RSS / stats period")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK}")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE}; writes nothing unless --out is given")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {RESULTS})")
    ns = parser.parse_args(argv)
    if ns.smoke:
        apply_preset(parser, ns, SMOKE)
    elif ns.quick:
        apply_preset(parser, ns, QUICK)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("RADIXSERVE_LOG_LEVEL", "WARNING")  # the server's children: warnings and errors only
    cfg = Config(**{k: v for k, v in vars(ns).items() if k not in ("quick", "smoke", "out")})
    for text in (cfg.user_tokens, cfg.max_tokens):
        token_range(text)  # a bad range fails before a server starts
    result = run(cfg)
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "requests",
                    "completed",
                    "aborted",
                    "errors",
                    "bad_outputs",
                    "ttft_p50_s",
                    "ttft_p99_s",
                    "latency_p50_s",
                    "latency_p99_s",
                )
            }
        )
    )
    print(json.dumps(result["targets"], indent=1))
    path = output_path(ns.out, ns.smoke, RESULTS)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()


def _machine_facts() -> dict:
    """runtime.model.cpu_features.machine_facts (imported here: only the benchmark process loads torch)."""
    from runtime.model.cpu_features import machine_facts

    return machine_facts()
