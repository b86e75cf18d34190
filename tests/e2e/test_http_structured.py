"""Structured outputs through the OpenAI-compatible HTTP server, driven by the real openai SDK, in front of the real
SmolLM2-135M (float32): JSON schemas (8 schemas, 40 requests, greedy and seeded temperature 1), the SDK's parse with a
pydantic model, json_object, regex, choice, EBNF and a structural tag through vLLM's fields, "length" at a small
max_tokens, and a 400 naming the field for a constraint that does not compile, with the server serving on."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.http_servers import assert_idle, start_http
from tests.e2e.structured_schemas import PROMPTS, SCHEMAS

MODEL = "smollm2"
REGEX = r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}"


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def http(smol_server, tmp_path_factory):
    server = start_http(smol_server.endpoint, tmp_path_factory.mktemp("logs") / "http.log", "--model", MODEL)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def oai(http):
    with http.openai() as client:
        yield client


@pytest.fixture(scope="module")
def zmq(smol_server):
    with smol_server.client() as c:
        yield c


def chat(oai, text: str, **kw):
    kw.setdefault("max_tokens", 100)
    kw.setdefault("temperature", 0.0)
    return oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], **kw).choices[0]


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.slow
def test_json_schemas_greedy_and_sampled(http, zmq, wait_idle):
    async def one(client, name: str, seed: int | None):
        temperature = 0.0 if seed is None else 1.0
        r = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPTS[name]}],
            max_tokens=300,
            temperature=temperature,
            seed=seed,
            response_format=schema_format(name),
        )
        return name, r.choices[0]

    async def run():
        client = openai.AsyncOpenAI(base_url=http.url + "/v1", api_key="none", max_retries=0, timeout=1200)
        async with client:
            jobs = [one(client, name, seed) for name in SCHEMAS for seed in (None, 1, 2, 3, 4)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    assert len(results) == 40 and len(SCHEMAS) == 8
    for name, choice in results:
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    sampled = [c.message.content for n, c in results if n == "person"]
    assert len(set(sampled)) > 1  # the seeded temperature-1 rows do sample
    assert_idle(zmq, wait_idle)


def test_parse_returns_the_pydantic_object(oai):
    completion = oai.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a fictional person with a name and an age."}],
        response_format=Person,
        max_tokens=100,
        temperature=0.0,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person)
    assert message.parsed == Person.model_validate_json(message.content)


def test_json_object(oai):
    choice = chat(oai, "Give me a JSON object about a cat.", response_format={"type": "json_object"}, max_tokens=200)
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)
    plain = chat(oai, "Say hi.", response_format={"type": "text"}, max_tokens=5)
    assert plain.finish_reason == "length"  # text: no constraint, as if not given


def test_regex_choice_grammar_and_the_older_names(oai):
    regex = chat(oai, "Tell me about a dog.", extra_body={"structured_outputs": {"regex": REGEX}})
    assert regex.finish_reason == "stop" and re.fullmatch(REGEX, regex.message.content)
    old = chat(oai, "Tell me about a dog.", extra_body={"guided_regex": REGEX})
    assert old.message.content == regex.message.content
    for body in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}):
        choice = chat(oai, "Is the sky blue?", extra_body=body)
        assert choice.message.content in ("yes", "no") and choice.finish_reason == "stop"
    grammar = 'root ::= "The answer is " [0-9] [0-9]? "."'
    for body in ({"structured_outputs": {"grammar": grammar}}, {"guided_grammar": grammar}):
        out = chat(oai, "What is 6 times 7?", extra_body=body).message.content
        assert re.fullmatch(r"The answer is [0-9]{1,2}\.", out)
    completion = oai.completions.create(
        model=MODEL,
        prompt="My favourite colour is",
        max_tokens=20,
        temperature=0.0,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS["tags"]}}
        },
    ).choices[0]
    jsonschema.validate(json.loads(completion.text), SCHEMAS["tags"])


def test_structural_tag(oai):
    inner = SCHEMAS["person"]
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<person>",
            "content": {"type": "json_schema", "json_schema": inner},
            "end": "</person>",
        },
    }
    out = chat(oai, "Describe a person.", extra_body={"structured_outputs": {"structural_tag": tag}}).message.content
    assert out.startswith("<person>") and out.endswith("</person>")
    jsonschema.validate(json.loads(out[len("<person>") : -len("</person>")]), inner)


def test_max_tokens_too_small_ends_with_length(oai):
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format=schema_format("order"),
        max_tokens=5,
        temperature=0.0,
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert '{"items": [{"sku": "'.startswith(r.choices[0].message.content)  # the grammar's forced start, cut short


@pytest.mark.parametrize(
    ("kw", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
            "response_format.json_schema.schema",
            "does not compile",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "structured_outputs.regex", "parenthesis"),
        ({"extra_body": {"guided_grammar": "root ::= missing"}}, "guided_grammar", "not defined"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs", "exactly one"),
        ({"extra_body": {"structured_outputs": {"jsonn": "{}"}}}, "structured_outputs.jsonn", "unknown"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex", "at most"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}},
            "response_format",
            "ignore_eos",
        ),
        ({"extra_body": {"guided_choice": ["yes"], "min_tokens": 5}}, "guided_choice", "min_tokens"),  # was a 500
        ({"extra_body": {"guided_regex": r"ab[^\s\S]"}}, "guided_regex", "allows no token"),  # was a 500
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(oai, zmq, wait_idle, kw, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, "Hello", **kw)
    body = err.value.body
    assert body["param"] == param, body
    assert words in body["message"], body
    assert chat(oai, "Hello", max_tokens=2).finish_reason == "length"  # the server serves on
    assert_idle(zmq, wait_idle)
