"""Fuzz of the public endpoint's reader: msgpack values of every shape, maps shaped like each client message with
random values in each field, hand-built maps with keys of any shape, and random bytes. decode_client_frame must return
a ClientMessage or an ErrorResponse for each (never raise) and keep the rid of any map with a string "rid"; the
tokenizer process's frame handler (TokenizerServer.on_client_frames, on stub sockets) must never raise, answer every
bad frame with exactly one ErrorResponse, and every tokenize / detokenize request with exactly one answer (the ids or
text, or its ERR_INVALID)."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from runtime import protocol as p
from runtime.sampling_params import InvalidSamplingParams, SamplingParams
from runtime.serve.tokenizer.server import TokenizerServer
from runtime.text.prompt import encode_prompt

MSGPACK_INT = (-(2**63), 2**64 - 1)  # what a msgpack frame can carry; beyond it the client refuses to encode
BOUNDARY_INTS = [
    -(2**63),
    -(2**31) - 1,
    -2,
    -1,
    0,
    1,
    20,
    21,
    64,
    65,
    1024,
    1025,
    2**31 - 1,
    2**31,
    2**63 - 1,
    2**63,
    2**64 - 1,
]


def _clamp(x: int) -> int:
    return max(MSGPACK_INT[0], min(MSGPACK_INT[1], x))


ints = st.integers(-(2**70), 2**70).map(_clamp) | st.sampled_from(BOUNDARY_INTS)
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e-30, 1e-45, 5e-324, -0.0, 1e5, 1e308])
scalars = (
    st.none()
    | st.booleans()
    | ints
    | floats
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=8))
)
keys = st.text(max_size=8) | ints | st.binary(max_size=4) | st.none() | st.booleans() | st.floats(allow_nan=False)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(keys | st.sampled_from(["rid", "type", "prompt"]), children, max_size=4)
    ),
    max_leaves=12,
)


# Each field's value of the right wire type (in range or not).
_typed_sampling = {
    "max_tokens": ints,
    "temperature": floats | ints,
    "top_k": ints,
    "top_p": floats,
    "min_p": floats,
    "seed": ints | st.none(),
    "stop": st.lists(st.text(max_size=6), max_size=70),
    "stop_token_ids": st.lists(ints, max_size=6),
    "ignore_eos": st.booleans(),
    "n": ints,
    "logprobs": ints | st.none(),
}
_typed_chat = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool"]), "content": st.text(max_size=20)}
    ),
    max_size=3,
)
_typed_generate = {
    "prompt": st.text(max_size=40),
    "messages": _typed_chat,
    "input_ids": st.lists(st.integers(-2, 49_200) | ints, max_size=12),
    "sampling_params": st.fixed_dictionaries({}, optional=_typed_sampling),
    "stream": st.booleans(),
    "cache_salt": st.text(max_size=6) | st.none(),
}


def _shaped(typed: dict[str, st.SearchStrategy], extra: str) -> dict[str, st.SearchStrategy]:
    """Each field either of its type or anything at all, plus an unknown field."""
    return {**{name: strategy | values for name, strategy in typed.items()}, extra: values}


rids = st.text(max_size=6) | values
_generate_any = {
    **_shaped(_typed_generate, "extra"),
    "sampling_params": st.fixed_dictionaries({}, optional=_shaped(_typed_sampling, "colour")) | values,
    "messages": st.lists(st.fixed_dictionaries({}, optional={"role": values, "content": values}), max_size=2)
    | _typed_chat
    | values,
}
generate = st.fixed_dictionaries(
    {"type": st.just("generate"), "rid": st.text(max_size=6)}, optional=_typed_generate
) | st.fixed_dictionaries({"type": st.just("generate"), "rid": rids}, optional=_generate_any)
_in_range_sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(1, 2**31 - 1),
        "temperature": st.floats(0, 2) | st.just(1e-30),
        "top_k": st.integers(-1, 99),
        "stop": st.lists(st.text(min_size=1, max_size=6), max_size=64),
        "stop_token_ids": st.lists(st.integers(0, 99)),
        "n": st.integers(1, 4),
        "logprobs": st.integers(0, 20) | st.none(),
    },
)
_servable_inputs = {
    "prompt": st.text(min_size=1, max_size=40),
    "messages": _typed_chat.filter(bool),
    "input_ids": st.lists(st.integers(0, 49_151), min_size=1, max_size=12),
}
servable = st.sampled_from(sorted(_servable_inputs)).flatmap(
    lambda field: st.fixed_dictionaries(
        {"type": st.just("generate"), "rid": st.text(min_size=1, max_size=12), field: _servable_inputs[field]},
        optional={"sampling_params": _in_range_sampling, "stream": st.booleans(), "cache_salt": st.text(max_size=6)},
    )
)
_typed_tokenize = {"prompt": st.text(max_size=40), "messages": _typed_chat, "add_special_tokens": st.booleans()}
tokenize = st.fixed_dictionaries(
    {"type": st.just("tokenize"), "rid": st.text(max_size=6)}, optional=_typed_tokenize
) | st.fixed_dictionaries({"type": st.just("tokenize"), "rid": rids}, optional=_shaped(_typed_tokenize, "extra"))
_typed_ids = st.lists(st.integers(-2, 49_200) | ints, max_size=12)
detokenize = st.fixed_dictionaries(
    {"type": st.just("detokenize"), "rid": st.text(max_size=6), "token_ids": _typed_ids}
) | st.fixed_dictionaries(
    {"type": st.just("detokenize"), "rid": rids}, optional=_shaped({"token_ids": _typed_ids}, "extra")
)
_control_tags = st.sampled_from(sorted(p.CLIENT_TAGS - {"generate", "tokenize", "detokenize"}))
control = st.fixed_dictionaries({"type": _control_tags, "rid": st.text(max_size=6)}) | st.fixed_dictionaries(
    {"type": _control_tags | values}, optional={"rid": rids, "extra": values}
)
messages = generate | tokenize | detokenize | control | values


def _map_frame(pairs: list[tuple[object, object]]) -> bytes:
    """A msgpack map of these pairs, built by hand: keys may be maps (unhashable) and may repeat."""
    return bytes([0x80 | len(pairs)]) + b"".join(
        msgspec.msgpack.encode(k) + msgspec.msgpack.encode(v) for k, v in pairs
    )


frames = (
    messages.map(msgspec.msgpack.encode)
    | st.binary(max_size=64)
    | st.lists(st.tuples(values, values), max_size=4).map(_map_frame)
)


def expected_rid(value: object) -> str | None:
    """The rid the reply must carry: the map's string "rid" ("" if it has none); None when value is not a map."""
    if not isinstance(value, dict):
        return None
    rid = value.get("rid")
    return rid if isinstance(rid, str) else ""


