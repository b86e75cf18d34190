"""StructuredOutputs -> xgrammar Grammar: the one place that knows how each constraint kind is spelled for xgrammar.

The grammar is vocabulary-free (no tokenizer): building it parses the schema / regex / EBNF / structural tag, so it is
also the front door's check that a constraint compiles (check_compiles), answered as a 400
before any work is queued.
"""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from runtime.structured_outputs import InvalidStructuredOutputs, StructuredOutputs

# JSON without free whitespace (one space after ":" and ","), as llama.cpp's json-schema grammars: with any_whitespace
# a small model's greedy decoding can emit newlines forever inside an object and never close it.
JSON_SEPARATORS = (", ", ": ")
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # OpenAI's response_format json_object: any one JSON object
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # xgrammar's "[hh:mm:ss] file.cc:line: " before its message


def to_grammar(so: StructuredOutputs) -> xgr.Grammar:
    """The xgrammar Grammar of so (its one constraint).

    json: xgrammar's JSON-schema converter (strict mode: no properties beyond the schema's), compact whitespace;
    json_object: the schema {"type": "object"}; regex: xgrammar's regex converter (whole-string match); choice: an
    EBNF alternation of the JSON-escaped strings; grammar: EBNF with a `root` rule; structural_tag: xgrammar's
    structural tag JSON, either the current {"type": "structural_tag", "format": ...} form or vLLM's legacy
    {"structures": [{"begin", "schema", "end"}], "triggers": [...]} form.

    Raises:
        InvalidStructuredOutputs: naming the field and xgrammar's message, when the constraint does not parse.
    """
    kind = so.kind
    try:
        return _build(so, kind)
    except InvalidStructuredOutputs:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own errors, with the parser's message
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        message = _LOG_PREFIX.sub("", lines[0])
        raise InvalidStructuredOutputs(f"structured_outputs.{kind} does not compile: {message[:500]}") from None


def check_compiles(so: StructuredOutputs) -> None:
    """Raise InvalidStructuredOutputs naming the field when so's schema / regex / grammar / structural tag does not
    parse (milliseconds, no vocabulary). The front doors (the tokenizer process, the Engine) call it before queueing
    a request, importing this module on first use: xgrammar imports torch, which the processes that never see a
    constraint do not pay."""
    to_grammar(so)


def _build(so: StructuredOutputs, kind: str) -> xgr.Grammar:
    if so.json is not None:
        return _json_schema(so.json)
    if so.json_object:
        return _json_schema(JSON_OBJECT_SCHEMA)
    if so.regex is not None:
        return xgr.Grammar.from_regex(so.regex)
    if so.choice is not None:
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice)
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    if so.grammar is not None:
        return xgr.Grammar.from_ebnf(so.grammar)
    assert so.structural_tag is not None, kind
    return _structural_tag(so.structural_tag)


def _json_schema(text: str) -> xgr.Grammar:
    try:
        json.loads(text)
    except ValueError as exc:
        raise InvalidStructuredOutputs(f"structured_outputs.json is not valid JSON: {exc}") from None
    return xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=True)


def _structural_tag(text: str) -> xgr.Grammar:
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise InvalidStructuredOutputs(f"structured_outputs.structural_tag is not valid JSON: {exc}") from None
    if isinstance(spec, dict) and "structures" in spec:  # vLLM's legacy form
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
            for s in spec["structures"]
        ]
        return xgr.Grammar.from_structural_tag(items, list(spec.get("triggers", [])))
    return xgr.Grammar.from_structural_tag(text)
