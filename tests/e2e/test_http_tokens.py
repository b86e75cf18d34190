"""The OpenAI-compatible HTTP server's token-level answers in front of a real server, through the real openai SDK:
logprobs name the tokens and alternatives exactly as the backend sends them, /tokenize and /detokenize answer the
backend's ids and text, and their errors keep the OpenAI shape (the HTTP process loads no tokenizer)."""

from __future__ import annotations

import json
import urllib.request

from tests.e2e.http_servers import MODEL, msgs, salt


def test_logprobs_are_the_backends(oai, zmq, smollm2_tokenizer):
    ref = zmq.generate(messages=msgs("logprobs"), max_tokens=5, temperature=0.0, logprobs=3, cache_salt=salt())
    r = oai.chat.completions.create(
        model=MODEL,
        messages=msgs("logprobs"),
        max_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"cache_salt": salt()},
    )
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [smollm2_tokenizer.decode([t]) for t in ref.token_ids]
    assert [e.logprob for e in content] == [lp.logprob for lp in ref.choices[0].logprobs]
    assert [[t.token for t in e.top_logprobs] for e in content] == [
        [smollm2_tokenizer.decode([t]) for t in lp.top_token_ids] for lp in ref.choices[0].logprobs
    ]
    assert [[t.logprob for t in e.top_logprobs] for e in content] == [lp.top_logprobs for lp in ref.choices[0].logprobs]
    assert content[0].bytes == list(content[0].token.encode())
    ref = zmq.generate(prompt="text logprobs", max_tokens=4, temperature=0.0, logprobs=2, cache_salt=salt())
    r = oai.completions.create(
        model=MODEL,
        prompt="text logprobs",
        max_tokens=4,
        temperature=0.0,
        logprobs=2,
        extra_body={"cache_salt": salt()},
    )
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == [x.logprob for x in ref.choices[0].logprobs]
    assert lp.tokens == [smollm2_tokenizer.decode([t]) for t in ref.token_ids]
    decode = smollm2_tokenizer.decode
    assert lp.top_logprobs == [
        {decode([t]): v for t, v in zip(x.top_token_ids, x.top_logprobs, strict=True)} for x in ref.choices[0].logprobs
    ]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


def test_streamed_logprobs_name_tokens_as_the_backend_sends_them(oai, zmq, smollm2_tokenizer):
    """Streamed, each chunk's logprobs name its tokens (and their alternatives) by the texts the backend sent with
    them: the tokenizer's decode of each id alone, bytes its UTF-8."""
    decode = smollm2_tokenizer.decode
    ref = zmq.generate(messages=msgs("stream lp"), max_tokens=5, temperature=0.0, logprobs=2, cache_salt=salt())
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=msgs("stream lp"),
        max_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"cache_salt": salt()},
    )
    content = [e for chunk in stream for e in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])]
    assert [e.token for e in content] == [decode([t]) for t in ref.token_ids]
    assert [e.bytes for e in content] == [list(decode([t]).encode()) for t in ref.token_ids]
    assert [[t.token for t in e.top_logprobs] for e in content] == [
        [decode([t]) for t in lp.top_token_ids] for lp in ref.choices[0].logprobs
    ]
    ref = zmq.generate(prompt="stream text lp", max_tokens=4, temperature=0.0, logprobs=1, cache_salt=salt())
    stream = oai.completions.create(
        model=MODEL,
        prompt="stream text lp",
        max_tokens=4,
        temperature=0.0,
        logprobs=1,
        stream=True,
        extra_body={"cache_salt": salt()},
    )
    tokens = []
    offsets = []
    expected = []
    before = 0  # characters of completion text before the chunk
    for choice in (c.choices[0] for c in stream):
        if choice.logprobs is not None:
            lp = choice.logprobs
            tokens += lp.tokens
            offsets += lp.text_offset
            expected += [before + sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]
        before += len(choice.text)
    assert tokens == [decode([t]) for t in ref.token_ids]
    assert offsets == expected


def test_tokenize_and_detokenize(http, oai, smollm2_tokenizer):
    messages = msgs("tokenize me")
    req = urllib.request.Request(
        http.url + "/tokenize",
        data=json.dumps({"messages": messages}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        chat_ids = json.loads(resp.read())
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0.0)
    assert chat_ids["count"] == len(chat_ids["tokens"]) == r.usage.prompt_tokens
    ids = smollm2_tokenizer.encode("héllo world")
    for path, body, expected in [
        ("/tokenize", {"prompt": "héllo world"}, {"count": len(ids), "tokens": ids}),
        ("/detokenize", {"tokens": ids}, {"prompt": "héllo world"}),
    ]:
        req = urllib.request.Request(http.url + path, data=json.dumps(body).encode())
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read()) == expected


def post_json(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_and_detokenize_errors_keep_their_openai_shape(http):
    """The backend answers /tokenize and /detokenize (this HTTP process has no tokenizer); its refusals are the 400s
    the routes gave when they tokenized here, to the field and the message."""
    limit = 32 * 1024  # the tiny model's context is 1024 tokens

    def error(message: str, param: str) -> dict:
        return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": "invalid_value"}}

    both = {"prompt": "x", "messages": msgs("x")}
    assert post_json(http.url + "/tokenize", both) == (
        400,
        error("exactly one of prompt and messages must be given", "prompt"),
    )
    assert post_json(http.url + "/tokenize", {"prompt": "a" * (limit + 1)}) == (
        400,
        error(f"prompt too long: {limit + 1} characters, the limit is {limit} (max_prompt_chars)", "prompt"),
    )
    assert post_json(http.url + "/detokenize", {"tokens": [5, 49152]}) == (
        400,
        error("tokens[1] = 49152 is outside the vocabulary [0, 49152)", "tokens[1]"),
    )
    assert post_json(http.url + "/detokenize", {"tokens": [-1]}) == (
        400,
        error("tokens[0] = -1 is outside the vocabulary [0, 49152)", "tokens[0]"),
    )
    assert post_json(http.url + "/tokenize", {"prompt": "", "add_special_tokens": False}) == (
        200,
        {"count": 0, "tokens": []},
    )
    assert post_json(http.url + "/detokenize", {"tokens": [1, 2]}) == (200, {"prompt": "<|im_start|><|im_end|>"})
