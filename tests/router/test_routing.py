"""Two replicas behind a router: cache_aware keeps a conversation on the replica that holds its prefix, with the
cached_tokens of a single replica; round_robin does not. The router answers like a replica (errors, stats, health)."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from router.text import ROUTER_TOKENIZE_CHARS, RouterTokenizer
from runtime import protocol as p
from runtime.client import ContextLengthError, InvalidRequestError
from tests.router.router_cases import conversation, prompt_tokens, start_router

SYSTEM = (
    "You are a careful assistant for a small bakery. Answer questions about bread, opening hours, "
    "ingredients and allergies in short, friendly sentences, and never invent prices you were not told."
)
USERS = [
    "Do you bake rye bread on Mondays?",
    "Which of your breads have no nuts at all?",
    "Can I order a birthday cake two days ahead?",
    "Thanks! When do you close on Saturday?",
]


@pytest.fixture(scope="module")
def reference(replicas):
    """The conversation served by one replica alone (its own cache_salt): cached_tokens per turn and replies."""
    cached, _served, texts = conversation(replicas[0].endpoint, SYSTEM, USERS, salt="single")
    return cached, texts


@pytest.fixture(scope="module")
def routers(replicas, tiny_llama_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router_logs")
    backends = [r.endpoint for r in replicas]
    out = {
        policy: start_router(tiny_llama_dir, backends, logs / f"{policy}.log", "--policy", policy)
        for policy in ("cache_aware", "round_robin")
    }
    yield out
    for proc in out.values():
        proc.stop()


def test_cache_aware_keeps_a_conversation_on_its_replica(replicas, routers, reference):
    ref_cached, ref_texts = reference
    assert ref_cached[0] == 0 and all(c > 0 for c in ref_cached[1:])
    cached, served, texts = conversation(routers["cache_aware"].endpoint, SYSTEM, USERS, "cache-aware", replicas)
    assert served == [served[0]] * len(USERS)  # every later turn on the replica of the first
    assert cached == ref_cached  # the single-replica figure, turn by turn
    assert texts == ref_texts


def test_round_robin_loses_the_prefix(replicas, routers, reference):
    ref_cached, ref_texts = reference
    cached, served, texts = conversation(routers["round_robin"].endpoint, SYSTEM, USERS, "round-robin", replicas)
    assert served[1] != served[0] and served[2] == served[0] and served[3] == served[1]
    assert cached[1] == 0 and ref_cached[1] > 0  # turn 2 lands on the replica that never saw this conversation
    assert cached[2] < ref_cached[2]  # turn 3 finds only turn 1's prefix
    assert texts == ref_texts


def test_router_answers_like_a_replica(replicas, routers, smollm2_tokenizer):
    endpoint = routers["cache_aware"].endpoint
    with replicas[0].client() as direct:
        ids = smollm2_tokenizer.encode("Hello from the router test.")
        want = direct.generate(input_ids=ids, max_tokens=5, temperature=0.0, ignore_eos=True)
    before = prompt_tokens(replicas)
    with routers["cache_aware"].client() as c:
        assert c.health() == "ok"
        got = c.generate(input_ids=ids, max_tokens=5, temperature=0.0, ignore_eos=True)
        assert got.token_ids == want.token_ids and got.text == want.text
        chunks = list(c.stream(prompt="Hello from the router test.", max_tokens=5, temperature=0.0, ignore_eos=True))
        assert sum(len(ch.token_ids) for ch in chunks) == 5 and chunks[-1].usage.completion_tokens == 5
        stats = c.stats()  # the sum over both replicas
        assert stats.prompt_tokens == sum(prompt_tokens(replicas))
        assert stats.prompt_tokens - sum(before) == len(ids) + chunks[-1].usage.prompt_tokens
        with pytest.raises(InvalidRequestError):
            c.generate(prompt="", max_tokens=2)
        with pytest.raises(ContextLengthError):  # checked by the replica, relayed under the client's rid
            c.generate(input_ids=[5] * 2000, max_tokens=2)
    sock = zmq.Context.instance().socket(zmq.DEALER)  # a frame no client library would send
    sock.connect(endpoint)
    sock.send(b"\xc1 not msgpack")
    assert sock.poll(10_000)
    reply = msgspec.msgpack.decode(sock.recv(), type=p.ServerMessage)
    sock.close(linger=0)
    assert isinstance(reply, p.ErrorResponse) and reply.code == p.ERR_MALFORMED


def test_router_answers_tokenize_and_detokenize_from_its_own_tokenizer(replicas, routers):
    """What a replica answers, so an HTTP server in front of the router needs no tokenizer (router/text.py)."""
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USERS[0]}]
    with replicas[0].client() as direct:
        ids = direct.tokenize(messages=chat)
        text = direct.detokenize(ids)
    with routers["cache_aware"].client() as c:
        assert c.tokenize(messages=chat) == ids
        assert c.detokenize(ids) == text
        assert c.tokenize(prompt="héllo world", add_special_tokens=False) == [88, 2756, 31394, 905]
        with pytest.raises(InvalidRequestError) as info:
            c.detokenize([7, -1])
        assert info.value.message == "token_ids[1] = -1 is outside the vocabulary [0, 49152)"
        with pytest.raises(InvalidRequestError) as info:
            c.tokenize(prompt="a" * (ROUTER_TOKENIZE_CHARS + 1))
        assert info.value.message == (
            f"prompt too long: {ROUTER_TOKENIZE_CHARS + 1} characters, the limit is {ROUTER_TOKENIZE_CHARS} "
            "(max_prompt_chars)"
        )
        with pytest.raises(InvalidRequestError) as info:
            c.detokenize([1] * (ROUTER_TOKENIZE_CHARS + 1))
        assert info.value.message == (
            f"too many token ids: {ROUTER_TOKENIZE_CHARS + 1}, the limit is 262144 (max_prompt_chars)"
        )


def test_a_router_without_a_tokenizer_answers_tokenize_with_an_error():
    none = RouterTokenizer(None)
    message = "this router has no tokenizer; ask a replica's endpoint"
    assert none.answer(p.TokenizeRequest(rid="t", prompt="hi")) == p.ErrorResponse("t", p.ERR_INVALID, message)
    assert none.answer(p.DetokenizeRequest("d", [1])) == p.ErrorResponse("d", p.ERR_INVALID, message)
    assert none.prompt_ids(p.GenerateRequest(rid="g", prompt="hi")) is None
