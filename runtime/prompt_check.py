"""The one prompt check: can a prompt of token ids ever run? Used by the tokenizer process (before forwarding), the
Engine (before queueing any prompt of a call) and Scheduler.add_request (the last gate). Pure Python, no torch.

Error codes (runtime.protocol): ERR_INVALID for an empty prompt or an id outside the vocabulary, ERR_CONTEXT for a
prompt that leaves no room to generate under max_model_len or needs more KV blocks than the whole pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from runtime.protocol import ERR_CONTEXT, ERR_INVALID


class PromptProblem(NamedTuple):
    """Why a prompt can never run: code (a runtime.protocol ERR_* value) and a message for the client."""

    code: str
    message: str


def check_prompt(prompt_ids: Sequence[int], max_model_len: int, vocab_size: int | None = None,
                 block_size: int | None = None, num_blocks: int | None = None) -> PromptProblem | None:  # fmt: skip
    """The first problem that keeps `prompt_ids` from ever running, or None when it can run.

    Args:
        prompt_ids: the prompt's token ids.
        max_model_len: context length (tokens); the prompt must leave one position to generate.
        vocab_size: ids must lie in [0, vocab_size); None skips the check.
        block_size, num_blocks: the KV pool (tokens per block, blocks including the reserved block 0); the prompt's
            blocks must fit the num_blocks - 1 usable ones. None skips the check.
    Returns:
        PromptProblem(code, message), checked in this order: empty (ERR_INVALID), ids outside the vocabulary
        (ERR_INVALID), prompt >= max_model_len (ERR_CONTEXT), more blocks than the pool (ERR_CONTEXT); else None.
    Cost: O(len(prompt_ids)). Mutates nothing.
    """
    n = len(prompt_ids)
    if n == 0:
        return PromptProblem(ERR_INVALID, "the prompt is empty")
    if vocab_size is not None and not all(0 <= t < vocab_size for t in prompt_ids):
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size][:8]
        return PromptProblem(ERR_INVALID, f"token ids outside the vocabulary [0, {vocab_size}): {bad}")
    if n >= max_model_len:
        return PromptProblem(ERR_CONTEXT, f"prompt of {n} tokens leaves no room to generate under max_model_len "
                                          f"{max_model_len}")  # fmt: skip
    if block_size is not None and num_blocks is not None:
        blocks, usable = -(-n // block_size), num_blocks - 1
        if blocks > usable:
            return PromptProblem(ERR_CONTEXT, f"prompt of {n} tokens needs {blocks} KV blocks; the pool has {usable}")
    return None
