"""A client message's rid is bounded (MAX_RID_CHARS characters): a longer one is rejected with ERR_MALFORMED and rid
"" on every path of decode_client_frame (the server echoes a rid in every reply, so an unbounded one multiplied into
gigabytes), the tokenizer process answers it once and keeps nothing, and the client library refuses to build one."""

from __future__ import annotations

import msgspec
import pytest

from runtime import protocol as p
from runtime.client import InvalidInputError, build_request
from runtime.protocol.public import MAX_RID_CHARS
from runtime.serve.tokenizer.server import TokenizerServer


def enc(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


def rid_error(n: int) -> p.ErrorResponse:
    return p.ErrorResponse("", p.ERR_MALFORMED, f"rid of {n} characters exceeds 256")


def test_the_bound_is_256_characters_not_bytes():
    assert MAX_RID_CHARS == 256
    for rid in ("r" * 256, "é" * 256, "😀" * 256):  # 256, 512, 1024 UTF-8 bytes: all 256 characters
        msg = p.decode_client_frame(enc({"type": "generate", "rid": rid, "prompt": "hi"}), 1 << 20)
        assert isinstance(msg, p.GenerateRequest) and msg.rid == rid
    assert p.decode_client_frame(enc({"type": "generate", "rid": "é" * 257, "prompt": "hi"}), 1 << 20) == rid_error(257)


@pytest.mark.parametrize("tag", sorted(p.CLIENT_TAGS))
def test_every_client_message_rejects_a_longer_rid(tag):
    fields = {"prompt": "hi"} if tag == "generate" else {}
    assert p.decode_client_frame(enc({"type": tag, "rid": "r" * 256, **fields}), 1 << 20).rid == "r" * 256
    assert p.decode_client_frame(enc({"type": tag, "rid": "r" * 257, **fields}), 1 << 20) == rid_error(257)


LONG = "x" * 4000
REJECTION_PATHS = {  # each path that recovers a rid for its error: an oversized one is never echoed
    "over the size limit": ({"type": "generate", "rid": LONG, "prompt": "y" * 5000}, 4096),
    "rid after 8 MB, over the size limit": ({"type": "generate", "prompt": "y" * (8 << 20), "rid": LONG}, 4096),
    "unknown type": ({"type": "nope", "rid": LONG}, 1 << 20),
    "no type": ({"rid": LONG}, 1 << 20),
    "wrong field type": ({"type": "generate", "rid": LONG, "prompt": 5}, 1 << 20),
    "out-of-range sampling": (
        {"type": "generate", "rid": LONG, "prompt": "x", "sampling_params": {"max_tokens": 0}},
        1 << 20,
    ),
    "unknown field": ({"type": "stats", "rid": LONG, "extra": 1}, 1 << 20),
    "non-string key": ({1: 2, "rid": LONG}, 1 << 20),
}


@pytest.mark.parametrize("name", list(REJECTION_PATHS))
def test_no_rejection_path_echoes_an_oversized_rid(name):
    value, limit = REJECTION_PATHS[name]
    assert p.decode_client_frame(enc(value), limit) == rid_error(4000)


@pytest.fixture
def server(smollm2_tokenizer):
    class Router:
        def __init__(self) -> None:
            self.sent: list[list[bytes]] = []

        def send_multipart(self, parts: list[bytes], flags: int = 0, **kwargs) -> None:
            self.sent.append(list(parts))

    class Push:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def send(self, data: bytes, flags: int = 0, **kwargs) -> None:
            self.sent.append(data)

    ready = p.Ready(
        num_blocks=64, block_size=4, max_model_len=128, num_host_blocks=0, vocab_size=49152, eos_token_ids=[2]
    )
    router = Router()
    push = Push()
    return TokenizerServer(smollm2_tokenizer, ready, 1 << 20, router, push), router, push


def test_the_tokenizer_answers_a_long_rid_once_with_rid_empty_and_keeps_nothing(server):
    """The hostile case: a streamed n=64 request whose rid would be echoed in every chunk."""
    srv, router, push = server
    frame = enc(
        {
            "type": "generate",
            "rid": "z" * 100_000,
            "prompt": "Hi",
            "stream": True,
            "sampling_params": {"n": 64, "max_tokens": 64},
        }
    )
    srv.on_client_frames([b"c1", frame])
    assert router.sent == [[b"c1", enc(rid_error(100_000))]]
    assert push.sent == [] and srv.in_flight.requests == {} and srv.in_flight.by_client == {}


def test_the_client_refuses_to_build_a_longer_rid():
    assert build_request("r" * 256, "hi", None, None, False, None, {}).rid == "r" * 256
    with pytest.raises(InvalidInputError, match=r"^rid of 257 characters exceeds 256$"):
        build_request("r" * 257, "hi", None, None, False, None, {})
