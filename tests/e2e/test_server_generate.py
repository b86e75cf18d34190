"""Generation through the real processes: text, streaming, concurrency, prefix caching, stop strings, salts, n > 1."""

from __future__ import annotations

import asyncio
import threading

from runtime.client import AsyncClient, Client
from runtime.protocol import Usage

BLOCK = 16
REPLACEMENT = "\ufffd"


def greedy(**kw):
    return {"temperature": 0.0, **kw}


# ---- the embedded model -----------------------------------------------------------------------------------------


def test_stream_equals_generate_with_multibyte_text(smol_server):
    messages = [{"role": "user", "content": "Write the Japanese word for cat, then three cat emoji."}]
    salt = "multibyte"  # this test's own cache: other tests on the session's server share the template's system turn
    with smol_server.client(timeout=300) as c:
        full = c.generate(messages=messages, cache_salt=salt, **greedy(max_tokens=12))
        chunks = list(c.stream(messages=messages, cache_salt=salt, **greedy(max_tokens=12)))
    streamed = "".join(ch.text for ch in chunks)
    assert streamed == full.text
    assert [t for ch in chunks for t in ch.token_ids] == full.token_ids
    assert any(ord(ch) > 0x2E80 for ch in full.text)  # CJK / emoji came out
    assert all(REPLACEMENT not in ch.text for ch in chunks)
    assert chunks[-1].finish_reason == full.finish_reason
    prompt = full.usage.prompt_tokens  # the second request reuses the first one's full prompt blocks
    assert full.usage == Usage(prompt, 0, len(full.token_ids), full.usage.queue_time_s)
    assert chunks[-1].usage == Usage(
        prompt, (prompt - 1) // BLOCK * BLOCK, len(full.token_ids), chunks[-1].usage.queue_time_s
    )
    assert 0 <= full.usage.queue_time_s < 60 and 0 <= chunks[-1].usage.queue_time_s < 60  # the scheduler's, carried
    assert full.usage.completion_tokens == len(full.token_ids)


def test_sixteen_concurrent_clients(smol_server, smollm2_tokenizer):
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with Client(smol_server.endpoint, timeout=300) as c:
                results[i] = c.generate(prompt="Count: " + "one " * (i + 1), ignore_eos=True, **greedy(max_tokens=4))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i in range(16):  # each reply reached its own client: its prompt length, its own tokens
        r = results[i]
        prompt_ids = smollm2_tokenizer.encode("Count: " + "one " * (i + 1))
        assert r.usage.prompt_tokens == len(prompt_ids)
        assert len(r.token_ids) == 4 and r.finish_reason == "length"
        assert r.text == smollm2_tokenizer.decode(r.token_ids, skip_special_tokens=True)


# ---- the tiny model: cache behavior through the processes -------------------------------------------------------


def test_second_chat_turn_hits_the_cache(tiny_server):
    history = [
        {"role": "system", "content": "You answer about turn caching, case 71."},
        {"role": "user", "content": "What is a radix tree? Explain in detail please."},
    ]
    with tiny_server.client() as c:
        first = c.generate(messages=history, ignore_eos=True, **greedy(max_tokens=20))
        assert first.usage.cached_tokens == 0
        history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And a block?"}]
        second = c.generate(messages=history, **greedy(max_tokens=4))
    assert second.usage.cached_tokens >= first.usage.prompt_tokens // BLOCK * BLOCK
    assert second.usage.cached_tokens % BLOCK == 0
    assert second.usage.cached_tokens < second.usage.prompt_tokens


def test_cache_salt_isolates_tenants(tiny_server):
    """Case C12 through the server: same salt hits, a different salt or none misses."""
    prompt = list(range(2000, 2040))  # 40 tokens: 2 full blocks can be reused (the last token is always computed)
    with tiny_server.client() as c:
        a = c.generate(input_ids=prompt, cache_salt="s1", **greedy(max_tokens=1))
        b = c.generate(input_ids=prompt, cache_salt="s2", **greedy(max_tokens=1))
        again = c.generate(input_ids=prompt, cache_salt="s1", **greedy(max_tokens=1))
        unsalted = c.generate(input_ids=prompt, **greedy(max_tokens=1))
    assert [r.usage.cached_tokens for r in (a, b, again, unsalted)] == [0, 0, 32, 0]
    assert a.token_ids == again.token_ids


