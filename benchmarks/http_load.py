"""HTTP load: many concurrent streaming clients of the OpenAI API for minutes; nothing may fail, every block comes back.

The benchmark starts a server in process (runtime.serve.launch.Launcher with http_port=0: worker, scheduler, tokenizer
and the HTTP server) and measures, in order:

1. Idle TTFT overhead: `--idle-requests` short streamed requests one at a time, alternating between the ZeroMQ
   AsyncClient, the HTTP API through the openai SDK and the HTTP API through a bare http.client connection (the
   server's overhead without the SDK's), nothing else running; TTFT p50 of each and the differences (the issue's
   target: HTTP <= ZeroMQ + 3 ms).
2. Load: `--clients` clients, each its own openai.AsyncOpenAI (its own connections), for `--minutes` minutes. Each
   runs conversations of `--turns` turns after one shared system prompt (benchmarks/chat/workload.py text), every
   request streamed with stream_options.include_usage, max_tokens drawn from `--max-tokens LO:HI`, greedy or seeded
   sampling (half each); `--cancel-fraction` of the streams are closed by the client after a drawn number of chunks
   (an HTTP disconnect: the server aborts the request). Each finished stream is checked
   (benchmarks.load.outcome.check_output): finish reason stop / length, usage present, completion_tokens <=
   max_tokens, cached_tokens <= prompt_tokens, prompt_tokens == the chat template's length. An exception is an error
   (counted by type).
3. The end: once the server is idle, its stats (every block back: num_used_blocks == 0) and a /metrics scrape
   (request_success_total counts the completed streams plus the idle phase's HTTP requests, and at most the
   aborted streams more).

Targets: 0 errors, 0 bad outputs, 0 blocks in use at the end, completed + aborted == requests, /metrics agrees;
TTFT p50 / p99 under load and the idle overhead are reported.

    .venv/bin/python -m benchmarks.http_load                                  # 64 clients, 2 minutes
    .venv/bin/python -m benchmarks.http_load --clients 0 --idle-requests 100 \
        --out benchmarks/results/http_ttft_idle.json                          # the idle TTFT comparison only
    .venv/bin/python -m benchmarks.http_load --smoke --out /tmp/http_load.json  # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import random
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.chat.workload import ChatWorkload, build_workload
from benchmarks.cli import apply_preset, output_path
from benchmarks.load import outcome
from benchmarks.load.idle_ttft import idle_ttft
from benchmarks.load.outcome import check_output, pct, token_range
from benchmarks.load.probes import wait_idle

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results" / "http_load.json"
SMOKE = {
    "clients": 4,
    "minutes": 0.1,
    "turns": 2,
    "system_prompt_tokens": 32,
    "user_tokens": "8:16",
    "max_tokens": "4:12",
    "idle_requests": 4,
}


@dataclass
class Config:
    """The run's settings (saved in the JSON). Token ranges are "LO:HI" (uniform, inclusive)."""

    model: str = "smollm2"
    clients: int = 64
    minutes: float = 2.0
    turns: int = 4
    system_prompt_tokens: int = 96
    user_tokens: str = "16:48"
    max_tokens: str = "16:64"
    cancel_fraction: float = 0.1
    idle_requests: int = 20
    num_blocks: int | None = None
    max_model_len: int = 2048
    seed: int = 0


@dataclass
class Tally(outcome.Tally):
    """The soak's tally (what the load clients saw) plus the finish reasons, which /metrics is checked against."""

    finish_reasons: collections.Counter = field(default_factory=collections.Counter)


