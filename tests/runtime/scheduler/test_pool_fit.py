"""A request whose max_tokens the whole KV pool cannot hold is refused at admission (issue 28, class 6), naming the
pool; one that fits to the token runs to its max_tokens; one asking past max_model_len ("until the context") is not
refused and ends "length" where the pool ends it.

Before: each was admitted and came back finish_reason "length" after as many tokens as the pool held, nothing saying
the pool, not max_tokens, ended it."""

from __future__ import annotations

import pytest

from runtime.prompt_check import check_pool_fit
from runtime.protocol import ERR_CONTEXT
from runtime.scheduler.request import RequestRejected
from tests.runtime.scheduler.harness import Harness, reference

BS = 16
PROMPT = [41] * 32  # 2 blocks; 5 usable blocks hold 80 tokens of KV: 49 completion tokens at most (the 49th unwritten)


def test_a_max_tokens_the_pool_cannot_hold_is_refused_at_admission():
    h = Harness(num_blocks=6, block_size=BS, max_model_len=4096)
    with pytest.raises(RequestRejected) as info:
        h.add("big", PROMPT, max_tokens=50, ignore_eos=True)
    assert info.value.code == ERR_CONTEXT
    assert str(info.value) == (
        "prompt of 32 tokens with max_tokens 50 needs KV for 81 tokens; the KV pool holds 80 (5 blocks of 16): "
        "max_tokens may be at most 49"
    )
    assert h.sched.counters.num_rejected == 1
    h.assert_idle()


def test_a_max_tokens_that_fits_to_the_token_runs_to_its_end():
    h = Harness(num_blocks=6, block_size=BS, max_model_len=4096)
    h.add("fits", PROMPT, max_tokens=49, ignore_eos=True)
    h.run()
    h.assert_idle()
    assert h.tokens[("fits", 0)] == reference(PROMPT, 49)
    assert h.finish[("fits", 0)] == "length"


def test_a_request_past_the_context_is_not_refused():
    h = Harness(num_blocks=6, block_size=BS, max_model_len=200)
    h.add("until-context", PROMPT, max_tokens=2**31 - 1, ignore_eos=True)  # the chat route's default
    h.run()
    h.assert_idle()
    assert len(h.tokens[("until-context", 0)]) == 49  # the pool ends it before the 200-token context
    assert h.finish[("until-context", 0)] == "length"


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "max_model_len", "refused"),
    [(32, 49, 4096, False), (32, 50, 4096, True), (80, 1, 4096, False), (32, 50, 81, False), (32, 50, 82, True)],
)
def test_check_pool_fit_boundaries(prompt, max_tokens, max_model_len, refused):
    problem = check_pool_fit(prompt, max_tokens, max_model_len, BS, 6)
    assert (problem is not None) == refused
