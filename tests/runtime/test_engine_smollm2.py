"""The embedded SmolLM2 through the in-process Engine: a 4-turn chat with a shared system prompt gives the same greedy
replies with prefix caching on and off (the project's near-tie rule), while every later turn hits the cache."""

from __future__ import annotations

import pytest

from runtime.engine import Engine
from runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # seconds per test: make test-fast leaves it out

SYSTEM = (
    "You are a concise assistant for a small bakery. Answer in one short sentence, mention prices in euros, "
    "and never invent products that are not on the menu: bread, croissants, baguettes and apple pie."
)
QUESTIONS = ["What do you sell?", "How much is a baguette?", "Do you have apple pie today?", "Thanks, goodbye!"]
MAX_TOKENS = 6
NEAR_TIE = 1e-3


def chat(engine: Engine) -> list[tuple[list[int], list, int]]:
    """Runs the 4 turns; returns (reply token ids, reply logprobs, cached_tokens) per turn."""
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        out = engine.generate(
            messages=[messages], sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)
        )[0]
        turns.append((out.token_ids, out.outputs[0].logprobs, out.usage.cached_tokens))
        messages.append({"role": "assistant", "content": out.text})
    return turns


@pytest.mark.slow
def test_multi_turn_chat_same_greedy_output_with_and_without_prefix_caching():
    results = {}
    for caching in (False, True):
        engine = Engine(
            model="smollm2",
            num_blocks=64,
            block_size=16,
            enable_prefix_caching=caching,
            dtype="float32",
            quantization="none",
        )
        results[caching] = chat(engine)
        engine.shutdown()
    for turn, ((off_ids, off_lp, off_cached), (on_ids, _, on_cached)) in enumerate(
        zip(results[False], results[True], strict=True)
    ):
        assert off_cached == 0
        if turn > 0:
            assert on_cached > 0, f"turn {turn} did not hit the cache"
        if on_ids != off_ids:
            first = next(i for i, (a, b) in enumerate(zip(on_ids, off_ids, strict=False)) if a != b)
            gap = off_lp[first].top_logprobs[0] - off_lp[first].top_logprobs[1]
            assert gap < NEAR_TIE, f"turn {turn}: replies differ at token {first} with a top-2 gap of {gap}"
            break  # the conversations diverge from here on
