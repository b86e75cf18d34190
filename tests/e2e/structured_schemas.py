"""The JSON schemas of the structured-output e2e tests (tests/e2e/test_http_structured.py): nested objects, arrays
with minItems / maxItems, enums, numbers with minimum / maximum, required and optional fields, string patterns.
Strings carry a maxLength so a sampled completion ends well inside max_tokens."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 16}

SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "address": {
        "type": "object",
        "properties": {
            "street": NAME,
            "city": {
                "type": "object",
                "properties": {"name": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["name", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["street", "city"],
        "additionalProperties": False,
    },
    "tags": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "measure": {
        "type": "object",
        "properties": {
            "value": {"type": "number", "minimum": -10.5, "maximum": 10.5},
            "unit": {"enum": ["cm", "m", "km"]},
        },
        "required": ["value", "unit"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "note": NAME,
            "done": {"type": "boolean"},
        },
        "required": ["id", "done"],
        "additionalProperties": False,
    },
    "code": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "valid": {"type": "boolean"}},
        "required": ["code", "valid"],
        "additionalProperties": False,
    },
    "matrix": {
        "type": "array",
        "items": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 2,
            "maxItems": 2,
        },
        "minItems": 2,
        "maxItems": 3,
    },
    "order": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            },
            "status": {"enum": ["open", "paid", "shipped"]},
        },
        "required": ["items", "status"],
        "additionalProperties": False,
    },
}

PROMPTS: dict[str, str] = {
    "person": "Describe a fictional person as JSON with a name and an age.",
    "address": "Give a made-up street address as JSON.",
    "tags": "Pick some colours as JSON tags.",
    "measure": "Give a length measurement as JSON.",
    "optional": "Give a to-do item as JSON.",
    "code": "Give a product code as JSON.",
    "matrix": "Write a small matrix of digits as a JSON array of arrays.",
    "order": "Write a shop order as JSON.",
}
