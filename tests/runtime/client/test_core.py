"""The sans-IO ClientCore on its own, with no server and no clock: given frames and times, it routes replies by
rid, tracks which completions finished, turns an ErrorResponse into its typed error, builds the frames to send, and
judges a waiting request's deadline and the server's silence."""

from __future__ import annotations

import logging

import msgspec
import pytest

from runtime import protocol as p
from runtime.client import (
    ClientError,
    ContextLengthError,
    InvalidInputError,
    RequestTimeout,
    ServerGoneError,
)
from runtime.client.core import JUDGE_EVERY_S, ClientCore, expect

ENDPOINT = "tcp://127.0.0.1:9"


def frame(msg: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(msg)


def sent(data: bytes) -> p.ClientMessage:
    return p.decode_client_frame(data, 1 << 20)


def chunk(rid: str, index: int, token: int, finish: str | None = None) -> p.StreamChunk:
    return p.StreamChunk(rid=rid, index=index, text=str(token), token_ids=[token], finish_reason=finish)


def core(timeout: float | None = 30.0, liveness_s: float | None = 15.0) -> ClientCore:
    return ClientCore(ENDPOINT, timeout, liveness_s, now=100.0)


def test_a_generate_request_is_built_opened_with_its_n_and_sent_as_one_frame():
    c = core()
    out = c.open_generate(None, None, [1, 2, 3], True, "salt", {"n": 3, "max_tokens": 4})
    assert sent(out.frame) == p.GenerateRequest(
        rid=out.rid,
        input_ids=[1, 2, 3],
        sampling_params=p.SamplingParams(n=3, max_tokens=4),
        stream=True,
        cache_salt="salt",
    )
    assert (c.open_rids(), c.completions(out.rid), c.finished(out.rid)) == ([out.rid], 3, False)
    control = c.open_control(p.StatsRequest)
    assert sent(control.frame) == p.StatsRequest(control.rid)
    assert (c.open_rids(), c.completions(control.rid)) == ([out.rid, control.rid], 1)


def test_a_refused_request_opens_nothing():
    c = core()
    with pytest.raises(InvalidInputError):
        c.open_generate("\ud800", None, None, False, None, {})
    with pytest.raises(ValueError):  # InvalidSamplingParams
        c.open_generate("hi", None, None, False, None, {"max_tokens": 2**31})
    assert c.open_rids() == []


def test_replies_are_routed_by_rid_and_finish_their_completions():
    c = core()
    a = c.open_generate("a", None, None, True, None, {"n": 2}).rid
    b = c.open_generate("b", None, None, True, None, {}).rid
    assert c.receive(frame(chunk(b, 0, 7)), 101.0) == b
    assert c.receive(frame(chunk(a, 1, 5, "stop")), 102.0) == a
    assert c.receive(frame(chunk(a, 0, 4)), 103.0) == a
    assert c.last_heard == 103.0
    assert c.pop(a) == chunk(a, 1, 5, "stop")
    assert c.pop(a) == chunk(a, 0, 4)
    assert (c.pop(a), c.finished(a)) == (None, False)  # completion 0 of 2 still runs
    assert c.receive(frame(chunk(a, 0, 6, "length")), 104.0) == a
    assert c.pop(a) == chunk(a, 0, 6, "length")
    assert c.finished(a) is True
    assert c.close(a) is None  # it ended: nothing to abort
    assert c.receive(frame(chunk(a, 0, 9)), 105.0) is None  # a reply to a request no longer waited on is dropped
    assert c.pop(b) == chunk(b, 0, 7)
    assert c.open_rids() == [b]


def test_heartbeats_restart_the_liveness_clock_and_route_nothing():
    c = core()
    rid = c.open_control(p.HealthRequest).rid
    assert c.receive(frame(p.Heartbeat()), 107.5) is None
    assert (c.last_heard, c.pop(rid)) == (107.5, None)
    assert c.receive(frame(p.HealthResponse(rid, "ok")), 108.0) == rid
    assert expect(c.pop(rid), p.HealthResponse).status == "ok"
    assert c.finished(rid) is True  # a control request ends with its reply


def test_tokenize_and_detokenize_are_one_frame_ended_by_their_one_reply():
    c = core()
    chat = c.open_tokenize(None, [{"role": "user", "content": "hi"}], True)
    assert sent(chat.frame) == p.TokenizeRequest(rid=chat.rid, messages=[p.ChatMessage("user", "hi")])
    text = c.open_tokenize("héllo", None, False)
    assert sent(text.frame) == p.TokenizeRequest(rid=text.rid, prompt="héllo", add_special_tokens=False)
    ids = c.open_detokenize(range(3))  # any iterable of integers is sent as a list
    assert sent(ids.frame) == p.DetokenizeRequest(ids.rid, [0, 1, 2])
    assert c.completions(chat.rid) == c.completions(ids.rid) == 1
    assert c.receive(frame(p.DetokenizeResponse(ids.rid, "abc")), 101.0) == ids.rid
    assert c.receive(frame(p.TokenizeResponse(chat.rid, [1, 2])), 102.0) == chat.rid
    assert expect(c.pop(chat.rid), p.TokenizeResponse).token_ids == [1, 2]
    assert expect(c.pop(ids.rid), p.DetokenizeResponse).text == "abc"
    assert c.finished(chat.rid) and c.finished(ids.rid)
    assert c.close(chat.rid) is None and c.close(ids.rid) is None  # they ended: nothing to abort
    assert sent(c.close(text.rid)) == p.AbortRequest(text.rid)  # left unanswered: the abort is harmless
    with pytest.raises(InvalidInputError, match="token_ids must be integers"):
        c.open_detokenize([1, 2.5])
    with pytest.raises(InvalidInputError, match=r"messages\[0\] must be a ChatMessage or a dict"):
        c.open_tokenize(None, ["hi"], True)
    with pytest.raises(InvalidInputError):
        c.open_tokenize("\ud800", None, True)  # not UTF-8: msgpack cannot carry it
    with pytest.raises(InvalidInputError):
        c.open_detokenize([2**64])
    assert c.open_rids() == []


def test_an_error_response_raises_its_typed_error_and_ends_the_request():
    c = core()
    rid = c.open_generate("long", None, None, False, None, {}).rid
    c.receive(frame(p.ErrorResponse(rid, p.ERR_CONTEXT, "too long")), 101.0)
    with pytest.raises(ContextLengthError) as info:
        c.pop(rid)
    assert (info.value.rid, info.value.code, info.value.message) == (rid, p.ERR_CONTEXT, "too long")
    assert c.open_rids() == []
    assert c.close(rid) is None  # the server ended it: nothing to abort
    with pytest.raises(KeyError):
        c.pop(rid)


def test_an_error_without_a_rid_is_logged_and_dropped(caplog):
    c = core()
    rid = c.open_control(p.HealthRequest).rid
    with caplog.at_level(logging.WARNING, "runtime.client"):
        assert c.receive(frame(p.ErrorResponse("", p.ERR_MALFORMED, "not msgpack")), 101.0) is None
    [record] = caplog.records
    assert (
        record.getMessage()
        == f"{ENDPOINT} rejected a frame it could not attribute to a request: [malformed] not msgpack"
    )
    assert (c.pop(rid), c.open_rids()) == (None, [rid])


def test_leaving_a_request_before_it_ended_builds_its_abort():
    c = core()
    rid = c.open_generate("a", None, None, True, None, {"n": 2}).rid
    c.receive(frame(chunk(rid, 0, 1, "stop")), 101.0)  # received, but not taken: the caller left before
    assert sent(c.close(rid)) == p.AbortRequest(rid)
    assert c.close(rid) is None  # already closed
    other = c.open_control(p.HealthRequest).rid
    assert sent(c.abort(other)) == p.AbortRequest(other)  # abort(): unconditional, and forgets the rid
    assert c.open_rids() == []


def test_expect_raises_client_error_for_another_reply_type():
    with pytest.raises(ClientError, match="request r: expected StreamChunk, got HealthResponse"):
        expect(p.HealthResponse("r", "ok"), p.StreamChunk)


def test_the_wait_runs_until_the_first_clock_is_due():
    c = core(timeout=30.0, liveness_s=15.0)
    rid = c.open_generate("a", None, None, False, None, {}).rid
    c.sent(100.0)
    deadline = c.deadline(100.0)
    assert deadline == 130.0
    assert c.wait_s(rid, deadline, 100.0) == JUDGE_EVERY_S == 1.0  # no clock due within a second
    assert c.wait_s(rid, deadline, 114.5) == 0.5  # the server's silence reaches liveness_s at 115.0
    assert c.wait_s(rid, deadline, 115.0) == 0.0  # reached, not passed
    c.receive(frame(p.Heartbeat()), 129.0)
    assert c.wait_s(rid, deadline, 129.75) == 0.25  # the deadline comes first
    assert core(timeout=None).deadline(100.0) is None


def test_past_its_deadline_a_request_times_out_and_stays_open_to_be_aborted():
    c = core(timeout=5.0, liveness_s=15.0)
    rid = c.open_generate("a", None, None, False, None, {}).rid
    with pytest.raises(RequestTimeout, match=f"request {rid} got no answer within 5.0 s"):
        c.wait_s(rid, c.deadline(100.0), 105.0)
    assert sent(c.close(rid)) == p.AbortRequest(rid)  # the face's cleanup aborts it on the server


def test_silence_past_liveness_means_the_server_is_gone():
    c = core(timeout=None, liveness_s=15.0)
    rid = c.open_generate("a", None, None, False, None, {}).rid
    c.sent(100.0)
    with pytest.raises(ServerGoneError) as info:
        c.wait_s(rid, None, 115.01)
    assert (info.value.rid, info.value.code) == (rid, p.ERR_SERVER)
    assert str(info.value) == (
        f"[server_error] nothing from {ENDPOINT} for 15.0 s, not even a heartbeat: the server is gone"
    )
    assert (c.open_rids(), c.close(rid)) == ([], None)  # nobody is there to abort it
    quiet = core(timeout=None, liveness_s=None)
    other = quiet.open_control(p.HealthRequest).rid
    assert quiet.wait_s(other, None, 1e6) == 1.0  # liveness_s None: never gone


def test_a_request_built_by_the_caller_is_opened_under_its_own_rid_once():
    c = core()
    request = p.GenerateRequest(rid="http-7", prompt="hi", sampling_params=p.SamplingParams(n=2), stream=True)
    out = c.open_request(request)
    assert (out.rid, sent(out.frame), c.completions("http-7")) == ("http-7", request, 2)
    with pytest.raises(InvalidInputError, match="rid 'http-7' is already in flight on this client"):
        c.open_request(request)
    assert c.open_rids() == ["http-7"]
