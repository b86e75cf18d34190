"""The process loops' handlers driven in one process over inproc sockets (no model): worker failures, stop strings,
control replies."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from radix.manager import KVCacheManager
from runtime import protocol as p
from runtime.config import ServerArgs
from runtime.sampling_params import SamplingParams
from runtime.scheduler.request import RequestRejected
from runtime.scheduler.scheduler import Scheduler
from runtime.serve.scheduler_process import SchedulerServer
from runtime.serve.tokenizer.loop import serve_tokenizer
from runtime.serve.tokenizer.server import TokenizerServer


class Pair:
    """A PUSH -> PULL inproc link; drain() returns the decoded messages waiting on the PULL side."""

    def __init__(self, ctx: zmq.Context, name: str, msg_type) -> None:
        self.pull = ctx.socket(zmq.PULL)
        self.push = ctx.socket(zmq.PUSH)
        self.pull.bind(f"inproc://{name}")
        self.push.connect(f"inproc://{name}")
        self.decoder = msgspec.msgpack.Decoder(msg_type)

    def drain(self) -> list:
        out = []
        while self.pull.poll(50):
            out.append(self.decoder.decode(self.pull.recv()))
        return out


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def make_scheduler_server(ctx):
    args = ServerArgs(num_blocks=32, block_size=4)
    sched = Scheduler(KVCacheManager(32, 4), args, max_model_len=64, eos_token_ids=[2])
    to_worker = Pair(ctx, "worker", p.WorkerInput)
    to_tok = Pair(ctx, "tok", p.TokenizerInput)
    return SchedulerServer(sched, to_worker.push, to_tok.push, None, 5.0), to_worker, to_tok


def test_worker_error_fails_requests_with_server_error(ctx):
    server, to_worker, to_tok = make_scheduler_server(ctx)
    server.on_tokenizer_message(p.TokenizedRequest(rid="a", input_ids=[5, 6, 7], sampling_params=SamplingParams()))
    server.try_schedule()
    [batch] = to_worker.drain()
    assert server.in_flight and [s.token_ids for s in batch.seqs] == [[5, 6, 7]]
    server.on_result(p.ForwardResult(batch.step_id, [], [], error="RuntimeError: boom"))
    [failed] = to_tok.drain()
    assert failed == p.RequestFailed("a", p.ERR_SERVER, f"the worker failed step {batch.step_id}: RuntimeError: boom")
    stats = server.server_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0)


def test_scheduler_rejects_and_answers_control(ctx):
    server, to_worker, to_tok = make_scheduler_server(ctx)
    server.on_tokenizer_message(p.TokenizedRequest(rid="big", input_ids=[1] * 64, sampling_params=SamplingParams()))
    server.on_tokenizer_message(p.HealthRequest("h"))
    server.on_tokenizer_message(p.StatsRequest("s"))
    server.on_tokenizer_message(p.AbortRequest("unknown"))  # ignored
    rejected, stats = to_tok.drain()  # health waits for the worker's own answer
    assert (rejected.rid, rejected.code) == ("big", p.ERR_CONTEXT)
    assert stats.rid == "s" and stats.stats.num_blocks == 32 and stats.stats.num_free_blocks == 31
    [probe] = to_worker.drain()
    server.on_worker_message(p.WorkerProbeReply(probe.probe_id))
    assert to_tok.drain() == [p.HealthResponse("h", "ok")]


def test_tokenizer_holds_back_stop_string_and_sends_stop(ctx, smollm2_tokenizer):
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://public")
    client = ctx.socket(zmq.DEALER)
    client.connect("inproc://public")
    to_sched = Pair(ctx, "sched", p.SchedulerInput)
    ready = p.Ready(
        num_blocks=32, block_size=4, max_model_len=64, num_host_blocks=0, vocab_size=49152, eos_token_ids=[2]
    )
    server = TokenizerServer(smollm2_tokenizer, ready, 65536, router, to_sched.push)
    req = p.GenerateRequest(
        rid="c1", prompt="Hello", stream=True, sampling_params=SamplingParams(max_tokens=20, stop=[" world!"])
    )
    client.send(msgspec.msgpack.encode(req))
    server.on_client_frames(router.recv_multipart())
    [tokenized] = to_sched.drain()
    assert tokenized.input_ids == smollm2_tokenizer.encode("Hello")
    ids = smollm2_tokenizer.encode(" big world! more")
    internal = tokenized.rid
    usage = p.Usage(len(tokenized.input_ids), 0, 1)
    for i, tid in enumerate(ids):
        server.on_scheduler_message(
            p.TokenOutputs([p.TokenOutput(internal, 0, [tid], None, usage if i == 0 else None)])
        )
    chunks = []
    while client.poll(50):
        chunks.append(msgspec.msgpack.decode(client.recv(), type=p.ServerMessage))
    assert "".join(c.text for c in chunks) == " big"
    assert chunks[-1].finish_reason == "stop"
    assert all("world" not in c.text and " w" not in c.text for c in chunks)
    keep = smollm2_tokenizer.encode(" big")
    assert [t for c in chunks for t in c.token_ids] == keep
    assert chunks[-1].usage == p.Usage(len(tokenized.input_ids), 0, len(keep))
    assert to_sched.drain() == [p.Stop(internal, 0, len(keep))]
    assert server.in_flight.requests == {}


def test_tokenizer_keeps_a_stop_token_id_out_of_the_text(ctx, smollm2_tokenizer):
    """stop_token_ids: the id ends the completion and stays in token_ids, but its text is never sent (as in the
    Engine)."""
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://public-stop-ids")
    client = ctx.socket(zmq.DEALER)
    client.connect("inproc://public-stop-ids")
    to_sched = Pair(ctx, "sched-stop-ids", p.SchedulerInput)
    ready = p.Ready(
        num_blocks=32, block_size=4, max_model_len=64, num_host_blocks=0, vocab_size=49152, eos_token_ids=[2]
    )
    server = TokenizerServer(smollm2_tokenizer, ready, 65536, router, to_sched.push)
    ids = smollm2_tokenizer.encode(" 1, 2")
    stop_id = ids[-1]
    req = p.GenerateRequest(
        rid="c2", prompt="Count:", stream=False, sampling_params=SamplingParams(max_tokens=20, stop_token_ids=[stop_id])
    )
    client.send(msgspec.msgpack.encode(req))
    server.on_client_frames(router.recv_multipart())
    [tokenized] = to_sched.drain()
    usage = p.Usage(len(tokenized.input_ids), 0, len(ids))
    server.on_scheduler_message(p.TokenOutputs([p.TokenOutput(tokenized.rid, 0, ids, "stop", usage)]))
    [chunk] = [msgspec.msgpack.decode(client.recv(), type=p.ServerMessage) for _ in range(1) if client.poll(500)]
    assert chunk.token_ids == ids and chunk.finish_reason == "stop"
    assert chunk.text == smollm2_tokenizer.decode(ids[:-1])


def test_a_deeply_nested_frame_is_malformed_not_a_server_error():
    msg = p.decode_client_frame(b"\x91" * 100_000 + b"\x00", 8 << 20)
    assert isinstance(msg, p.ErrorResponse) and msg.code == p.ERR_MALFORMED


def make_tokenizer_server(ctx, name: str, tokenizer, num_blocks: int = 32, max_prompt_chars: int | None = None):
    """A TokenizerServer on inproc sockets: (server, client DEALER, the scheduler side Pair)."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(f"inproc://public-{name}")
    client = ctx.socket(zmq.DEALER)
    client.connect(f"inproc://public-{name}")
    to_sched = Pair(ctx, f"sched-{name}", p.SchedulerInput)
    ready = p.Ready(
        num_blocks=num_blocks, block_size=4, max_model_len=64, num_host_blocks=0, vocab_size=49152, eos_token_ids=[2]
    )
    server = TokenizerServer(tokenizer, ready, 65536, router, to_sched.push, max_prompt_chars=max_prompt_chars)
    return server, client, to_sched


