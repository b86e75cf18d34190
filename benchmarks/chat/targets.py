"""The in-tree targets of the multi-turn chat benchmark: our server (through runtime.client, through its HTTP API, or
N replicas behind router/), the in-process Engine, and transformers' generate."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Iterator
from typing import Any, cast

from benchmarks.chat.config import BenchmarkError, Config
from benchmarks.chat.drive import drive_async, new_history
from benchmarks.chat.openai_client import run_openai
from benchmarks.chat.trace import Record, Reply
from benchmarks.chat.workload import ChatWorkload
from runtime.text.prompt import apply_chat_template


@contextlib.contextmanager
def launch_radixserve(
    cfg: Config, caching: bool = True, http: bool = False, router: tuple[str, int] | None = None
) -> Iterator[Any]:
    """Our server (worker, scheduler, tokenizer processes; the HTTP server too when http), or `router` = (policy,
    replicas) replicas behind router/, started for the with block and shut down after it, error or not. Yields the
    launcher (.endpoint, .http_url). Raises BenchmarkError when it does not start."""
    from router.launch import RouterLauncher
    from runtime.serve.launch import Launcher, LaunchError

    args = cfg.server_args(caching, http)
    launcher = Launcher(args) if router is None else RouterLauncher(args, replicas=router[1], policy=router[0])
    try:
        launcher.start()
    except LaunchError as e:
        launcher.shutdown("start-up failed")
        raise BenchmarkError(f"radixserve did not start: {e}") from e
    try:
        yield launcher
    finally:
        launcher.shutdown("benchmark finished")


def run_radixserve(
    cfg: Config,
    wl: ChatWorkload,
    caching: bool,
    bar,
    router: tuple[str, int] | None = None,
    http: bool = False,
    tokenizer: Any = None,
) -> list[Record]:
    """Launches our server (launch_radixserve) and drives it through runtime.client.AsyncClient; http: through its
    HTTP server instead, with the openai SDK or (cfg.http_client == "stdlib") run_openai's client (tokenizer
    re-encodes the replies' text into output_ids)."""
    with launch_radixserve(cfg, caching, http, router) as launcher:
        if http and cfg.http_client == "stdlib":
            return run_openai(cfg, wl, launcher.http_url, tokenizer, bar)
        if http:
            return asyncio.run(_drive_http(cfg, wl, launcher.http_url, tokenizer, bar))
        return asyncio.run(_drive_zmq(cfg, wl, launcher.endpoint, bar))


async def _drive_zmq(cfg: Config, wl: ChatWorkload, endpoint: str, bar) -> list[Record]:
    """The conversations through runtime.client.AsyncClient (one client, every request streamed)."""
    from runtime.client import AsyncClient

    async with AsyncClient(endpoint, timeout=600.0) as client:

        async def send(messages: list[dict[str, str]]) -> Reply:
            first = None
            ids: list[int] = []
            text = ""
            usage = None
            reason = None
            async for chunk in client.stream(messages=messages, max_tokens=cfg.max_tokens, temperature=0.0):
                if first is None and chunk.token_ids:
                    first = time.perf_counter()
                ids.extend(chunk.token_ids)
                text += chunk.text
                if chunk.finish_reason is not None:
                    usage = chunk.usage
                    reason = chunk.finish_reason
            return Reply(
                first,
                time.perf_counter(),
                ids,
                text,
                reason,
                usage and usage.prompt_tokens,
                usage and usage.cached_tokens,
            )

        await client.generate(messages=[{"role": "user", "content": "Say hello."}], max_tokens=2)  # warm-up
        return await drive_async(wl, cfg, send, bar)


