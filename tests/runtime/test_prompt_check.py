"""The one prompt check (runtime/prompt_check.py): each problem, its code, the order they are checked in."""

from __future__ import annotations

from runtime.prompt_check import PromptProblem, check_prompt
from runtime.protocol import ERR_CONTEXT, ERR_INVALID


def test_each_problem_and_its_code():
    assert check_prompt([], 64) == PromptProblem(ERR_INVALID, "the prompt is empty")
    assert check_prompt([1, 100, -3, 7], 64, vocab_size=100) == PromptProblem(
        ERR_INVALID, "token ids outside the vocabulary [0, 100): [100, -3]"
    )
    too_long = check_prompt([1] * 64, 64)
    assert too_long.code == ERR_CONTEXT and "max_model_len 64" in too_long.message
    assert check_prompt([1] * 63, 64) is None  # one position left to generate
    assert check_prompt([1] * 37, 64, block_size=4, num_blocks=10) == PromptProblem(
        ERR_CONTEXT, "prompt of 37 tokens needs 10 KV blocks; the pool has 9"
    )  # block 0 is reserved
    assert check_prompt([1] * 36, 64, block_size=4, num_blocks=10) is None


def test_checks_are_optional_and_ordered():
    assert check_prompt([10**6], 64) is None  # no vocab_size: ids unchecked
    assert check_prompt([10**6] * 100, 64, vocab_size=50).code == ERR_CONTEXT  # O(1) length checks before the O(n)
    assert check_prompt([10**6] * 63, 64, vocab_size=50, block_size=4, num_blocks=17).code == ERR_INVALID  # vocabulary
    assert check_prompt([1] * 100, 64, block_size=4, num_blocks=2).message.endswith("max_model_len 64")
