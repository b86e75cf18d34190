"""Prompts are tokenized off the tokenizer loop (runtime/serve/tokenizer/prompt_worker.py, prompt_prep.py): the loop
keeps streaming and heartbeating while max-size prompts are tokenized, a client's requests keep their order, an abort or
a vanished client during tokenization leaks nothing, a duplicate rid is caught while the first is tokenized, and text
over the character limit is rejected before tokenizing."""

from __future__ import annotations

import itertools
import random
import re
import threading
import time

import msgspec
import pytest
import zmq

from runtime import protocol as p
from runtime.serve.tokenizer.loop import serve_tokenizer
from runtime.serve.tokenizer.prompt_worker import PromptResult, PromptWorker
from tests.runtime.serve.tokenizer.rig import READY, GatedTokenizer, Rig

BIG = " hello" * 2000  # 12,000 characters, 2,000 tokens: over PromptPrep's inline size, within the context


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _gen(rid: str, prompt: str, **kw) -> p.GenerateRequest:
    return p.GenerateRequest(rid=rid, prompt=prompt, **kw)


def test_large_prompts_wait_off_the_loop_in_client_order_and_a_duplicate_or_abort_leaks_nothing(ctx, smollm2_tokenizer):
    tok = GatedTokenizer(smollm2_tokenizer)
    rig = Rig(ctx, "order", tok, ("A", "B"))
    rig.send("A", _gen("big", BIG))
    assert tok.started.wait(10)  # on the worker thread, blocked in encode: the loop thread is free
    rig.send("A", _gen("small", "Hi"))  # small, but behind A's big one: queued to keep A's order
    rig.send("A", _gen("big2", BIG))
    rig.send("A", p.AbortRequest("big2"))  # aborted while queued: never forwarded
    rig.send("A", _gen("big", "Hi"))  # "big" is in flight (being tokenized): a duplicate
    rig.send("B", _gen("b1", "Hi"))  # another client's small request goes straight through
    assert [m.rid for m in rig.forwarded()] == [rig.server.in_flight.by_client[(b"B", "b1")]]
    duplicate = p.ErrorResponse("big", p.ERR_DUPLICATE, "a request with rid 'big' is already in flight")
    assert rig.replies("A") == [duplicate]
    tok.gate.set()
    assert rig.server.finish_prompts(10) == 3  # big, small, and big2's cancelled job
    forwarded = rig.forwarded()
    internal = {rid: rig.server.in_flight.by_client[(b"A", rid)] for rid in ("big", "small")}
    assert [(m.rid, m.input_ids) for m in forwarded] == [
        (internal["big"], smollm2_tokenizer.encode(BIG)),
        (internal["small"], smollm2_tokenizer.encode("Hi")),
    ]
    assert sorted(r.rid for r in rig.server.in_flight.requests.values()) == ["b1", "big", "small"]
    assert rig.server.prompts.in_flight == 0 and not rig.server.prompts.busy(b"A")
    rig.server.close()


def test_a_client_that_vanishes_while_its_prompt_is_tokenized_is_never_forwarded(ctx, smollm2_tokenizer):
    tok = GatedTokenizer(smollm2_tokenizer)
    rig = Rig(ctx, "vanish", tok, ("A",))
    rig.send("A", _gen("big", BIG, stream=True))
    assert tok.started.wait(10)
    rig.server.drop_client(b"A")  # what ClientFrontend does when a send to A fails
    assert rig.server.in_flight.requests == {} and rig.server.in_flight.by_client == {}
    tok.gate.set()
    assert rig.server.finish_prompts(10) == 1
    assert rig.forwarded() == [] and rig.server.in_flight.requests == {}
    rig.server.close()