async def _drive_http(cfg: Config, wl: ChatWorkload, url: str, tokenizer: Any, bar) -> list[Record]:
    """The conversations through the openai SDK's AsyncOpenAI (one client, every request streamed with
    include_usage): TTFT at the first content delta, token counts from usage."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=600.0, max_retries=0) as client:

        async def send(messages: list[dict[str, str]]) -> Reply:
            first = None
            text = ""
            usage = None
            reason = None
            stream = await client.chat.completions.create(
                model=cfg.model,
                messages=cast(Any, messages),
                max_tokens=cfg.max_tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.delta.content:
                        first = first or time.perf_counter()
                        text += choice.delta.content
                    reason = choice.finish_reason or reason
                usage = chunk.usage or usage
            t_end = time.perf_counter()
            if usage is None:
                raise BenchmarkError(f"{url}: a stream without usage")
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else None
            return Reply(first, t_end, ids, text, reason, usage.prompt_tokens, cached, usage.completion_tokens)

        await client.chat.completions.create(
            model=cfg.model,
            max_tokens=2,  # warm-up
            messages=[{"role": "user", "content": "Say hello."}],
        )
        return await drive_async(wl, cfg, send, bar)


def run_engine(cfg: Config, wl: ChatWorkload, bar) -> list[Record]:
    """The in-process Engine: conversations are added with Engine.add_request and driven by Engine.step()."""
    from runtime.engine import Engine
    from runtime.sampling_params import SamplingParams

    engine = Engine(
        model=cfg.model,
        block_size=cfg.block_size,
        num_blocks=cfg.num_blocks,
        log_interval_s=3600.0,
        dtype=cfg.dtype,
        quantization=cfg.quantization,
    )
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0)
    engine.generate(
        messages=[[{"role": "user", "content": "Say hello."}]],
        sampling_params=SamplingParams(max_tokens=2, temperature=0.0),
    )  # warm-up
    todo = collections.deque(range(cfg.conversations))
    records = []
    live: dict[str, list[Any]] = {}  # rid -> [conv, turn, t_submit, t_first, messages]

    def submit(conv: int, turn: int, history: list[dict[str, str]]) -> None:
        rid = engine.add_request(messages=list(history), sampling_params=params)
        live[rid] = [conv, turn, time.perf_counter(), None, list(history)]

    histories: dict[int, list[dict[str, str]]] = {}
    while todo or live:
        while todo and len(live) < cfg.concurrency:
            conv = todo.popleft()
            histories[conv] = new_history(wl) + [{"role": "user", "content": wl.user_turns[conv][0]}]
            submit(conv, 1, histories[conv])
        for chunk in engine.step():
            state = live.get(chunk.rid)
            if state is None:
                continue
            now = time.perf_counter()
            if state[3] is None and chunk.token_ids:
                state[3] = now
            if chunk.finish_reason is None:
                continue
            del live[chunk.rid]
            out = engine.result(chunk.rid)
            conv, turn, t0, first, messages = state
            records.append(
                Record(
                    conv,
                    turn,
                    t0,
                    messages,
                    Reply(
                        first,
                        now,
                        list(out.token_ids),
                        out.text,
                        out.finish_reason,
                        out.usage.prompt_tokens,
                        out.usage.cached_tokens,
                    ),
                )
            )
            bar.update()
            histories[conv].append({"role": "assistant", "content": out.text})
            if turn < cfg.turns:
                histories[conv].append({"role": "user", "content": wl.user_turns[conv][turn]})
                submit(conv, turn + 1, histories[conv])
    engine.shutdown()
    return records


def run_transformers(cfg: Config, wl: ChatWorkload, tokenizer: Any, bar) -> list[Record]:
    """transformers' generate (greedy, its own KV cache per request, none across requests), one request at a time."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from runtime.model.loader import resolve_model

    class FirstToken(BaseStreamer):
        def __init__(self) -> None:
            self.calls = 0
            self.t_first: float | None = None

        def put(self, value: Any) -> None:  # first call: the prompt; second: the first new token
            self.calls += 1
            if self.calls == 2:
                self.t_first = time.perf_counter()

        def end(self) -> None:
            pass

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(cfg.model)), dtype=torch.float32).eval()
    records = []
    for conv in range(cfg.conversations):
        history = new_history(wl)
        for turn in range(cfg.turns):
            history.append({"role": "user", "content": wl.user_turns[conv][turn]})
            ids = apply_chat_template(tokenizer, history)
            streamer = FirstToken()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=cfg.max_tokens,
                    do_sample=False,
                    streamer=streamer,
                    pad_token_id=tokenizer.eos_token_id,
                )
            new = out[0, len(ids) :].tolist()
            text = tokenizer.decode(new, skip_special_tokens=True)
            reason = "length" if len(new) >= cfg.max_tokens else "stop"
            reply = Reply(streamer.t_first, time.perf_counter(), new, text, reason, len(ids), 0)
            records.append(Record(conv, turn + 1, t0, list(history), reply))
            history.append({"role": "assistant", "content": text})
            bar.update()
    return records
