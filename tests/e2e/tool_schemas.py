"""Function tools for the tool-calling e2e tests: parameter schemas with enums, bounded integers, nested objects,
bounded arrays and string patterns, and a question each that invites its call."""

from __future__ import annotations

from typing import Any


def tool(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


WEATHER = tool(
    "get_weather",
    "Get the current weather in a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
ADD = tool(
    "add",
    "Add two integers between -1000 and 1000",
    {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
)
BOOK = tool(
    "book_table",
    "Book a restaurant table",
    {
        "type": "object",
        "properties": {
            "restaurant": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
            "guests": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
            "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
        },
        "required": ["restaurant", "guests", "time"],
        "additionalProperties": False,
    },
)
TOOLS = [WEATHER, ADD, BOOK]
QUESTIONS = {
    "get_weather": "What is the weather in Paris?",
    "add": "What is 12 plus 30?",
    "book_table": "Book a table at Chez Anna for Ann and Bob at 19:30.",
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