def _replies(client) -> list:
    out = []
    while client.poll(100):
        out.append(msgspec.msgpack.decode(client.recv(), type=p.ServerMessage))
    return out


def _iterations(n: int):
    """alive() for serve_tokenizer: True n times (each loop iteration polls 0.5 s at most)."""
    left = [n]

    def alive() -> bool:
        left[0] -= 1
        return left[0] >= 0

    return alive


def test_tokenizer_loop_answers_a_handler_bug_and_its_last_resort_cannot_fail(ctx, smollm2_tokenizer):
    server, client, _to_sched = make_tokenizer_server(ctx, "boom", smollm2_tokenizer)
    from_sched = Pair(ctx, "tok-in-boom", p.TokenizerInput)
    handled: list[list[bytes]] = []

    def boom(frames: list[bytes]) -> None:
        handled.append(frames)
        raise RuntimeError("injected handler bug")

    server.on_client_frames = boom
    client.send(msgspec.msgpack.encode({"type": "generate", "rid": "r1", "prompt": "hi"}))
    serve_tokenizer(server, from_sched.pull, lambda: len(handled) < 1)
    reply = msgspec.msgpack.decode(client.recv(), type=p.ServerMessage)
    assert reply == p.ErrorResponse("r1", p.ERR_SERVER, "internal error handling the request")  # the rid recovered
    client.send(b"not msgpack")
    serve_tokenizer(server, from_sched.pull, lambda: len(handled) < 2)
    assert _replies(client) == [p.ErrorResponse("", p.ERR_SERVER, "internal error handling the request")]
    client.send(msgspec.msgpack.encode({"type": "generate", "rid": "r" * (p.MAX_RID_CHARS + 1), "prompt": "hi"}))
    serve_tokenizer(server, from_sched.pull, lambda: len(handled) < 3)  # an oversized rid is never echoed
    assert _replies(client) == [p.ErrorResponse("", p.ERR_SERVER, "internal error handling the request")]
    server.clients = None  # now answering raises too: the loop must still go on
    client.send(b"fourth")
    serve_tokenizer(server, from_sched.pull, lambda: len(handled) < 4)
    assert len(handled) == 4 and not client.poll(50)
    server.close()


