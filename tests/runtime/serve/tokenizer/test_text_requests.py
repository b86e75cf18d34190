"""The tokenizer process answers TokenizeRequest and DetokenizeRequest itself (runtime/serve/tokenizer/
text_requests.py): the ids of the generate path (encode_prompt, the chat template, add_special_tokens), the text of
ids with special tokens kept, each fault an exact ErrorResponse; a large one is answered off the loop in the client's
order, a vanished client's is dropped, and the scheduler never sees one."""

from __future__ import annotations

import pytest
import zmq

from runtime import protocol as p
from runtime.prompt_check import prompt_char_limit
from runtime.text.prompt import encode_prompt
from tests.runtime.serve.tokenizer.rig import READY, GatedTokenizer, Rig

CHAT = [p.ChatMessage("system", "You are terse."), p.ChatMessage("user", "tokenize me")]
LIMIT = prompt_char_limit(None, READY.max_model_len)  # 32 x 8192 characters (or ids)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_tokenize_gives_the_ids_of_the_generate_path(ctx, smollm2_tokenizer):
    rig = Rig(ctx, "tokenize", smollm2_tokenizer, ("A",))
    chat_ids = encode_prompt(smollm2_tokenizer, messages=CHAT)
    rig.send("A", p.TokenizeRequest(rid="chat", messages=CHAT))
    rig.send("A", p.TokenizeRequest(rid="text", prompt="héllo world"))
    rig.send("A", p.TokenizeRequest(rid="bare", prompt="<|im_start|>hi", add_special_tokens=False))
    rig.send("A", p.TokenizeRequest(rid="empty", prompt=""))
    assert rig.replies("A") == [
        p.TokenizeResponse("chat", chat_ids),
        p.TokenizeResponse("text", smollm2_tokenizer.encode("héllo world")),
        p.TokenizeResponse("bare", smollm2_tokenizer.encode("<|im_start|>hi", add_special_tokens=False)),
        p.TokenizeResponse("empty", []),
    ]
    # "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\ntokenize me<|im_end|>\n<|im_start|>assistant\n"
    assert chat_ids == [
        1,
        9690,
        198,
        2683,
        359,
        1733,
        313,
        30,
        2,
        198,
        1,
        4093,
        198,
        8087,
        836,
        549,
        2,
        198,
        1,
        520,
        9531,
        198,
    ]
    # the generate path sends exactly these ids to the scheduler
    rig.send("A", p.GenerateRequest(rid="gen", messages=CHAT))
    assert [m.input_ids for m in rig.forwarded()] == [chat_ids]
    rig.server.close()


def test_detokenize_gives_the_text_of_every_id(ctx, smollm2_tokenizer):
    rig = Rig(ctx, "detokenize", smollm2_tokenizer, ("A",))
    ids = smollm2_tokenizer.encode("héllo world")
    rig.send("A", p.DetokenizeRequest("d", ids))
    rig.send("A", p.DetokenizeRequest("special", [1, 9690, 2]))  # special tokens are kept
    rig.send("A", p.DetokenizeRequest("none", []))
    assert rig.replies("A") == [
        p.DetokenizeResponse("d", "héllo world"),
        p.DetokenizeResponse("special", "<|im_start|>system<|im_end|>"),
        p.DetokenizeResponse("none", ""),
    ]
    assert rig.forwarded() == []
    rig.server.close()


