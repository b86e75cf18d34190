"""`make demo`: serve the embedded model, run a multi-turn chat through the client, show what the prefix cache saved.

Launches the server (worker, scheduler, tokenizer processes), then runs several conversations that share one system
prompt, 3 turns each, greedy, streaming each reply; the conversations' turns run side by side through AsyncClient so
the server batches them. Prints the replies and a table of prompt_tokens / cached_tokens / TTFT per turn: later turns
reuse the whole previous exchange, and every first turn but one reuses the system prompt's blocks (the scheduler
holds back a request whose prefix another request is computing right now). Then shuts the server down.

    .venv/bin/python -m runtime.demo                      # the embedded SmolLM2-135M-Instruct
    .venv/bin/python -m runtime.demo --model /path/to/hf_folder --max-tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

from runtime.client import AsyncClient
from runtime.config import ServerArgs
from runtime.protocol import Usage
from runtime.serve.launch import Launcher, LaunchError

SYSTEM_PROMPT = (
    "You are a concise assistant for a small bakery called The Radix Loaf. The bakery opens at 7 am and closes at "
    "6 pm, Tuesday to Sunday; it is closed on Mondays. It sells sourdough, rye, baguettes, croissants and cinnamon "
    "buns, and takes orders for birthday cakes two days in advance. Answer in one or two short sentences, be "
    "friendly, and never invent products the bakery does not sell."
)
CONVERSATIONS = [
    ["When do you open on Saturday?", "And on Monday?", "Thanks! What bread would you suggest for sandwiches?"],
    ["Do you sell croissants?", "Can I order a birthday cake for tomorrow?", "What is the earliest day then?"],
    ["What kinds of bread do you have?", "Which one is the most traditional?", "Great, see you on Sunday."],
    ["Do you have gluten-free bread?", "What about cinnamon buns?", "When do you close today?"],
]


def first_run_note(model: str) -> str | None:
    """A line saying the embedded model will be converted once (tens of seconds), or None when it is cached."""
    from runtime.model.loader import EMBEDDED_MODELS, cache_root

    if model in EMBEDDED_MODELS and not any(cache_root().glob("*/source.json")):
        return f"first run: converting the embedded model {model!r} to safetensors once (tens of seconds)"
    return None


async def _reply(client: AsyncClient, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, Usage, float]:
    """Streams one reply; returns (text, usage, TTFT in seconds)."""
    start, ttft, text = time.perf_counter(), None, ""
    usage: Usage | None = None
    async for chunk in client.stream(messages=messages, max_tokens=max_tokens, temperature=0.0):
        if ttft is None and chunk.token_ids:
            ttft = time.perf_counter() - start
        text += chunk.text
        usage = chunk.usage or usage
    if usage is None:  # the server sets usage on every completion's last chunk
        raise RuntimeError("the stream ended without usage")
    return text, usage, ttft or 0.0


async def chat(endpoint: str, conversations: list[list[str]], max_tokens: int):
    """Runs the conversations side by side, turn by turn (the turn-t requests of all conversations are in flight
    together, so the server batches them), printing the replies.

    Returns (rows (conversation, turn, prompt_tokens, cached_tokens, ttft_s), the server's ServerStats)."""
    histories = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in conversations]
    rows = []
    async with AsyncClient(endpoint, timeout=300.0) as client:
        for turn in range(max(len(c) for c in conversations)):
            active = [i for i, conv in enumerate(conversations) if turn < len(conv)]
            for i in active:
                histories[i].append({"role": "user", "content": conversations[i][turn]})
            replies = await asyncio.gather(*(_reply(client, histories[i], max_tokens) for i in active))
            for i, (text, usage, ttft) in zip(active, replies, strict=True):
                histories[i].append({"role": "assistant", "content": text})
                print(
                    f"[conversation {i + 1}, turn {turn + 1}] user: {conversations[i][turn]}\n"
                    f"  assistant: {text.strip()}",
                    flush=True,
                )
                rows.append((i + 1, turn + 1, usage.prompt_tokens, usage.cached_tokens, ttft))
        stats = await client.stats()
    return rows, stats


def print_table(rows: list[tuple[int, int, int, int, float]]) -> None:
    print(f"\n{'conv':>4} {'turn':>4} {'prompt_tokens':>13} {'cached_tokens':>13} {'TTFT ms':>8}")
    for conv, turn, prompt, cached, ttft in rows:
        print(f"{conv:>4} {turn:>4} {prompt:>13} {cached:>13} {ttft * 1e3:>8.1f}")
    prompt_total, cached_total = sum(r[2] for r in rows), sum(r[3] for r in rows)
    print(
        f"hit rate: {cached_total}/{prompt_total} prompt tokens came from the cache "
        f"({100 * cached_total / max(1, prompt_total):.1f}%)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Multi-turn chat demo of radixserve's prefix cache.")
    parser.add_argument("--model", default="smollm2", help="embedded name, Hugging Face folder or .gguf file")
    parser.add_argument("--conversations", type=int, default=3, help=f"1..{len(CONVERSATIONS)}")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per reply at most")
    parser.add_argument("--num-blocks", type=int, default=512, help="KV blocks of the server")
    parser.add_argument("--port", type=int, default=0, help="public port (0: any free port)")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("RADIXSERVE_LOG_LEVEL", "WARNING")  # the server processes' logging
    note = first_run_note(ns.model)
    if note:
        print(note, flush=True)
    t0 = time.perf_counter()
    launcher = Launcher(ServerArgs(model=ns.model, num_blocks=ns.num_blocks, port=ns.port, log_interval_s=3600.0))
    try:
        endpoint = launcher.start()
    except LaunchError as exc:
        print(f"the server failed to start: {exc}", file=sys.stderr)
        launcher.shutdown("start-up failed")
        return 1
    print(f"server ready at {endpoint} after {time.perf_counter() - t0:.1f} s ({ns.model})\n", flush=True)
    try:
        rows, stats = asyncio.run(chat(endpoint, CONVERSATIONS[: ns.conversations], ns.max_tokens))
        print_table(rows)
        print(
            f"server: {stats.num_cached_blocks} cached blocks ({stats.num_evictable_blocks} evictable), "
            f"{stats.num_free_blocks} free, {stats.num_used_blocks} in use"
        )
    finally:
        launcher.shutdown("demo finished")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