HI = 26843  # "Hi" in the SmolLM2 tokenizer
THERE = 665  # " there"


def test_a_failing_output_fails_only_its_request_and_the_loop_goes_on(ctx, smollm2_tokenizer):
    """Feeding one request's TokenOutput raises: that request gets ERR_SERVER and is aborted at the scheduler; the
    other request of the same scheduler message streams on, unchanged."""
    server, client, to_sched = make_tokenizer_server(ctx, "feed-bug", smollm2_tokenizer)
    from_sched = Pair(ctx, "tok-in-feed-bug", p.TokenizerInput)
    for rid in ("a", "b"):
        client.send(msgspec.msgpack.encode(p.GenerateRequest(rid=rid, prompt="Hello", stream=True)))
        server.on_client_frames(server.router.recv_multipart())
    a, b = to_sched.drain()

    def broken_feed(out):
        raise RuntimeError("injected feed bug")

    server.in_flight.requests[a.rid].completions[0].feed = broken_feed
    usage = p.Usage(len(b.input_ids), 0, 2)
    from_sched.push.send(
        msgspec.msgpack.encode(
            p.TokenOutputs([p.TokenOutput(a.rid, 0, [HI], None), p.TokenOutput(b.rid, 0, [HI], None)])
        )
    )
    from_sched.push.send(msgspec.msgpack.encode(p.TokenOutputs([p.TokenOutput(b.rid, 0, [THERE], "length", usage)])))
    serve_tokenizer(server, from_sched.pull, _iterations(2))
    assert _replies(client) == [
        p.ErrorResponse("a", p.ERR_SERVER, "internal error handling the request's output"),
        p.StreamChunk(rid="b", text="Hi", token_ids=[HI]),
        p.StreamChunk(rid="b", text=" there", token_ids=[THERE], finish_reason="length", usage=usage),
    ]
    assert to_sched.drain() == [p.AbortRequest(a.rid)]
    assert server.in_flight.requests == {} and server.in_flight.by_client == {}
    server.close()