def test_each_fault_gets_its_exact_error(ctx, smollm2_tokenizer):
    rig = Rig(ctx, "faults", smollm2_tokenizer, ("A",))
    cases = [
        (p.TokenizeRequest(rid="both", prompt="x", messages=CHAT), "exactly one of prompt, messages must be set, "),
        (p.TokenizeRequest(rid="neither"), "exactly one of prompt, messages must be set, got none"),
        (p.TokenizeRequest(rid="no messages", messages=[]), "messages is empty"),
        (
            p.TokenizeRequest(rid="long", prompt="x" * (LIMIT + 1)),
            f"prompt too long: {LIMIT + 1} characters, the limit is {LIMIT} (max_prompt_chars)",
        ),
        (
            p.DetokenizeRequest("many", [1] * (LIMIT + 1)),
            f"too many token ids: {LIMIT + 1}, the limit is {LIMIT} (max_prompt_chars)",
        ),
        (p.DetokenizeRequest("vocab", [1, 49152, -1]), "token_ids[1] = 49152 is outside the vocabulary [0, 49152)"),
        (p.DetokenizeRequest("negative", [5, -1]), "token_ids[1] = -1 is outside the vocabulary [0, 49152)"),
        (p.DetokenizeRequest("huge", [2**64 - 1]), f"token_ids[0] = {2**64 - 1} is outside the vocabulary [0, 49152)"),
    ]
    for req, _message in cases:
        rig.send("A", req)
    rig.server.finish_prompts(10)
    replies = rig.replies("A")
    assert [(r.rid, r.code) for r in replies] == [(req.rid, p.ERR_INVALID) for req, _ in cases]
    assert replies[0].message == "exactly one of prompt, messages must be set, got ['prompt', 'messages']"
    assert [r.message for r in replies[1:]] == [message for _, message in cases[1:]]
    assert rig.forwarded() == [] and rig.server.text_clients == {}
    rig.server.close()


def test_a_large_request_waits_off_the_loop_in_its_clients_order(ctx, smollm2_tokenizer):
    tok = GatedTokenizer(smollm2_tokenizer)
    rig = Rig(ctx, "large", tok, ("A", "B"))
    big_ids = smollm2_tokenizer.encode(" hello" * 3000)  # 3,000 ids: decoded on the PromptWorker
    rig.send("A", p.TokenizeRequest(rid="big", prompt=" hello" * 2000))  # 12,000 characters: gated
    assert tok.started.wait(10)  # on the worker thread: the loop is free
    rig.send("A", p.DetokenizeRequest("after", [1]))  # cheap, but behind A's big one
    rig.send("A", p.DetokenizeRequest("ids", big_ids))
    rig.send("B", p.DetokenizeRequest("b", [1]))  # another client's cheap request goes straight through
    assert rig.replies("B") == [p.DetokenizeResponse("b", "<|im_start|>")]
    assert rig.replies("A") == []
    assert rig.server.waiting()  # A waits: heartbeats go on
    tok.gate.set()
    assert rig.server.finish_prompts(10) == 3
    assert rig.replies("A") == [
        p.TokenizeResponse("big", smollm2_tokenizer.encode(" hello" * 2000)),
        p.DetokenizeResponse("after", "<|im_start|>"),
        p.DetokenizeResponse("ids", " hello" * 3000),
    ]
    assert rig.server.text_clients == {} and not rig.server.waiting() and rig.forwarded() == []
    rig.server.close()


def test_a_vanished_clients_request_is_dropped_and_shutdown_answers_the_rest(ctx, smollm2_tokenizer):
    tok = GatedTokenizer(smollm2_tokenizer)
    rig = Rig(ctx, "vanish", tok, ("A", "B"))
    rig.send("A", p.TokenizeRequest(rid="big", prompt=" hello" * 2000))
    assert tok.started.wait(10)
    rig.send("B", p.TokenizeRequest(rid="queued", prompt=" hello" * 2000))
    rig.server.drop_client(b"A")  # what ClientFrontend does when a send to A fails
    rig.server.fail_all(p.ERR_SHUTDOWN, "the server is shutting down")
    assert rig.replies("B") == [p.ErrorResponse("queued", p.ERR_SHUTDOWN, "the server is shutting down")]
    tok.gate.set()
    assert rig.server.finish_prompts(10) == 2  # A's job ran, B's was cancelled: neither is answered
    assert rig.replies("A") == [] and rig.replies("B") == [] and rig.server.text_clients == {}
    rig.server.close()