async def http_turn(
    client: Any,
    model: str,
    messages: list[dict[str, str]],
    cfg: Config,
    rng: random.Random,
    tokenizer: Any,
    tally: Tally,
) -> str | None:
    """Streams one chat request through the openai SDK and tallies it. Returns the reply text to append to the
    history (None: end the conversation: an error, or nothing to append)."""
    from runtime.text.prompt import apply_chat_template

    max_tokens = rng.randint(*token_range(cfg.max_tokens))
    params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0}
    if rng.random() < 0.5:
        params.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31))
    cancel_at = rng.randint(1, max(1, max_tokens - 1)) if rng.random() < cfg.cancel_fraction else None
    tally.requests += 1
    t0 = time.perf_counter()
    first = None
    text = ""
    finish = None
    usage = None
    chunks = 0
    cancelled = False
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, stream=True, stream_options={"include_usage": True}, **params
        )
        async with stream:  # leaving early closes the connection: the server aborts the request
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content:
                        first = first or time.perf_counter()
                        text += choice.delta.content
                        chunks += 1
                    finish = choice.finish_reason or finish
                usage = chunk.usage or usage
                if cancel_at is not None and finish is None and chunks >= cancel_at:
                    cancelled = True
                    break
    except Exception as exc:  # every failure is a finding: count it by type and go on
        tally.errors[type(exc).__name__] += 1
        logger.warning("request failed: %s: %s", type(exc).__name__, exc)
        return None
    if cancelled:
        tally.aborted += 1
        return text or None
    tally.completed += 1
    tally.finish_reasons[finish] += 1
    tally.ttft_s.append((first or time.perf_counter()) - t0)
    tally.latency_s.append(time.perf_counter() - t0)
    prompt_len = len(apply_chat_template(tokenizer, messages))
    n_out = usage.completion_tokens if usage is not None else 0
    counts = _Usage.of(usage)
    for problem in check_output(finish, counts, n_out, max_tokens, prompt_len, cfg.max_model_len):
        tally.bad_outputs[problem] += 1
        logger.warning(
            "bad output (%s): finish %s usage %s, max_tokens %d, prompt %d",
            problem,
            finish,
            usage,
            max_tokens,
            prompt_len,
        )
    return text or None


@dataclass
class _Usage:
    """An OpenAI usage object in the shape benchmarks.load.outcome.check_output reads."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @staticmethod
    def of(usage: Any) -> _Usage | None:
        if usage is None:
            return None
        details = usage.prompt_tokens_details
        cached = details.cached_tokens if details is not None and details.cached_tokens is not None else -1
        return _Usage(usage.prompt_tokens, cached, usage.completion_tokens)


async def client_loop(
    cid: int, url: str, model: str, cfg: Config, wl: ChatWorkload, tokenizer: Any, tally: Tally, deadline: float
) -> None:
    """One client (its own AsyncOpenAI): conversations of cfg.turns turns until the deadline (the turn in flight
    then finishes)."""
    from openai import AsyncOpenAI

    rng = random.Random(cfg.seed * 1_000_003 + cid)
    conv = cid
    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=300.0, max_retries=0) as client:
        while time.monotonic() < deadline:
            history = [{"role": "system", "content": wl.system_prompt}]
            row = wl.user_turns[conv % len(wl.user_turns)]
            for turn in range(cfg.turns):
                if time.monotonic() >= deadline:
                    break
                prefix = f"Ticket {conv}. " if turn == 0 else ""  # conversations differ after the system prompt
                history.append({"role": "user", "content": prefix + row[turn]})
                reply = await http_turn(client, model, list(history), cfg, rng, tokenizer, tally)
                if reply is None:
                    break
                history.append({"role": "assistant", "content": reply})
            conv += cfg.clients


def scrape_success(url: str, model: str) -> dict[str, float]:
    """request_success_total by finish_reason from GET url/metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "radixserve:request_success_total" and s.labels.get("model_name") == model:
                out[s.labels["finish_reason"]] = s.value
    return out


def evaluate(result: dict[str, Any]) -> dict[str, Any]:
    """The targets, each {"value": ..., "met": bool}."""
    success = result["metrics_request_success"]
    served = success.get("stop", 0) + success.get("length", 0)
    # + the idle phase's HTTP requests: requests_each + 1 rounds (the first warms up) of two HTTP paths (the openai
    # SDK and a bare http.client); its ZeroMQ requests do not reach the HTTP server's counters
    expected = result["completed"] + 2 * (result["idle"]["requests_each"] + 1)
    # a stream the client closed just as the server finished it is counted by the server, not by the client
    return {
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
        "completed + idle <= request_success_total{stop, length} <= that + aborted": {
            "value": served,
            "met": expected <= served <= expected + result["aborted"],
        },
    }