def check_decoded(value: object, frame: bytes) -> None:
    """decode_client_frame's contract on frame (the encoding of value; value None: a hand-built or random frame)."""
    out = p.decode_client_frame(frame, 1 << 20)
    assert isinstance(out, (p.ErrorResponse, *p.ClientMessage.__args__))
    event(out.code if isinstance(out, p.ErrorResponse) else type(out).__name__)
    if isinstance(out, p.ErrorResponse):
        assert out.code in p.ERROR_CODES and out.message
    over = p.decode_client_frame(frame, max(len(frame) - 1, 0))
    assert over.code == p.ERR_TOO_LARGE or not frame
    rid = expected_rid(value)
    if rid is None:
        return
    assert out.rid == rid
    if isinstance(out, p.ErrorResponse) and out.code == p.ERR_INVALID:  # the range check, and only it, said no
        assert out.message.startswith("invalid sampling_params: ")
        with pytest.raises(InvalidSamplingParams):
            SamplingParams(**value["sampling_params"])
    if isinstance(out, p.GenerateRequest) and "sampling_params" in value:  # in range on the wire: in range here
        assert SamplingParams(**value["sampling_params"]) == out.sampling_params
    # over the size limit only the rid is read, and only from a map whose keys are all strings
    assert over.rid == (rid if all(isinstance(k, str) for k in value) else "")


@pytest.mark.slow
@settings(max_examples=600, deadline=None)
@given(
    messages.map(lambda value: (value, msgspec.msgpack.encode(value)))
    | (st.binary(max_size=64) | st.lists(st.tuples(values, values), max_size=4).map(_map_frame)).map(
        lambda frame: (None, frame)
    )
)
def test_decode_client_frame_is_total_on_every_msgpack_value_and_any_bytes(case):
    value, frame = case
    check_decoded(value, frame)


