"""The prompt in HTTP answers (runtime/serve/http/echo.py), exact shapes: vLLM's prompt_logprobs, the legacy
logprobs of completions' echo, and a choice with the prompt put first."""

from __future__ import annotations

from runtime import protocol as p
from runtime.serve.http.echo import add_echo, echo_logprobs, prompt_logprobs_body

PROMPT = p.PromptLogprobs(
    0,
    [11, 22, 33],
    [None, p.TokenLogprobs(-2.0, [44, 22], [-0.5, -2.0]), p.TokenLogprobs(-0.25, [33, 44], [-0.25, -3.0])],
    [0, 2, 1],
)
TEXTS = [p.TokenText("A", []), p.TokenText(" b", [" d", " b"]), p.TokenText(" c", [" c", " d"])]


def test_prompt_logprobs_body_is_vllms_shape():
    assert prompt_logprobs_body(PROMPT, TEXTS, 1) == [
        None,
        {
            "22": {"logprob": -2.0, "rank": 2, "decoded_token": " b"},
            "44": {"logprob": -0.5, "rank": 1, "decoded_token": " d"},
        },
        {"33": {"logprob": -0.25, "rank": 1, "decoded_token": " c"}},
    ]
    named = prompt_logprobs_body(PROMPT, None, 0)  # no texts from the backend: vLLM's "token_id:<id>"
    assert named[1] == {"22": {"logprob": -2.0, "rank": 2, "decoded_token": "token_id:22"}}


def test_echo_puts_the_prompt_first_with_a_null_first_logprob():
    part = echo_logprobs(PROMPT, TEXTS, 1)
    assert part == {
        "tokens": ["A", " b", " c"],
        "token_logprobs": [None, -2.0, -0.25],
        "top_logprobs": [None, {" b": -2.0, " d": -0.5}, {" c": -0.25}],
        "text_offset": [0, 1, 3],
    }
    choice = {
        "index": 0,
        "text": " e",
        "logprobs": {"tokens": [" e"], "token_logprobs": [-1.0], "top_logprobs": [{" e": -1.0}], "text_offset": [0]},
    }
    add_echo(choice, "A b c", part)
    assert choice["text"] == "A b c e"
    assert choice["logprobs"]["tokens"] == ["A", " b", " c", " e"]
    assert choice["logprobs"]["token_logprobs"] == [None, -2.0, -0.25, -1.0]
    assert choice["logprobs"]["text_offset"] == [0, 1, 3, 5]
    bare = {"index": 0, "text": "", "logprobs": None}
    add_echo(bare, "A b c", None)
    assert bare == {"index": 0, "text": "A b c", "logprobs": None}