def test_the_loop_outlives_raising_scheduler_and_heartbeat_handlers(ctx, smollm2_tokenizer):
    server, client, _to_sched = make_tokenizer_server(ctx, "sched-bug", smollm2_tokenizer)
    from_sched = Pair(ctx, "tok-in-sched-bug", p.TokenizerInput)
    calls: list[str] = []

    def boom(*args):
        calls.append(type(args[0]).__name__)
        raise RuntimeError("injected handler bug")

    server.on_scheduler_message = boom
    server.heartbeat = boom
    server.in_flight.requests["x"] = None  # a request in flight: the loop heartbeats every iteration
    from_sched.push.send(msgspec.msgpack.encode(p.TokenOutputs([])))
    serve_tokenizer(server, from_sched.pull, _iterations(1))
    client.send(b"not msgpack")
    serve_tokenizer(server, from_sched.pull, _iterations(1))
    assert calls == ["TokenOutputs", "float", "float"]
    [reply] = _replies(client)
    assert reply.code == p.ERR_MALFORMED
    server.close()


def test_text_over_the_character_limit_is_rejected_before_tokenizing(ctx, smollm2_tokenizer):
    class Recording:
        def __init__(self):
            self.calls = 0

        def __getattr__(self, name):
            self.calls += 1
            return getattr(smollm2_tokenizer, name)

    tok = Recording()
    server, client, to_sched = make_tokenizer_server(ctx, "chars", tok, max_prompt_chars=100)
    long_chat = [{"role": "user", "content": "x" * 50}, {"role": "assistant", "content": "y" * 47}]  # 110 + 2 x 32
    for rid, inputs in (("p", {"prompt": "z" * 101}), ("m", {"messages": long_chat})):
        client.send(msgspec.msgpack.encode({"type": "generate", "rid": rid, **inputs}))
        server.on_client_frames(server.router.recv_multipart())
    assert _replies(client) == [
        p.ErrorResponse("p", p.ERR_INVALID, "prompt too long: 101 characters, the limit is 100 (max_prompt_chars)"),
        p.ErrorResponse(
            "m",
            p.ERR_INVALID,
            "messages too long: 174 characters (32 per message for the chat template "
            "included), the limit is 100 (max_prompt_chars)",
        ),
    ]
    assert tok.calls == 0 and to_sched.drain() == []
    client.send(msgspec.msgpack.encode({"type": "generate", "rid": "ok", "prompt": "z" * 100}))
    server.on_client_frames(server.router.recv_multipart())
    [forwarded] = to_sched.drain()
    assert forwarded.input_ids == smollm2_tokenizer.encode("z" * 100)
    default, _, _ = make_tokenizer_server(ctx, "chars-default", tok)
    assert default.prep.prompt_chars == 32 * 64  # None: 32 x max_model_len
    server.close()
    default.close()


def test_tokenizer_applies_the_one_prompt_check(ctx, smollm2_tokenizer):
    """The tokenizer rejects what Scheduler.add_request would, with the same code and message (prompt_check)."""
    from runtime.prompt_check import check_prompt

    server, client, to_sched = make_tokenizer_server(ctx, "check", smollm2_tokenizer, num_blocks=8)
    cases = {"vocab": [1, 49152], "context": [5] * 64, "pool": [5] * 29}  # 8 blocks: 7 usable x 4 tokens
    for rid, ids in cases.items():
        expected = check_prompt(ids, 64, 49152, 4, 8)
        client.send(msgspec.msgpack.encode({"type": "generate", "rid": rid, "input_ids": ids}))
        server.on_client_frames(server.router.recv_multipart())
        reply = msgspec.msgpack.decode(client.recv(), type=p.ServerMessage)
        assert (reply.rid, reply.code, reply.message) == (rid, *expected)
        sched = Scheduler(
            KVCacheManager(8, 4), ServerArgs(num_blocks=8, block_size=4), max_model_len=64, vocab_size=49152
        )
        with pytest.raises(RequestRejected) as info:
            sched.add_request(rid, ids, SamplingParams())
        assert (info.value.code, str(info.value)) == expected
    assert to_sched.drain() == []
