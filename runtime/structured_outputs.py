"""StructuredOutputs: the constraint one request's completion must satisfy (a JSON schema, a regex, a choice, a
grammar), in vLLM's `structured_outputs` names. Plain msgspec Struct, no torch, validated at construction.

It rides in SamplingParams.structured_outputs from every front door (the HTTP server's response_format,
structured_outputs and guided_* fields, the Engine, the ZeroMQ client) to the process that compiles it into a
grammar (xgrammar) and masks the logits of the request's rows each step. Whether a constraint compiles is checked by
runtime.model.grammar.convert.check_compiles at the front doors (the tokenizer process, the Engine).
"""

from __future__ import annotations

import msgspec

MAX_SPEC_CHARS = 1_000_000  # characters of one schema / regex / grammar / structural tag (its JSON text)
MAX_CHOICES = 1024  # strings of a `choice` constraint
MAX_CHOICE_CHARS = 100_000  # characters over all of a `choice` constraint's strings
# the start of the worker's error for a sequence whose constraint allows no next token (e.g. the regex "[^\s\S]"):
# its request fails as invalid (a 400 naming the constraint's field), not as a server error (runtime.scheduler.finish)
NO_TOKEN = "structured_outputs allows no token"
GRAMMAR_PENDING = "GrammarPending"  # a worker's failure of a sequence whose grammar still compiles: it is requeued
GRAMMAR_WAIT_S = 0.05  # seconds a step waits for the compiles of its sampling sequences before requeueing them


class InvalidStructuredOutputs(ValueError):
    """A structured-output constraint is malformed; the message names the field."""


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Exactly one constraint (vLLM's StructuredOutputsParams fields):

        json: a JSON schema, as JSON text: the completion is one JSON value valid against it.
        regex: the completion matches this regular expression (whole-string match).
        choice: the completion is exactly one of these strings (non-empty list of non-empty strings).
        grammar: an EBNF grammar (xgrammar's / GBNF syntax) whose `root` rule the completion matches.
        json_object: True: the completion is any one JSON object (OpenAI's response_format json_object).
        structural_tag: an xgrammar structural tag, as JSON text (free text with constrained regions, e.g. tool
            calls between begin and end tags).

    Raises:
        InvalidStructuredOutputs: when none or more than one constraint is set, a text is empty or longer than
            MAX_SPEC_CHARS, or `choice` breaks its bounds. Whether a schema / grammar compiles is checked where it is
            compiled.
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the fields; raises InvalidStructuredOutputs naming the first problem. O(characters)."""
        texts = {"json": self.json, "regex": self.regex, "grammar": self.grammar, "structural_tag": self.structural_tag}
        set_names = [name for name, value in texts.items() if value is not None]
        if self.choice is not None:
            set_names.append("choice")
        if self.json_object is True:
            set_names.append("json_object")
        elif self.json_object is not False:
            raise InvalidStructuredOutputs(f"json_object must be a bool, got {type(self.json_object).__name__}")
        if len(set_names) != 1:
            shown = ", ".join(set_names) if set_names else "none"
            raise InvalidStructuredOutputs(
                f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object, "
                f"structural_tag; got {shown}"
            )
        for name, value in texts.items():
            if value is not None:
                _check_text(name, value)
        if self.choice is not None:
            _check_choice(self.choice)

    @property
    def kind(self) -> str:
        """The name of the one constraint set: "json", "regex", "choice", "grammar", "json_object" or
        "structural_tag"."""
        for name in ("json", "regex", "choice", "grammar", "structural_tag"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise InvalidStructuredOutputs(f"structured_outputs.{name} must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidStructuredOutputs(f"structured_outputs.{name} is empty")
    if len(value) > MAX_SPEC_CHARS:
        raise InvalidStructuredOutputs(
            f"structured_outputs.{name} has {len(value)} characters, at most {MAX_SPEC_CHARS} are allowed"
        )


def _check_choice(choice: object) -> None:
    if not isinstance(choice, list) or not choice:
        raise InvalidStructuredOutputs("structured_outputs.choice must be a non-empty list of strings")
    if len(choice) > MAX_CHOICES:
        raise InvalidStructuredOutputs(
            f"structured_outputs.choice has {len(choice)} strings, at most {MAX_CHOICES} are allowed"
        )
    total = 0
    for i, s in enumerate(choice):
        if not isinstance(s, str) or not s:
            raise InvalidStructuredOutputs(f"structured_outputs.choice[{i}] must be a non-empty string")
        total += len(s)
    if total > MAX_CHOICE_CHARS:
        raise InvalidStructuredOutputs(
            f"structured_outputs.choice has {total} characters in all, at most {MAX_CHOICE_CHARS} are allowed"
        )
