"""The structured-output fields of an OpenAI request mapped onto SamplingParams.structured_outputs
(runtime/serve/http/structured.py), without a server: each accepted spelling, and the 400 naming the field of each
malformed one."""

from __future__ import annotations

import json

import orjson
import pytest

from runtime import protocol as p
from runtime.client.errors import InvalidRequestError
from runtime.serve.http.errors import OpenAIError, from_exception
from runtime.serve.http.openai_schema import ChatCompletionRequest, CompletionRequest, decode
from runtime.serve.http.request_map import chat_request, completion_requests
from runtime.structured_outputs import StructuredOutputs

MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def mapped(body: dict, cls=ChatCompletionRequest):
    req = decode(orjson.dumps({"messages": MSG, **body} if cls is ChatCompletionRequest else body), cls)
    if cls is ChatCompletionRequest:
        backend = chat_request(req, "r")
    else:
        (backend,) = completion_requests(req, "r")
    return backend.sampling_params.structured_outputs, backend.param_names.get("structured_outputs")


@pytest.mark.parametrize(
    ("body", "expected", "param"),
    [
        ({}, None, None),
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True), "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputs(json=json.dumps(SCHEMA)),
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            StructuredOutputs(json='{"type": "object"}'),
            "response_format.json_schema.schema",
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            StructuredOutputs(json=json.dumps(SCHEMA)),
            "structured_outputs.json",
        ),
        ({"structured_outputs": {"json": '{"type": "string"}'}}, StructuredOutputs(json='{"type": "string"}'), None),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutputs(regex="a+"), "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputs(choice=["a", "b"]), None),
        ({"structured_outputs": {"grammar": "root ::= x"}}, StructuredOutputs(grammar="root ::= x"), None),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputs(json_object=True), None),
        ({"structured_outputs": {"structural_tag": {"a": 1}}}, StructuredOutputs(structural_tag='{"a": 1}'), None),
        ({"guided_json": SCHEMA}, StructuredOutputs(json=json.dumps(SCHEMA)), "guided_json"),
        ({"guided_regex": "a+"}, StructuredOutputs(regex="a+"), "guided_regex"),
        ({"guided_choice": ["a"]}, StructuredOutputs(choice=["a"]), "guided_choice"),
        ({"guided_grammar": "root ::= x"}, StructuredOutputs(grammar="root ::= x"), "guided_grammar"),
    ],
)
def test_each_spelling_maps_onto_one_constraint(body, expected, param):
    so, name = mapped(body)
    assert so == expected
    if param is not None:
        assert name == param


def test_completions_take_the_same_fields():
    so, name = mapped({"prompt": "x", "guided_regex": "a+"}, CompletionRequest)
    assert so == StructuredOutputs(regex="a+") and name == "guided_regex"
    so, _ = mapped({"prompt": "x", "response_format": {"type": "json_object"}}, CompletionRequest)
    assert so == StructuredOutputs(json_object=True)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "got 'yaml'"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "is required"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
            "response_format.json_schema.x",
            "unknown",
        ),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "is empty"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
        ({"guided_regex": ""}, "guided_regex", "guided_regex is empty"),
        ({"guided_choice": "a"}, "guided_choice", "guided_choice must be a non-empty list"),
        # a schema of 5 said "must be a string, got int" (a schema is an object; its JSON text is taken too)
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
            "response_format.json_schema.schema",
            "must be a JSON schema object",
        ),
        ({"guided_json": 5}, "guided_json", "guided_json must be a JSON schema object"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
        ({"guided_regex": "a", "use_beam_search": True, "n": 2}, "guided_regex", "use_beam_search"),
    ],
)
def test_malformed_constraints_are_a_400_naming_the_field(body, param, words):
    with pytest.raises(OpenAIError) as err:
        mapped(body)
    assert err.value.status == 400
    assert err.value.param == param, err.value.message
    assert words in err.value.message


def test_a_compile_error_from_the_backend_names_the_request_field():
    exc = InvalidRequestError("r", p.ERR_INVALID, "structured_outputs.json does not compile: Type should be a string")
    err = from_exception(exc, {"structured_outputs": "response_format.json_schema.schema"}, "messages")
    assert err.param == "response_format.json_schema.schema"
    assert err.message == "response_format.json_schema.schema does not compile: Type should be a string"
    plain = from_exception(InvalidRequestError("r", p.ERR_INVALID, "bad prompt"), {}, "messages")
    assert plain.param == "messages"
