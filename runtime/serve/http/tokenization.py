"""/tokenize and /detokenize, answered by the backend through the process's AsyncClient (a TokenizeRequest or a
DetokenizeRequest: the tokenizer process, or a router, answers from its own tokenizer with
runtime.serve.tokenizer.text_requests), so the HTTP process loads no tokenizer of its own.

/tokenize {"prompt": text, "add_special_tokens": true} gives the ids the completions route would send for that text;
{"messages": [...]} the ids of the chat template, as the chat route's backend computes them (the same encode_prompt
path and character limit). Answer: {"count": n, "tokens": [ids]}. /detokenize {"tokens": [ids]} answers
{"prompt": text} (special tokens kept).

Errors: 400 invalid_value for neither or both of prompt and messages (param "prompt"), text the backend will not
tokenize (over its character limit, not Unicode, a failed chat template: param "prompt" or "messages") and an id
outside the vocabulary (param "tokens[i]", the first one); a bad chat message as the chat route answers it
(openai_schema.chat_messages); 413 over the backend's max_message_bytes; 503 when the backend is not ready or gone.
"""

from __future__ import annotations

import re
from typing import Any

from runtime import protocol as p
from runtime.client import AsyncClient, ClientError, InvalidRequestError
from runtime.serve.http.errors import OpenAIError, bad_request, from_exception
from runtime.serve.http.openai_schema import DetokenizeRequest, TokenizeRequest, chat_messages

_ID_AT = re.compile(r"token_ids\[(\d+)\]")  # the backend names the first id outside the vocabulary so


async def tokenize(client: AsyncClient, req: TokenizeRequest) -> dict[str, Any]:
    """{"count", "tokens"} of req's prompt or messages, from the backend. Raises OpenAIError (see the module)."""
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("exactly one of prompt and messages must be given", "prompt")
    param = "prompt" if req.messages is None else "messages"
    messages = None if req.messages is None else chat_messages(req.messages)
    try:
        ids = await client.tokenize(prompt=req.prompt, messages=messages, add_special_tokens=req.add_special_tokens)
    except ClientError as exc:
        raise _error(exc, param) from None
    return {"count": len(ids), "tokens": ids}


async def detokenize(client: AsyncClient, req: DetokenizeRequest) -> dict[str, Any]:
    """{"prompt": text} of req.tokens, from the backend. Raises OpenAIError (see the module)."""
    try:
        text = await client.detokenize(req.tokens)
    except ClientError as exc:
        raise _error(exc, "tokens") from None
    return {"prompt": text}


def _error(exc: ClientError, param: str) -> OpenAIError:
    """The OpenAIError for what the backend (or the client library) refused: ERR_INVALID is a 400 invalid_value
    naming param, or, for an id outside the vocabulary, "tokens[i]" (the body's field: the backend's message says
    "token_ids[i] = ...", renamed so); anything else as the completion routes map it (errors.from_exception)."""
    if isinstance(exc, InvalidRequestError) and exc.code == p.ERR_INVALID:
        message = exc.message
        at = _ID_AT.match(message)
        if at is not None:
            param = f"tokens[{at.group(1)}]"
            message = param + message[at.end() :]
        return bad_request(message, param)
    return from_exception(exc, {}, param)