class StubRouter:
    """The public ROUTER: records every [identity, frame] sent."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, parts: list[bytes], flags: int = 0, **kwargs) -> None:
        self.sent.append(list(parts))


class StubPush:
    """The PUSH to the scheduler: records every frame sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes, flags: int = 0, **kwargs) -> None:
        self.sent.append(data)


@pytest.fixture(scope="module")
def stub_server(smollm2_tokenizer):
    ready = p.Ready(
        num_blocks=64, block_size=4, max_model_len=128, num_host_blocks=0, vocab_size=49152, eos_token_ids=[2]
    )
    router = StubRouter()
    push = StubPush()
    return TokenizerServer(smollm2_tokenizer, ready, 4096, router, push), router, push


_reply_decoder = msgspec.msgpack.Decoder(p.ServerMessage)
_identities = itertools.count()


def check_text_answer(tokenizer, req: p.TokenizeRequest | p.DetokenizeRequest, reply: p.ServerMessage) -> None:
    """The one reply to a tokenize / detokenize request: the generate path's ids or the text of the ids, else the
    ERR_INVALID its fault gets (the stub server's limit is 32 x 128 characters; no fuzzed text reaches it)."""
    assert reply.rid == req.rid
    if isinstance(req, p.DetokenizeRequest):
        bad = [i for i, t in enumerate(req.token_ids) if not 0 <= t < 49152]
        if bad:
            i = bad[0]
            message = f"token_ids[{i}] = {req.token_ids[i]} is outside the vocabulary [0, 49152)"
            assert reply == p.ErrorResponse(req.rid, p.ERR_INVALID, message)
        else:
            assert reply == p.DetokenizeResponse(req.rid, tokenizer.decode(req.token_ids))
        return
    if (req.prompt is None) == (req.messages is None) or req.messages == []:
        assert isinstance(reply, p.ErrorResponse) and reply.code == p.ERR_INVALID
    elif isinstance(reply, p.TokenizeResponse):
        special = req.add_special_tokens
        assert reply.token_ids == encode_prompt(tokenizer, req.prompt, req.messages, add_special_tokens=special)
    else:  # a chat template or text the tokenizer refuses
        assert isinstance(reply, p.ErrorResponse) and reply.code == p.ERR_INVALID


@settings(max_examples=250, deadline=None)
@given(
    frame=st.one_of(servable, servable, servable, generate, tokenize, detokenize, control).map(msgspec.msgpack.encode)
    | frames,
    extra=st.sampled_from([[]] * 6 + [[b""], [b"x", b"yz"]]),
)  # frames after the payload: several is malformed
def test_tokenizer_handler_survives_and_answers_each_bad_frame_once(stub_server, frame, extra):
    server, router, push = stub_server
    router.sent.clear()
    push.sent.clear()
    identity = f"client-{next(_identities)}".encode()  # a new client per example: no rid is in flight for it
    server.on_client_frames([identity, frame, *extra])
    server.finish_prompts(10)  # whatever went to the PromptWorker (nothing fuzzed is that large) is answered now
    replies = [(ident, _reply_decoder.decode(data)) for ident, data in router.sent]
    event(f"replies {[getattr(m, 'code', type(m).__name__) for _, m in replies]}, {len(push.sent)} to the scheduler")
    assert all(ident == identity for ident, _ in replies)
    decoded = p.decode_client_frame(frame, server.max_message_bytes)
    if extra:  # several frames in one message
        assert [msg for _, msg in replies] == [
            p.ErrorResponse("", p.ERR_MALFORMED, f"expected 1 frame, got {1 + len(extra)}")
        ]
    elif isinstance(decoded, p.ErrorResponse):
        assert [msg for _, msg in replies] == [decoded] and push.sent == []
    elif isinstance(decoded, p.GenerateRequest):  # served (later) or rejected now: at most one reply, an error
        assert len(replies) <= 1 and all(isinstance(msg, p.ErrorResponse) for _, msg in replies)
        assert all(msg.rid == decoded.rid for _, msg in replies)
    elif isinstance(decoded, p.AbortRequest):  # nothing back; the scheduler is told if the rid was in flight
        assert replies == [] and len(push.sent) <= 1
    elif isinstance(decoded, (p.TokenizeRequest, p.DetokenizeRequest)):  # answered here, once; never forwarded
        assert len(replies) == 1 and push.sent == []
        check_text_answer(server.prep.tokenizer, decoded, replies[0][1])
    else:  # control: forwarded to the scheduler, answered from there
        assert replies == [] and len(push.sent) == 1