def test_stop_string_ends_text_and_caches_no_block_past_it(tiny_server):
    prompt = list(range(3000, 3021))  # 21 tokens
    with tiny_server.client() as c:
        ref = c.generate(input_ids=prompt, cache_salt="ref", ignore_eos=True, **greedy(max_tokens=40))
        cut = len(ref.text) // 2
        stop = ref.text[cut : cut + 3]
        assert len(stop) == 3 and stop.strip()
        expected_text = ref.text[: ref.text.find(stop)]
        stopped = c.generate(input_ids=prompt, cache_salt="stop", ignore_eos=True, stop=[stop], **greedy(max_tokens=40))
        streamed = list(
            c.stream(input_ids=prompt, cache_salt="stream", ignore_eos=True, stop=[stop], **greedy(max_tokens=40))
        )
        kept = len(stopped.token_ids)
        probe = c.generate(input_ids=prompt + ref.token_ids, cache_salt="stop", **greedy(max_tokens=1))
    assert stopped.text == expected_text and stopped.finish_reason == "stop"
    assert stopped.token_ids == ref.token_ids[:kept] and stopped.usage.completion_tokens == kept
    assert kept < len(ref.token_ids)
    assert "".join(ch.text for ch in streamed) == expected_text
    assert streamed[-1].finish_reason == "stop"
    # The cache holds the prompt + kept tokens' full blocks, none of the tokens computed after the stop string.
    assert probe.usage.cached_tokens == (len(prompt) + kept) // BLOCK * BLOCK


def test_n2_returns_two_indexed_completions(tiny_server):
    kw = {
        "input_ids": list(range(4000, 4030)),
        "n": 2,
        "temperature": 1.0,
        "seed": 5,
        "ignore_eos": True,
        "max_tokens": 6,
    }
    with tiny_server.client() as c:
        r = c.generate(**kw)
        again = c.generate(**kw)
        chunks = list(c.stream(**kw))
    assert [ch.index for ch in r.choices] == [0, 1]
    assert [len(ch.token_ids) for ch in r.choices] == [6, 6]
    assert [ch.finish_reason for ch in r.choices] == ["length", "length"]
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 30
    assert [ch.token_ids for ch in again.choices] == [ch.token_ids for ch in r.choices]  # seeded: reproducible
    for i in (0, 1):
        assert [t for ch in chunks if ch.index == i for t in ch.token_ids] == r.choices[i].token_ids
    assert sorted(ch.index for ch in chunks if ch.finish_reason) == [0, 1]


def test_async_client_many_requests_in_flight(tiny_server):
    async def main():
        async with AsyncClient(tiny_server.endpoint, timeout=60) as ac:
            gens = [ac.generate(input_ids=[5000 + i, 7, 8], ignore_eos=True, **greedy(max_tokens=5)) for i in range(8)]
            results = await asyncio.gather(*gens)
            streamed = [ch async for ch in ac.stream(input_ids=[5000, 7, 8], ignore_eos=True, **greedy(max_tokens=5))]
            return results, streamed, await ac.stats(), await ac.health()

    results, streamed, stats, health = asyncio.run(main())
    assert [len(r.token_ids) for r in results] == [5] * 8
    assert [r.usage.prompt_tokens for r in results] == [3] * 8
    assert [t for ch in streamed for t in ch.token_ids] == results[0].token_ids
    assert health == "ok" and stats.num_blocks == 1024


def test_sync_client_many_requests_in_flight(tiny_server):
    with tiny_server.client() as c:
        rids = [c.submit(input_ids=[5100 + i] * (i + 2), ignore_eos=True, **greedy(max_tokens=3)) for i in range(6)]
        results = [c.result(rid) for rid in reversed(rids)]  # read in any order: replies are routed by rid
    assert [r.usage.prompt_tokens for r in results] == [7, 6, 5, 4, 3, 2]
    assert [len(r.token_ids) for r in results] == [3] * 6


def test_logprobs_are_aligned_with_tokens(tiny_server):
    with tiny_server.client() as c:
        r = c.generate(input_ids=[5200, 5201, 5202], logprobs=2, ignore_eos=True, **greedy(max_tokens=4))
        chunks = list(c.stream(input_ids=[5200, 5201, 5202], logprobs=2, ignore_eos=True, **greedy(max_tokens=4)))
    assert len(r.choices[0].logprobs) == 4
    for token, lp in zip(r.token_ids, r.choices[0].logprobs, strict=True):
        assert len(lp.top_token_ids) == 2 and lp.top_token_ids[0] == token  # greedy: the sampled token is the top
        assert lp.logprob == lp.top_logprobs[0] <= 0.0
    assert [lp for ch in chunks for lp in (ch.logprobs or [])] == r.choices[0].logprobs