def run(cfg: Config) -> dict[str, Any]:
    """Starts the server, runs the idle phase and the load, shuts the server down; returns the JSON-ready result."""
    from runtime.config import ServerArgs
    from runtime.model.loader import load_tokenizer
    from runtime.serve.launch import Launcher

    tokenizer = load_tokenizer(cfg.model)
    lo, hi = token_range(cfg.user_tokens)
    wl = build_workload(tokenizer, max(cfg.clients, 8), cfg.turns, cfg.system_prompt_tokens, lo, hi, cfg.seed)
    args = ServerArgs(
        model=cfg.model,
        port=0,
        http_port=0,
        num_blocks=cfg.num_blocks,
        max_model_len=cfg.max_model_len,
        seed=cfg.seed,
        log_interval_s=3600.0,
    )
    launcher = Launcher(args)
    load = [os.getloadavg()]
    tally = Tally()
    try:
        endpoint = launcher.start()
        url = launcher.http_url
        model = cfg.model

        async def main() -> tuple[dict[str, Any], dict[str, Any], float]:
            idle = await idle_ttft(endpoint, url, model, cfg.idle_requests)
            t0 = time.monotonic()
            await asyncio.gather(
                *(
                    client_loop(c, url, model, cfg, wl, tokenizer, tally, t0 + cfg.minutes * 60)
                    for c in range(cfg.clients)
                )
            )
            wall = time.monotonic() - t0
            return idle, await wait_idle(endpoint), wall

        idle, final_stats, wall_s = asyncio.run(main())
        success = scrape_success(url, model)
    finally:
        load.append(os.getloadavg())
        launcher.shutdown("http load finished")
    result: dict[str, Any] = {
        **tally.summary(),
        "finish_reasons": dict(tally.finish_reasons),
        "wall_s": round(wall_s, 1),
        "ttft_p90_s": pct(tally.ttft_s, 90),
        "idle": idle,
        "final_stats": final_stats,
        "metrics_request_success": success,
        "config": asdict(cfg),
        "machine": {**_machine_facts(), "load_avg_start": load[0], "load_avg_end": load[1]},
    }
    result["targets"] = evaluate(result)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Config()
    parser.add_argument("--model", default=d.model, help="embedded name, Hugging Face folder or .gguf file")
    parser.add_argument("--clients", type=int, default=d.clients, help="concurrent HTTP clients")
    parser.add_argument("--minutes", type=float, default=d.minutes, help="how long clients start new requests")
    parser.add_argument("--turns", type=int, default=d.turns, help="turns per conversation")
    parser.add_argument("--system-prompt-tokens", type=int, default=d.system_prompt_tokens)
    parser.add_argument("--user-tokens", default=d.user_tokens, help="LO:HI tokens per user turn")
    parser.add_argument("--max-tokens", default=d.max_tokens, help="LO:HI max_tokens per request")
    parser.add_argument("--cancel-fraction", type=float, default=d.cancel_fraction, help="streams closed early")
    parser.add_argument("--idle-requests", type=int, default=d.idle_requests, help="idle TTFT requests per path")
    parser.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV blocks (default: memory budget)")
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len, help="the server's context limit")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE}; writes nothing unless --out is given")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {RESULTS})")
    ns = parser.parse_args(argv)
    if ns.smoke:
        apply_preset(parser, ns, SMOKE)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("RADIXSERVE_LOG_LEVEL", "WARNING")  # the server's children: warnings and errors only
    cfg = Config(**{k: v for k, v in vars(ns).items() if k not in ("smoke", "out")})
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
                    "idle",
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
