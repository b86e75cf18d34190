"""The wire: strict typed decoding, a typed ErrorResponse for every bad input, and no pickle anywhere."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import pickle
import re
from pathlib import Path

import msgspec
import pytest
import zmq

from runtime import protocol as p
from runtime.client import Client, ContextLengthError, InvalidRequestError, MalformedRequestError
from runtime.sampling_params import InvalidSamplingParams
from tests.paths import ROOT

MAX_MESSAGE_BYTES = 65536  # the tiny server's --max-message-bytes


def enc(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


def gen(**fields) -> bytes:
    return enc({"type": "generate", "rid": "r", **fields})


@pytest.fixture
def dealer(tiny_server):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.connect(tiny_server.endpoint)
    yield sock
    sock.close()


def ask(sock: zmq.Socket, frame: bytes):
    """Sends one raw frame and returns the server's first reply (Heartbeats skipped)."""
    sock.send(frame)
    while True:
        msg = msgspec.msgpack.decode(sock.recv(), type=p.ServerMessage)
        if not isinstance(msg, p.Heartbeat):
            return msg


BAD_INPUTS = {
    "random bytes": (b"\xc1\x00\xff\x13garbage", "", p.ERR_MALFORMED),
    "wrong field type": (gen(prompt=123), "r", p.ERR_MALFORMED),
    "wrong nested type": (gen(prompt="hi", sampling_params={"max_tokens": "8"}), "r", p.ERR_MALFORMED),
    "unknown field": (gen(prompt="hi", colour="red"), "r", p.ERR_MALFORMED),
    "unknown tag": (enc({"type": "launch_missiles", "rid": "r"}), "r", p.ERR_UNKNOWN_MESSAGE),
    "not a map": (enc([1, 2, 3]), "", p.ERR_MALFORMED),
    "over max_message_bytes": (gen(prompt="x" * (MAX_MESSAGE_BYTES + 1)), "r", p.ERR_TOO_LARGE),
    "type not hashable": (enc({"type": [1], "rid": "r"}), "r", p.ERR_UNKNOWN_MESSAGE),
    "unknown sampling field": (gen(prompt="hi", sampling_params={"colour": 1}), "r", p.ERR_MALFORMED),
    "top_k beyond int64": (gen(prompt="hi", sampling_params={"top_k": 2**63}), "r", p.ERR_INVALID),
    "max_tokens beyond int32": (gen(prompt="hi", sampling_params={"max_tokens": 2**31}), "r", p.ERR_INVALID),
    "stop token id beyond int32": (
        gen(prompt="hi", sampling_params={"stop_token_ids": [2**64 - 1]}),
        "r",
        p.ERR_INVALID,
    ),
    "no prompt field": (gen(), "r", p.ERR_INVALID),
    "two prompt fields": (gen(prompt="hi", input_ids=[1, 2]), "r", p.ERR_INVALID),
    "three prompt fields": (
        gen(prompt="hi", input_ids=[1], messages=[{"role": "user", "content": "x"}]),
        "r",
        p.ERR_INVALID,
    ),
    "empty prompt": (gen(prompt=""), "r", p.ERR_INVALID),
    "empty input_ids": (gen(input_ids=[]), "r", p.ERR_INVALID),
    "empty messages": (gen(messages=[]), "r", p.ERR_INVALID),
    "prompt longer than the context": (gen(input_ids=[5] * 1100), "r", p.ERR_CONTEXT),
    "prompt exactly the context": (gen(input_ids=[5] * 1024), "r", p.ERR_CONTEXT),
    "max_tokens 0": (gen(prompt="hi", sampling_params={"max_tokens": 0}), "r", p.ERR_INVALID),
    "max_tokens negative": (gen(prompt="hi", sampling_params={"max_tokens": -3}), "r", p.ERR_INVALID),
    "temperature NaN": (gen(prompt="hi", sampling_params={"temperature": math.nan}), "r", p.ERR_INVALID),
    "temperature negative": (gen(prompt="hi", sampling_params={"temperature": -0.5}), "r", p.ERR_INVALID),
    "token id = vocab size": (gen(input_ids=[1, 49152]), "r", p.ERR_INVALID),
    "negative token id": (gen(input_ids=[-1, 3]), "r", p.ERR_INVALID),
    "empty stop string": (gen(prompt="hi", sampling_params={"stop": [""]}), "r", p.ERR_INVALID),
    "bad chat role type": (gen(messages=[{"role": 1, "content": "x"}]), "r", p.ERR_MALFORMED),
    "tokenize int prompt": (enc({"type": "tokenize", "rid": "r", "prompt": 5}), "r", p.ERR_MALFORMED),
    "tokenize both inputs": (
        enc({"type": "tokenize", "rid": "r", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
        "r",
        p.ERR_INVALID,
    ),
    "detokenize without ids": (enc({"type": "detokenize", "rid": "r"}), "r", p.ERR_MALFORMED),
    "detokenize id = vocab size": (
        enc({"type": "detokenize", "rid": "r", "token_ids": [1, 49152]}),
        "r",
        p.ERR_INVALID,
    ),
    "detokenize over max_message_bytes": (
        enc({"type": "detokenize", "rid": "r", "token_ids": [1] * (MAX_MESSAGE_BYTES + 1)}),
        "r",
        p.ERR_TOO_LARGE,
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_gets_typed_error_and_server_keeps_serving(dealer, name):
    frame, rid, code = BAD_INPUTS[name]
    reply = ask(dealer, frame)
    assert isinstance(reply, p.ErrorResponse)
    assert (reply.rid, reply.code) == (rid, code), reply.message
    ok = ask(
        dealer,
        enc(
            p.GenerateRequest(
                rid="ok",
                input_ids=[1, 2, 3],
                sampling_params=p.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
            )
        ),
    )
    assert isinstance(ok, p.StreamChunk) and ok.rid == "ok" and ok.finish_reason == "length"
    assert len(ok.token_ids) == 2


def test_multipart_frame_is_malformed(dealer):
    dealer.send_multipart([gen(prompt="hi"), b"extra"])
    reply = msgspec.msgpack.decode(dealer.recv(), type=p.ServerMessage)
    assert (reply.rid, reply.code) == ("", p.ERR_MALFORMED)


def test_duplicate_rid_in_flight(dealer):
    long = gen(input_ids=[7, 8, 9], sampling_params={"max_tokens": 200, "ignore_eos": True})
    dealer.send(long)
    reply = ask(dealer, long)
    assert (reply.rid, reply.code) == ("r", p.ERR_DUPLICATE)
    dealer.send(enc(p.AbortRequest("r")))


def test_client_raises_typed_errors(tiny_server):
    with tiny_server.client() as c:
        with pytest.raises(ContextLengthError):
            c.generate(input_ids=[5] * 1500, max_tokens=1)
        with pytest.raises(InvalidRequestError) as info:
            c.generate(input_ids=[10**6], max_tokens=1)
        assert info.value.code == p.ERR_INVALID
        with pytest.raises(InvalidSamplingParams):  # checked before anything is sent
            c.generate(prompt="hi", max_tokens=0)
        assert c.health() == "ok"


def test_tokenize_and_detokenize_answer_from_the_servers_tokenizer(tiny_server, smollm2_tokenizer):
    """The ids of a tokenize request are the prompt tokens the same prompt or messages get when generating (the chat
    template applied; the character limit of generate); detokenize gives the text of ids, special tokens kept."""
    from runtime.client import AsyncClient
    from runtime.text.prompt import encode_prompt

    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "tokenize me"}]
    limit = 32 * 1024  # the tiny model's context is 1024 tokens; max_prompt_chars is not set
    with tiny_server.client(timeout=60) as c:
        ids = c.tokenize(messages=chat)
        assert ids == encode_prompt(smollm2_tokenizer, messages=chat)
        assert c.generate(messages=chat, max_tokens=1).usage.prompt_tokens == len(ids)
        assert c.tokenize(prompt="héllo world") == smollm2_tokenizer.encode("héllo world") == [88, 2756, 31394, 905]
        assert c.detokenize([88, 2756, 31394, 905]) == "héllo world"
        assert c.detokenize(ids) == smollm2_tokenizer.decode(ids)  # "<|im_start|>system\n..."
        with pytest.raises(InvalidRequestError) as info:
            c.tokenize(prompt="a" * (limit + 1))
        assert info.value.message == f"prompt too long: {limit + 1} characters, the limit is {limit} (max_prompt_chars)"
        with pytest.raises(InvalidRequestError) as info:
            c.detokenize([5, 49152])
        assert info.value.message == "token_ids[1] = 49152 is outside the vocabulary [0, 49152)"
        with pytest.raises(InvalidRequestError) as info:
            c.tokenize()
        assert info.value.message == "exactly one of prompt, messages must be set, got none"

    async def run() -> tuple[list[int], str]:
        async with AsyncClient(tiny_server.endpoint, timeout=60) as ac:
            return await ac.tokenize(prompt="héllo world"), await ac.detokenize([88, 2756, 31394, 905])

    assert asyncio.run(run()) == ([88, 2756, 31394, 905], "héllo world")


def test_client_gets_message_too_large_for_its_own_request(tiny_server):
    """The server reads the rid of a frame over max_message_bytes, so the Client raises at once instead of a
    ServerGoneError after its liveness interval."""
    with Client(tiny_server.endpoint, timeout=30.0, liveness_s=5.0) as c:
        with pytest.raises(MalformedRequestError) as info:
            c.generate(prompt="x" * MAX_MESSAGE_BYTES, max_tokens=1)
        assert info.value.code == p.ERR_TOO_LARGE and info.value.rid != ""
        assert c.health() == "ok"


def test_client_logs_and_drops_an_error_it_cannot_route(tiny_server, caplog):
    with Client(tiny_server.endpoint, timeout=30.0) as c, caplog.at_level(logging.WARNING, "runtime.client"):
        c.send_raw(b"\xc1")  # no rid can be read: the answer has rid ""
        assert c.health() == "ok"
    [record] = [r for r in caplog.records if r.name.startswith("runtime.client")]
    assert "could not attribute to a request: [malformed]" in record.getMessage()


def test_decode_client_frame_never_raises():
    for frame in [b"", b"\x00", b"\xff" * 10, pickle.dumps({"a": 1}), enc(None), enc({"type": None})]:
        out = p.decode_client_frame(frame, 1024)
        assert isinstance(out, p.ErrorResponse) and out.code in p.ERROR_CODES


class _CreatesFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def internal_endpoints(server) -> list[str]:
    """The ipc endpoints of a running server, read from its children's command lines."""
    pid = server.child_pids()["worker"]
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    spec = json.loads(argv[argv.index(b"--child") + 1])
    return list(spec["endpoints"].values())


def test_pickle_payload_is_never_unpickled(tiny_server, tmp_path):
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_CreatesFile(str(marker)))
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 30_000)
    dealer.connect(tiny_server.endpoint)
    reply = ask(dealer, payload)
    assert isinstance(reply, p.ErrorResponse) and reply.code == p.ERR_MALFORMED
    endpoints = internal_endpoints(tiny_server)
    assert len(endpoints) == 6
    for endpoint in endpoints:
        if endpoint.endswith("/events"):
            continue  # PUB: nothing is received there
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(endpoint)
        push.send(payload)
        push.send(enc({"type": "forward_batch", "step_id": "x"}))  # a valid frame of the wrong types
        push.close()
    with tiny_server.client() as c:  # every process still serves: a full round trip
        r = c.generate(input_ids=[11, 12, 13], max_tokens=3, temperature=0.0, ignore_eos=True)
        assert len(r.token_ids) == 3 and c.health() == "ok"
    dealer.close()
    assert not marker.exists()


