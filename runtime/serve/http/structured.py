"""The structured-output fields of an OpenAI request -> one StructuredOutputs (runtime/structured_outputs.py) and the
request field it came from (named by a 400).

Accepted, at most one source per request (chat and completions alike, as vLLM accepts them):
    response_format: {"type": "text"} (no constraint), {"type": "json_object"}, {"type": "json_schema",
        "json_schema": {"name", "schema", "strict", "description"}} (OpenAI's; a missing schema is any JSON object).
    structured_outputs: vLLM's extra field {"json": <schema object or JSON text>, "regex", "choice", "grammar",
        "json_object", "structural_tag": <object or JSON text>}, exactly one set.
    guided_json, guided_regex, guided_choice, guided_grammar: vLLM's older names of the same.
Whether the schema / regex / grammar compiles is checked by the tokenizer process (a 400 naming this field).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from runtime.serve.http.errors import OpenAIError, bad_request
from runtime.structured_outputs import InvalidStructuredOutputs, StructuredOutputs

_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


class Constraint(NamedTuple):
    """A request's constraint and the request field it came from (e.g. "response_format.json_schema.schema")."""

    value: StructuredOutputs
    param: str


def request_constraint(req: Any) -> Constraint | None:
    """The constraint of a chat or completions request (None: unconstrained). O(size of the constraint).

    Raises OpenAIError (400): two sources given, a malformed response_format / structured_outputs / guided_* value,
    naming the field."""
    given = [name for name in ("response_format", "structured_outputs", *_GUIDED) if _is_set(name, req)]
    if len(given) > 1:
        raise bad_request(f"give at most one of {', '.join(given)}", given[1])
    if not given:
        return None
    name = given[0]
    value = getattr(req, name)
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    return _build({_GUIDED[name]: value}, name, name)


def _is_set(name: str, req: Any) -> bool:
    value = getattr(req, name, None)
    if name == "response_format":
        return value is not None and value != {"type": "text"}
    return value is not None


def _response_format(value: Any) -> Constraint:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("response_format must be an object with a string 'type'", "response_format", "invalid_type")
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise bad_request(f"unknown parameter 'response_format.{sorted(extra)[0]}'", "response_format")
    if kind == "json_object":
        return _build({"json_object": True}, "response_format", "response_format")
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind[:40]!r}",
            "response_format.type",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            "response_format.json_schema is required with type 'json_schema' (an object with name and schema)",
            "response_format.json_schema",
        )
    extra = set(spec) - _JSON_SCHEMA_KEYS
    if extra:
        param = f"response_format.json_schema.{sorted(extra)[0]}"
        raise bad_request(f"unknown parameter {param!r}", param, "unknown_parameter")
    schema = spec.get("schema")
    if schema is None:
        schema = {"type": "object"}
    return _build({"json": schema}, "response_format.json_schema.schema", "response_format.json_schema.schema")


def _structured_outputs(value: Any) -> Constraint:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs", "invalid_type")
    extra = set(value) - set(_SO_KEYS)
    if extra:
        param = f"structured_outputs.{sorted(extra)[0]}"
        raise bad_request(f"unknown parameter {param!r}", param, "unknown_parameter")
    fields = {k: v for k, v in value.items() if v is not None and v is not False}
    param = "structured_outputs"
    if len(fields) == 1:
        param = f"structured_outputs.{next(iter(fields))}"
    return _build(fields, param, "structured_outputs")


def _build(fields: dict[str, Any], param: str, prefix: str) -> Constraint:
    """StructuredOutputs(**fields), a JSON schema / structural tag object turned into its JSON text. prefix: what the
    field is called in the request, replacing "structured_outputs" in an error message."""
    for key in ("json", "structural_tag"):
        if isinstance(fields.get(key), (dict, list, bool)):
            fields[key] = json.dumps(fields[key])
    if "json" in fields and not isinstance(fields["json"], str):  # a number or null: no schema at all
        raise bad_request(
            f"{param} must be a JSON schema object (or its JSON text), got {type(fields['json']).__name__}",
            param,
            "invalid_type",
        )
    try:
        return Constraint(StructuredOutputs(**fields), param)
    except InvalidStructuredOutputs as exc:
        raise _error(str(exc), param, prefix) from None
    except TypeError as exc:  # a value of a type StructuredOutputs cannot hold
        raise bad_request(f"invalid {param}: {exc}", param, "invalid_type") from None


def _error(message: str, param: str, prefix: str) -> OpenAIError:
    """A 400 for message, its leading "structured_outputs.<field>" renamed to the request's param when the constraint
    came from another field (response_format, guided_*)."""
    return bad_request(rename(message, param) if prefix != "structured_outputs" else message, param)


def rename(message: str, param: str) -> str:
    """message with its first word renamed to param when that word is "structured_outputs.<field>" (an error of
    runtime.structured_outputs or of the compile check, told in the request's own field names)."""
    head, sep, rest = message.partition(" ")
    if head.startswith("structured_outputs."):
        return param + sep + rest
    return message
