"""The one prompt check: can a prompt of token ids ever run? Used by the tokenizer process (before forwarding), the
Engine (before queueing any prompt of a call) and Scheduler.add_request (the last gate, in the scheduler process).
Pure Python, no torch. Each process runs each check once per request: the tokenizer process splits check_prompt into
check_prompt_length (before tokenizing, for input_ids) and check_token_ids (after) where the length is known early.
Before that, the text's size is bounded (prompt_char_limit, check_prompt_chars) so that no request makes the server
tokenize or render more than a fixed number of characters: a chat request has at most MAX_CHAT_MESSAGES messages, and
each counts CHAT_MESSAGE_CHARS characters beyond its role and content, so that what it costs to render is counted too.

Error codes (runtime.protocol): ERR_INVALID for an empty prompt, an id outside the vocabulary, text over the
character limit or too many messages, ERR_CONTEXT for a prompt that leaves no room to generate under max_model_len or
needs more KV blocks than the whole pool, and (check_pool_fit, at admission) for a request whose max_tokens ends within
max_model_len but past what the whole pool holds: the pool, not its max_tokens, would end it, so it is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from radix.blocks import cdiv
from runtime.protocol import ERR_CONTEXT, ERR_INVALID

CHARS_PER_TOKEN_LIMIT = 32  # default characters per token of context: far above the ~3-5 of real tokenizers
MAX_CHAT_MESSAGES = 4096  # messages in one chat request; checked first, in O(1), before any per-message work
CHAT_MESSAGE_CHARS = 32  # characters each chat message counts beyond its role and content: the template's own text
# (ChatML's "<|im_start|>", "\n", "<|im_end|>\n": 24) and its render cost (SmolLM2's template renders and encodes an
# empty message in ~13 us on this project's CPU, as long as encoding 20-50 characters of text takes)


class PromptProblem(NamedTuple):
    """Why a prompt can never run: code (a runtime.protocol ERR_* value) and a message for the client."""

    code: str
    message: str


def prompt_char_limit(max_prompt_chars: int | None, max_model_len: int) -> int:
    """The most characters a prompt (all chat messages together) may have: ServerArgs.max_prompt_chars, or
    CHARS_PER_TOKEN_LIMIT x max_model_len (tokens) when it is None. The tokenizer process, the router and the Engine
    all use this one rule."""
    return max_prompt_chars if max_prompt_chars is not None else CHARS_PER_TOKEN_LIMIT * max_model_len


def prompt_chars(prompt: str | None, messages: Sequence[Any] | None) -> int:
    """Characters the server would tokenize or render: len(prompt), or every message's role and content plus
    CHAT_MESSAGE_CHARS per message (dicts or ChatMessage structs; a field that is not a str counts 0, the chat
    template rejects it). O(len(messages))."""
    if messages is None:
        return len(prompt) if isinstance(prompt, str) else 0
    total = CHAT_MESSAGE_CHARS * len(messages)
    for m in messages:
        if isinstance(m, dict):
            role = m.get("role")
            content = m.get("content")
        else:
            role = getattr(m, "role", None)
            content = getattr(m, "content", None)
        total += _text_len(role) + _text_len(content)
    return total


def _text_len(text: object) -> int:
    """len(text) for a str, else 0 (the chat template rejects a field that is not text)."""
    return len(text) if isinstance(text, str) else 0


def check_prompt_chars(prompt: str | None, messages: Sequence[Any] | None, limit: int | None) -> PromptProblem | None:
    """The size check before tokenizing or rendering, else None: PromptProblem(ERR_INVALID, naming both sizes) for
    more than MAX_CHAT_MESSAGES messages (whatever limit; O(1)), then for prompt text or messages over `limit`
    characters as prompt_chars counts them (prompt_char_limit; None: no character limit). O(len(messages))."""
    if messages is not None and len(messages) > MAX_CHAT_MESSAGES:
        return PromptProblem(
            ERR_INVALID, f"too many messages: {len(messages)}, the limit is {MAX_CHAT_MESSAGES} (MAX_CHAT_MESSAGES)"
        )
    if limit is None:
        return None
    n = prompt_chars(prompt, messages)
    if n <= limit:
        return None
    if messages is None:
        return PromptProblem(ERR_INVALID, f"prompt too long: {n} characters, the limit is {limit} (max_prompt_chars)")
    return PromptProblem(
        ERR_INVALID,
        f"messages too long: {n} characters ({CHAT_MESSAGE_CHARS} per message for the "
        f"chat template included), the limit is {limit} (max_prompt_chars)",
    )


def check_prompt_length(
    num_tokens: int, max_model_len: int, block_size: int | None = None, num_blocks: int | None = None
) -> PromptProblem | None:
    """check_prompt's checks of a prompt's length alone (num_tokens >= 1), O(1): ERR_CONTEXT when it leaves no room
    to generate under max_model_len, or needs more KV blocks than the num_blocks - 1 usable ones (None: unchecked);
    else None. The tokenizer process runs it before any O(len) work on input_ids."""
    if num_tokens >= max_model_len:
        return PromptProblem(
            ERR_CONTEXT, f"prompt of {num_tokens} tokens leaves no room to generate under max_model_len {max_model_len}"
        )
    if block_size is not None and num_blocks is not None:
        blocks = cdiv(num_tokens, block_size)
        usable = num_blocks - 1
        if blocks > usable:
            return PromptProblem(
                ERR_CONTEXT, f"prompt of {num_tokens} tokens needs {blocks} KV blocks; the pool has {usable}"
            )
    return None


def check_pool_fit(
    num_prompt: int, max_tokens: int, max_model_len: int, block_size: int, num_blocks: int
) -> PromptProblem | None:
    """ERR_CONTEXT when a sequence of num_prompt prompt tokens could never reach its max_tokens completion tokens on
    the whole KV pool (num_blocks - 1 usable blocks of block_size tokens), though max_model_len allows them; else
    None. O(1).

    A sequence that ends at max_tokens holds KV for num_prompt + max_tokens - 1 tokens (its last token is sampled,
    never written). A request that asks past max_model_len (the chat default: "until the context") is not refused
    here: it ends "length" at the context, or at the pool when that is smaller, as the README says."""
    total = num_prompt + max_tokens
    if total > max_model_len:
        return None
    pool_tokens = (num_blocks - 1) * block_size
    if total - 1 <= pool_tokens:
        return None
    fits = pool_tokens + 1 - num_prompt
    return PromptProblem(
        ERR_CONTEXT,
        f"prompt of {num_prompt} tokens with max_tokens {max_tokens} needs KV for {total - 1} tokens; the KV pool "
        f"holds {pool_tokens} ({num_blocks - 1} blocks of {block_size}): max_tokens may be at most {fits}",
    )


def check_prompt(
    prompt_ids: Sequence[int],
    max_model_len: int,
    vocab_size: int | None = None,
    block_size: int | None = None,
    num_blocks: int | None = None,
) -> PromptProblem | None:
    """The first problem that keeps `prompt_ids` from ever running, or None when it can run.

    Args:
        prompt_ids: the prompt's token ids.
        max_model_len: context length (tokens); the prompt must leave one position to generate.
        vocab_size: ids must lie in [0, vocab_size); None skips the check.
        block_size, num_blocks: the KV pool (tokens per block, blocks including the reserved block 0); the prompt's
            blocks must fit the num_blocks - 1 usable ones. None skips the check.
    Returns:
        PromptProblem(code, message), checked in this order, the O(1) ones first: empty (ERR_INVALID), prompt >=
        max_model_len (ERR_CONTEXT), more blocks than the pool (ERR_CONTEXT), ids outside the vocabulary
        (ERR_INVALID); else None.
    Cost: O(1) for a prompt that fails on its length, else O(len(prompt_ids)). Mutates nothing.
    """
    n = len(prompt_ids)
    if n == 0:
        return PromptProblem(ERR_INVALID, "the prompt is empty")
    too_long = check_prompt_length(n, max_model_len, block_size, num_blocks)
    if too_long is not None:
        return too_long
    if vocab_size is None:
        return None
    return check_token_ids(prompt_ids, vocab_size)


def check_token_ids(prompt_ids: Sequence[int], vocab_size: int) -> PromptProblem | None:
    """check_prompt's last check alone: PromptProblem(ERR_INVALID, naming up to 8 of them) when an id lies outside
    [0, vocab_size), else None. prompt_ids must not be empty. O(len(prompt_ids)); the tokenizer process runs it on
    input_ids whose length check_prompt_length already passed."""
    if not 0 <= min(prompt_ids) <= max(prompt_ids) < vocab_size:  # min and max run in C: no per-id Python step
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size][:8]
        return PromptProblem(ERR_INVALID, f"token ids outside the vocabulary [0, {vocab_size}): {bad}")
    return None