PRODUCT_DIRS = ("radix", "kernels", "runtime", "router")
PICKLE_USE = [
    re.compile(r"^\s*(import|from)\s+(pickle|cPickle|_pickle|dill|cloudpickle|shelve|multiprocessing)\b", re.M),
    re.compile(r"\b(send_pyobj|recv_pyobj|send_serialized|recv_serialized|pickle\.loads?|torch\.load)\s*\("),
    re.compile(r"\bweights_only\s*=\s*False"),
]


def test_product_source_has_no_pickle():
    files = [f for d in PRODUCT_DIRS for f in (ROOT / d).rglob("*.py")]
    assert len(files) >= 10
    offenders = [
        f"{f.relative_to(ROOT)}: {m.group(0).strip()}"
        for f in files
        for rx in PICKLE_USE
        for m in rx.finditer(f.read_text())
    ]
    assert offenders == []


def test_kv_snapshot_lists_the_cached_blocks(tiny_server, wait_idle):
    with tiny_server.client() as c:
        c.generate(input_ids=list(range(7000, 7040)), max_tokens=1, temperature=0.0)
        stats = wait_idle(c)
        snap = c.kv_snapshot()
    assert (snap.block_size, snap.events_port) == (16, 0)  # no --events-port: KV events on ipc only
    assert len(snap.snapshot.block_hashes) == stats.num_cached_blocks >= 2
    assert len(set(snap.snapshot.block_hashes)) == len(snap.snapshot.block_hashes)


def test_server_rejects_text_over_the_character_limit(tiny_server):
    from runtime.client import InvalidRequestError

    limit = 32 * 1024  # the tiny model's context is 1024 tokens; max_prompt_chars is not set
    with tiny_server.client(timeout=60) as c:
        with pytest.raises(InvalidRequestError) as info:
            c.generate(prompt="a" * (limit + 1), max_tokens=2)
        assert (info.value.code, info.value.message) == (
            p.ERR_INVALID,
            f"prompt too long: {limit + 1} characters, the limit is {limit} (max_prompt_chars)",
        )
        with pytest.raises(InvalidRequestError) as info:
            c.generate(messages=[{"role": "user", "content": "a" * limit}], max_tokens=2)
        assert info.value.message == (
            f"messages too long: {limit + 4 + 32} characters (32 per message for the chat "
            f"template included), the limit is {limit} (max_prompt_chars)"
        )
