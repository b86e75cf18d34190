"""The OpenAI-compatible HTTP server in front of a real server, driven by the real openai SDK (sync and async).

Every answer is compared with the ZeroMQ client's answer to the same request, so the HTTP layer must add nothing and
lose nothing: text, finish_reason, usage, n > 1, seeds, stop strings, cached_tokens (logprobs and /tokenize:
test_http_tokens.py). Each comparison runs both sides cold (a fresh cache_salt each), so cached KV cannot change a
logit between them. The `http`, `oai` and `zmq` fixtures (tests/e2e/conftest.py) give each module its own HTTP server
in front of the tiny server.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import openai

from tests.e2e.http_servers import MODEL, assert_idle, msgs, salt

BLOCK = 16


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def usage_tuple(u) -> tuple[int, int, int]:
    return u.prompt_tokens, u.prompt_tokens_details.cached_tokens, u.completion_tokens


def test_models_and_health(http, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert get_json(http.url + "/health") == (200, {"status": "ok"})


def test_chat_equals_the_zeromq_client(oai, zmq, wait_idle):
    messages = msgs("chat equals zeromq")
    r = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0.0, extra_body={"cache_salt": salt()}
    )
    ref = zmq.generate(messages=messages, max_tokens=8, temperature=0.0, cache_salt=salt())
    assert (r.object, r.model, r.id[:9], len(r.choices)) == ("chat.completion", MODEL, "chatcmpl-", 1)
    c = r.choices[0]
    assert (c.index, c.message.role, c.message.content, c.finish_reason) == (
        0,
        "assistant",
        ref.text,
        ref.finish_reason,
    )
    assert usage_tuple(r.usage) == (ref.usage.prompt_tokens, 0, len(ref.token_ids))
    assert r.usage.total_tokens == ref.usage.prompt_tokens + len(ref.token_ids)
    assert_idle(zmq, wait_idle)


def test_completions_from_text_and_from_token_ids(oai, zmq, tiny_llama_dir):
    ref = zmq.generate(prompt="completions from text", max_tokens=6, temperature=0.0, cache_salt=salt())
    r = oai.completions.create(
        model=MODEL, prompt="completions from text", max_tokens=6, temperature=0.0, extra_body={"cache_salt": salt()}
    )
    assert (r.object, r.id[:5], r.choices[0].text, r.choices[0].finish_reason) == (
        "text_completion",
        "cmpl-",
        ref.text,
        ref.finish_reason,
    )
    assert usage_tuple(r.usage) == (ref.usage.prompt_tokens, 0, len(ref.token_ids))
    ids = [500, 501, 502, 503]
    ref = zmq.generate(input_ids=ids, max_tokens=5, temperature=0.0, cache_salt=salt())
    r = oai.completions.create(
        model=str(tiny_llama_dir), prompt=ids, max_tokens=5, temperature=0.0, extra_body={"cache_salt": salt()}
    )  # the model argument is an alias of MODEL
    assert (r.model, r.choices[0].text, usage_tuple(r.usage)) == (MODEL, ref.text, (4, 0, len(ref.token_ids)))


def test_stream_equals_non_stream_and_include_usage(oai, zmq, wait_idle):
    messages = msgs("stream equals non-stream")
    full = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0.0, extra_body={"cache_salt": salt()}
    )
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"cache_salt": salt()},
        )
    )
    *deltas, last = chunks
    assert "".join(ch.choices[0].delta.content or "" for ch in deltas) == full.choices[0].message.content
    assert deltas[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in deltas][-1] == full.choices[0].finish_reason
    assert all(ch.usage is None and ch.object == "chat.completion.chunk" for ch in deltas)
    assert last.choices == []
    assert usage_tuple(last.usage) == usage_tuple(full.usage)
    text_full = oai.completions.create(
        model=MODEL, prompt="stream text", max_tokens=7, temperature=0.0, extra_body={"cache_salt": salt()}
    )
    text_chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt="stream text",
            max_tokens=7,
            temperature=0.0,
            stream=True,
            extra_body={"cache_salt": salt()},
        )
    )
    assert "".join(ch.choices[0].text for ch in text_chunks) == text_full.choices[0].text
    assert all(ch.usage is None for ch in text_chunks)  # no usage chunk unless asked for
    assert_idle(zmq, wait_idle)


def test_n2_and_seeds_reproduce_the_zeromq_client(oai, zmq):
    sampled = {"temperature": 1.0, "top_p": 0.95}
    ref = zmq.generate(messages=msgs("two samples"), n=2, seed=7, max_tokens=6, cache_salt=salt(), **sampled)
    r = oai.chat.completions.create(
        model=MODEL,
        messages=msgs("two samples"),
        n=2,
        seed=7,
        max_tokens=6,
        extra_body={"cache_salt": salt()},
        **sampled,
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == [c.text for c in ref.choices]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert usage_tuple(r.usage) == (ref.usage.prompt_tokens, 0, ref.usage.completion_tokens)
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=msgs("two samples"),
        n=2,
        seed=7,
        max_tokens=6,
        stream=True,
        extra_body={"cache_salt": salt()},
        **sampled,
    )
    texts = ["", ""]
    for ch in stream:
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in r.choices]
    again = oai.chat.completions.create(
        model=MODEL,
        messages=msgs("two samples"),
        n=2,
        seed=7,
        max_tokens=6,
        extra_body={"cache_salt": salt()},
        **sampled,
    )
    other = oai.chat.completions.create(
        model=MODEL,
        messages=msgs("two samples"),
        n=2,
        seed=8,
        max_tokens=6,
        extra_body={"cache_salt": salt()},
        **sampled,
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    assert [c.message.content for c in other.choices] != [c.message.content for c in r.choices]


def test_stop_strings_and_stop_token_ids(oai, zmq):
    full = zmq.generate(prompt="stop strings here", max_tokens=12, temperature=0.0, ignore_eos=True, cache_salt=salt())
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"the greedy text {text!r} has no usable stop string"
    r = oai.completions.create(
        model=MODEL,
        prompt="stop strings here",
        max_tokens=12,
        temperature=0.0,
        stop=stop,
        extra_body={"ignore_eos": True, "cache_salt": salt()},
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text[: text.find(stop)], "stop")
    ref = zmq.generate(
        prompt="stop strings here", max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop], cache_salt=salt()
    )
    assert r.usage.completion_tokens == len(ref.token_ids)
    r = oai.completions.create(
        model=MODEL,
        prompt="stop strings here",
        max_tokens=12,
        temperature=0.0,
        extra_body={"ignore_eos": True, "stop_token_ids": [full.token_ids[2]], "cache_salt": salt()},
    )
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == (
        "stop",
        full.token_ids.index(full.token_ids[2]) + 1,
    )


def test_every_sampling_field_reaches_the_backend(oai, zmq):
    fields = {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "seed": 11,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
        "repetition_penalty": 1.3,
        "ignore_eos": True,
    }
    ref = zmq.generate(messages=msgs("all fields"), max_tokens=8, cache_salt=salt(), **fields)
    plain = zmq.generate(messages=msgs("all fields"), max_tokens=8, seed=11, ignore_eos=True, cache_salt=salt())
    extra = {k: fields[k] for k in ("top_k", "min_p", "repetition_penalty", "ignore_eos")}
    r = oai.chat.completions.create(
        model=MODEL,
        messages=msgs("all fields"),
        max_completion_tokens=8,
        temperature=0.8,
        top_p=0.9,
        seed=11,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        user="someone",
        extra_body={**extra, "cache_salt": salt()},
    )
    assert r.choices[0].message.content == ref.text
    assert ref.text != plain.text  # the fields change the draw, so the equality above says they all arrived
    assert r.usage.completion_tokens == 8


def test_turn2_cached_tokens_equal_the_zeromq_clients(oai, zmq):
    http_salt = salt()
    zmq_salt = salt()
    turn1 = msgs("the first turn of a conversation " * 3)
    r1 = oai.chat.completions.create(
        model=MODEL, messages=turn1, max_tokens=6, temperature=0.0, extra_body={"cache_salt": http_salt}
    )
    z1 = zmq.generate(messages=turn1, max_tokens=6, temperature=0.0, cache_salt=zmq_salt)
    assert r1.choices[0].message.content == z1.text
    turn2 = [*turn1, {"role": "assistant", "content": z1.text}, {"role": "user", "content": "and the second"}]
    r2 = oai.chat.completions.create(
        model=MODEL, messages=turn2, max_tokens=6, temperature=0.0, extra_body={"cache_salt": http_salt}
    )
    z2 = zmq.generate(messages=turn2, max_tokens=6, temperature=0.0, cache_salt=zmq_salt)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert usage_tuple(r2.usage) == (z2.usage.prompt_tokens, z2.usage.cached_tokens, len(z2.token_ids))
    assert r2.choices[0].message.content == z2.text
    assert z2.usage.cached_tokens >= (r1.usage.prompt_tokens // BLOCK) * BLOCK > 0
    other = oai.chat.completions.create(
        model=MODEL, messages=turn2, max_tokens=1, temperature=0.0, extra_body={"cache_salt": salt()}
    )
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # another salt shares nothing


def test_sixteen_concurrent_async_streams(http, zmq, wait_idle):
    prompts = [f"concurrent stream number {i}" for i in range(16)]
    refs = [zmq.generate(messages=msgs(p), max_tokens=8, temperature=0.0, cache_salt=salt()) for p in prompts]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, tuple]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=msgs(prompt),
            max_tokens=8,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"cache_salt": salt()},
        )
        parts = []
        usage = None
        async for ch in stream:
            parts.extend(c.delta.content or "" for c in ch.choices)
            usage = ch.usage or usage
        return "".join(parts), usage_tuple(usage)

    async def run() -> list[tuple[str, tuple]]:
        async with http.async_openai() as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(run())
    assert got == [(r.text, (r.usage.prompt_tokens, 0, len(r.token_ids))) for r in refs]
    assert_idle(zmq, wait_idle)
