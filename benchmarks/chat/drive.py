"""Driving conversations: each turn's request holds the whole history with the model's real previous answers, and
cfg.concurrency conversations are in flight at once, each running its turns one after the other."""

from __future__ import annotations

import asyncio
import collections
import time

from benchmarks.chat.config import Config
from benchmarks.chat.trace import Record
from benchmarks.chat.workload import ChatWorkload


def new_history(wl: ChatWorkload) -> list[dict[str, str]]:
    """A new conversation: the shared system message."""
    return [{"role": "system", "content": wl.system_prompt}]


async def drive_async(wl: ChatWorkload, cfg: Config, send, bar) -> list[Record]:
    """Runs the conversations with cfg.concurrency in flight; send(messages) is a coroutine returning a Reply."""
    todo = collections.deque(range(cfg.conversations))
    records: list[Record] = []

    async def worker() -> None:
        while todo:
            conv = todo.popleft()
            history = new_history(wl)
            for turn in range(cfg.turns):
                history.append({"role": "user", "content": wl.user_turns[conv][turn]})
                t0 = time.perf_counter()
                reply = await send(list(history))
                records.append(Record(conv, turn + 1, t0, list(history), reply))
                history.append({"role": "assistant", "content": reply.text})
                bar.update()

    await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, cfg.conversations))))
    return records