def test_prompt_worker_takes_groups_in_turn_and_skips_cancelled_jobs():
    worker = PromptWorker()
    gate = threading.Event()
    ran = []

    def job(name: str, wait: bool = False):
        def run():
            if wait:
                assert gate.wait(10)
            ran.append(name)
            return name.upper()

        return run

    worker.submit("x1", "X", job("x1", wait=True))
    for key, group in (("x2", "X"), ("x3", "X"), ("y1", "Y"), ("y2", "Y")):
        worker.submit(key, group, job(key))
    worker.cancel("y2")
    assert worker.busy("X") and worker.busy("Y") and not worker.busy("Z")
    gate.set()
    results = worker.wait(10)
    assert results == [
        PromptResult("x1", "X", "X1", None),
        PromptResult("y1", "Y", "Y1", None),
        PromptResult("x2", "X", "X2", None),
        PromptResult("y2", "Y", None, None),
        PromptResult("x3", "X", "X3", None),
    ]
    assert ran == ["x1", "y1", "x2", "x3"] and worker.in_flight == 0 and not worker.busy("X")
    worker.submit("bad", "X", lambda: 1 // 0)
    [failed] = worker.wait(10)
    assert failed.key == "bad" and isinstance(failed.error, ZeroDivisionError)
    worker.close()
    worker._thread.join(5)
    assert not worker._thread.is_alive()


def _max_size_prompt(chars: int, seed: int) -> str:
    """Random characters of mixed scripts (Cyrillic, Arabic, CJK, emoji, ASCII): the slowest text per character to
    encode found for the SmolLM2 tokenizer (1.0-1.6 s for 262,144 characters on this 2-core CPU)."""
    rng = random.Random(seed)
    ranges = [(0x400, 0x4FF), (0x600, 0x6FF), (0x4E00, 0x9FFF), (0x1F300, 0x1F5FF), (33, 127)]
    alphabet = [chr(c) for lo, hi in ranges for c in rng.sample(range(lo, hi), 94)]
    return "".join(rng.choices(alphabet, k=chars))


@pytest.mark.slow
def test_streaming_and_heartbeats_go_on_while_three_max_size_prompts_are_tokenized(ctx, smollm2_tokenizer):
    """Client S streams; clients B, C, D each send a prompt of the largest size accepted (32 x 8192 characters).
    While they are tokenized, S hears from the server (a chunk or a heartbeat) in every second."""
    rig = Rig(ctx, "stall", smollm2_tokenizer, ("S", "B", "C", "D"))
    server = rig.server
    rig.send("S", _gen("s", BIG, stream=True))  # prepared on the worker thread, then streamed by the loop thread
    assert server.finish_prompts(10) == 1
    [tokenized] = rig.forwarded()
    sched_push = ctx.socket(zmq.PUSH)  # the scheduler's side of the tokenizer's input
    from_sched = ctx.socket(zmq.PULL)
    from_sched.bind("inproc://stall-in")
    sched_push.connect("inproc://stall-in")
    stop = threading.Event()
    loop = threading.Thread(target=serve_tokenizer, args=(server, from_sched, lambda: not stop.is_set()))
    loop.start()
    try:
        big = {c: _max_size_prompt(32 * READY.max_model_len, i) for i, c in enumerate("BCD")}  # the default limit
        start = time.monotonic()
        heard = [start]
        answers = {}
        chunks = 0
        for c in "BCD":
            rig.send(c, _gen(c.lower(), big[c]), handle=False)  # the loop thread handles them
        while len(answers) < 3 and time.monotonic() - start < 120:
            sched_push.send(msgspec.msgpack.encode(p.TokenOutputs([p.TokenOutput(tokenized.rid, 0, [HI_ID], None)])))
            for msg in rig.replies("S", wait_ms=50):
                assert isinstance(msg, p.Heartbeat) or (msg.rid, msg.text, msg.token_ids) == ("s", "Hi", [HI_ID])
                heard.append(time.monotonic())
                chunks += isinstance(msg, p.StreamChunk)
            for c in "BCD":
                for msg in rig.replies(c, wait_ms=0):
                    if not isinstance(msg, p.Heartbeat):
                        answers[c] = msg
        heard.append(time.monotonic())
    finally:
        stop.set()
        loop.join(10)
        server.close()
    for c in "BCD":  # each was tokenized (far over 8192 tokens), then rejected by the prompt check
        assert answers[c].code == p.ERR_CONTEXT and re.fullmatch(
            r"prompt of \d{6} tokens leaves no room to generate under max_model_len 8192", answers[c].message
        )
    assert chunks >= 1  # streaming went on, not only heartbeats
    gaps = [b - a for a, b in itertools.pairwise(heard)]
    assert max(gaps) < 1.0, f"S heard nothing for {max(gaps):.2f} s while the prompts were tokenized"


HI_ID = 26843  # "Hi" in the SmolLM2 tokenizer
