"""Prompt encoding: a request's prompt text, chat messages or input_ids as prompt token ids, through the tokenizer's
chat template; the one way the tokenizer process, the router and the Engine compute them (for a GenerateRequest and
a TokenizeRequest alike)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from runtime.prompt_check import check_prompt_chars
from runtime.protocol import ChatOptions
from runtime.text.chat_templates import has_tool_turns, reserved_kwargs, template_for


class PromptError(ValueError):
    """A prompt the server will not tokenize (maps to ERR_INVALID; the message says why): text over the character
    limit, text that is not valid Unicode, token ids that are not integers, or a failed chat template."""


class ChatTemplateError(PromptError):
    """The tokenizer has no chat template, or the messages are malformed (the message says which)."""


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    options: ChatOptions | None = None,
) -> list[int]:
    """Render `messages` with the tokenizer's chat template and tokenize the result.

    Args:
        tokenizer: a transformers tokenizer with a chat template (runtime.model.loader.load_tokenizer).
        messages: [{"role": "system" | "user" | "assistant" | "tool", "content": str | None, "tool_calls": [...],
            "tool_call_id": ...}, ...] (tool_calls as OpenAI writes them: {"id", "type", "function": {"name",
            "arguments"}}).
        add_generation_prompt: append the assistant turn header so the model answers (options' wins when given).
        options: tools, template variables, add_generation_prompt / continue_final_message (ChatOptions); the
            template is chosen by runtime.text.chat_templates.template_for.
    Returns:
        the prompt token ids (list[int]); the template's own special tokens are kept, none are added twice.
    Raises:
        ChatTemplateError: no chat template, a message without role/content, a template that cannot render tools,
            reserved chat_template_kwargs, both add_generation_prompt and continue_final_message.
    """
    own = getattr(tokenizer, "chat_template", None)
    if own is None:
        raise ChatTemplateError(
            "this model has no chat template (a base model, e.g. gemma3-270m): send a prompt to /v1/completions "
            "(prompts or input_ids to the Engine) instead, or serve the model with --chat-template FILE"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatTemplateError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
    options = options if options is not None else ChatOptions(add_generation_prompt=add_generation_prompt)
    problem = options.check()
    if problem is not None:
        raise ChatTemplateError(problem)
    kwargs = dict(options.chat_template_kwargs or {})
    reserved = reserved_kwargs(kwargs)
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {reserved}: they are apply_chat_template's own")
    tools = bool(options.tools) or has_tool_turns(messages)
    template = template_for(own, tools)
    if template is None:
        raise ChatTemplateError(
            "the model's chat template does not render tools; start the server with --chat-template FILE"
        )
    text = tokenizer.apply_chat_template(
        messages,
        tools=options.tools or None,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=options.add_generation_prompt,
        continue_final_message=options.continue_final_message,
        **kwargs,
    )
    return encode_text(tokenizer, text, add_special_tokens=False)


def encode_text(tokenizer: Any, text: Any, add_special_tokens: bool = True) -> list[int]:
    """tokenizer.encode(text, add_special_tokens=...) as a list, holding the GIL for ~20 ms at most per call.

    A fast tokenizer in its plain state (no truncation, no padding, special tokens as transformers would treat them)
    goes through the Rust encoder's encode_batch_fast: the same ids, and no offsets, so that neither the encoding nor
    freeing it holds the GIL for long (with transformers' encode, freeing a 260k-character prompt's Encoding held it
    ~100-200 ms; the tokenizer process encodes on a worker thread and its loop must keep running). Anything else goes
    through tokenizer.encode. Raises what the tokenizer raises (TypeError / ValueError for text it cannot encode).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    plain = (
        backend is not None
        and backend.truncation is None
        and backend.padding is None
        and (backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)))
    )
    if fast is None or not plain or not isinstance(text, str):
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    return list(fast([text], add_special_tokens=add_special_tokens)[0].ids)


def encode_prompt(
    tokenizer: Any,
    prompt: str | None = None,
    messages: Sequence[Any] | None = None,
    input_ids: Sequence[int] | None = None,
    *,
    max_chars: int | None = None,
    add_special_tokens: bool = True,
    chat_options: ChatOptions | None = None,
) -> list[int]:
    """A request's prompt token ids, the one way the tokenizer process, the router and the Engine compute them.

    Args:
        tokenizer: a transformers tokenizer (unused for input_ids; may then be None).
        prompt / messages / input_ids: exactly one is set (runtime.protocol.input_problem checks that first).
            messages: dicts or ChatMessage structs with role and content; the chat template is applied.
        max_chars: the most characters of prompt text (all messages' roles and contents together) to tokenize
            (runtime.prompt_check.prompt_char_limit); checked before any tokenizing or rendering. None: no limit.
        add_special_tokens: for prompt text, whether the tokenizer adds its special tokens (True: as a completion
            request's prompt; a TokenizeRequest may ask for False); a chat's ids are the template's own.
        chat_options: how messages are rendered (runtime.protocol.ChatOptions; None: the defaults).
    Returns:
        the token ids (list[int]): input_ids as given, the template's ids, or the prompt text encoded.
    Raises:
        PromptError (maps to ERR_INVALID): text over max_chars ("prompt too long: ..." / "messages too long: ..."),
            text that is not valid Unicode (a lone surrogate), input_ids that are not integers, text the tokenizer
            rejects; its subclass ChatTemplateError: "chat template failed: ..." (no template, a bad message, the
            template raised).
    Cost: O(characters) for the checks, then the tokenizer's own cost (which max_chars bounds).
    """
    if input_ids is not None:
        try:
            return [int(t) for t in input_ids]
        except (TypeError, ValueError) as exc:
            raise PromptError(f"input_ids must be integers: {exc}") from None
    problem = check_prompt_chars(prompt, messages, max_chars)
    if problem is not None:
        raise PromptError(problem.message)
    if messages is not None:
        turns = [_turn(i, m) for i, m in enumerate(messages)]
        try:
            return apply_chat_template(tokenizer, turns, options=chat_options)
        except (ChatTemplateError, ValueError, TypeError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None
    _check_text("prompt", prompt)
    try:
        return encode_text(tokenizer, prompt, add_special_tokens)
    except (TypeError, ValueError) as exc:  # e.g. a prompt that is not a str (the Engine is called in process)
        raise PromptError(f"the tokenizer cannot encode the prompt: {exc}") from None


def _turn(i: int, m: Any) -> Any:
    """One message as the chat template takes it (a dict; a ChatMessage's tool calls as OpenAI writes them, their
    arguments decoded when they are a JSON object), its text checked; anything else is passed on for
    apply_chat_template to reject."""
    if not isinstance(m, dict):
        if not (hasattr(m, "role") and hasattr(m, "content")):
            return m
        m = _message_dict(m)
    for field in ("role", "content"):
        _check_text(f"message {i} {field}", m.get(field))
    return m


def _message_dict(m: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    calls = getattr(m, "tool_calls", None)
    if calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
            for c in calls
        ]
    call_id = getattr(m, "tool_call_id", None)
    if call_id is not None:
        out["tool_call_id"] = call_id
    return out


def _arguments(text: str) -> Any:
    """A call's arguments for the template: the decoded object when text is a JSON object (what templates expect),
    else the text as is."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _check_text(what: str, text: Any) -> None:
    """Raises PromptError when text (a str) cannot be encoded as UTF-8 (a lone surrogate). O(len(text))."""
    if isinstance(text, str) and not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PromptError(f"{what} is not valid Unicode text: {exc.reason} (character {exc.start})") from None
