"""The shipped Gemma turn template (runtime/text/templates/gemma_turns.jinja) on the embedded gemma3-270m's tokenizer:
the exact text and token ids of Gemma 3's turn format (one BOS, system text leading the first user turn, assistant
as "model", the generation prompt), and the ids of its turn markers as single special tokens."""

from __future__ import annotations

import pytest

from runtime.model.loader import load_tokenizer
from runtime.text.chat_templates import TEMPLATES, override_chat_template
from runtime.text.prompt import apply_chat_template

GEMMA_TURNS = TEMPLATES / "gemma_turns.jinja"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]
TEXT = (
    "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
    "<start_of_turn>model\nHello!<end_of_turn>\n"
    "<start_of_turn>user\nBye<end_of_turn>\n"
)


@pytest.fixture(scope="module")
def gemma_tokenizer():
    return override_chat_template(load_tokenizer("gemma3-270m"), str(GEMMA_TURNS))


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_renders_gemma_3_turns(gemma_tokenizer, generation_prompt):
    text = gemma_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=generation_prompt)
    assert text == TEXT + ("<start_of_turn>model\n" if generation_prompt else "")


def test_token_ids_one_bos_and_single_turn_markers(gemma_tokenizer):
    ids = apply_chat_template(gemma_tokenizer, CHAT)
    # <bos> 2, <start_of_turn> 105, <end_of_turn> 106 (Gemma 3's vocabulary); "user" 2364, "model" 4368, "\n" 107
    assert ids[:4] == [2, 105, 2364, 107]
    assert ids.count(2) == 1 and ids.count(105) == 4 and ids.count(106) == 3
    assert ids[-3:] == [105, 4368, 107]
    assert ids == gemma_tokenizer.encode(TEXT + "<start_of_turn>model\n", add_special_tokens=False)
    assert len(ids) == 28


def test_a_chat_without_system_starts_with_the_user_turn(gemma_tokenizer):
    text = gemma_tokenizer.apply_chat_template(CHAT[1:2], tokenize=False, add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
