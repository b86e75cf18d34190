"""Prompt logprobs (SamplingParams.prompt_logprobs) through the Engine on a tiny random Llama, against transformers'
own float32 forward (log_softmax of its logits): one prefill, chunked prefill, a prefix-cache hit (the request
computes its whole prompt), max_tokens 0 (scoring) and n > 1; plus the scheduler's once-per-position rule."""

from __future__ import annotations

import pytest
import torch

from runtime.engine import Engine
from runtime.protocol import PromptLogprobs, TokenLogprobs
from runtime.sampling_params import SamplingParams
from tests.runtime.engine_helpers import assert_idle

PROMPT = [1, 504, 3125, 314, 260, 1345, 28, 8, 19, 477, 33, 4451, 9, 12, 12, 980, 263, 2214, 17, 49151, 0, 77, 5]
TOP = 3
TOL = 1e-4  # float32 logits of this model against transformers' (tests/runtime/model/test_runner.py's bound)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax at every position of prompt: [len(prompt), vocab]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def reference(hf_model) -> torch.Tensor:
    return hf_logprobs(hf_model, PROMPT)


def _engine(tiny_llama_dir, **kw) -> Engine:
    kw.setdefault("num_blocks", 64)
    return Engine(model=str(tiny_llama_dir), block_size=4, dtype="float32", **kw)


def assert_matches(prompt_lp: PromptLogprobs | None, ref: torch.Tensor, top: int = TOP, prompt=PROMPT) -> None:
    """Every prompt position: the token, its logprob and rank, and the top alternatives, as transformers gives them
    (values within TOL; a rank or a top set may differ only among tokens within TOL of each other)."""
    assert prompt_lp is not None
    assert prompt_lp.start == 0
    assert prompt_lp.token_ids == prompt
    assert prompt_lp.logprobs[0] is None
    assert prompt_lp.ranks[0] == 0
    assert len(prompt_lp.logprobs) == len(prompt_lp.ranks) == len(prompt)
    for pos in range(1, len(prompt)):
        row = ref[pos - 1]
        entry = prompt_lp.logprobs[pos]
        assert isinstance(entry, TokenLogprobs)
        want = float(row[prompt[pos]])
        assert abs(entry.logprob - want) <= TOL, pos
        higher = int((row > want + TOL).sum())
        close = int((row > want - TOL).sum())
        assert higher + 1 <= prompt_lp.ranks[pos] <= close, pos
        assert len(entry.top_token_ids) == len(entry.top_logprobs) == top
        ref_top = row.topk(top).values.tolist()
        assert all(abs(a - b) <= TOL for a, b in zip(entry.top_logprobs, ref_top, strict=True)), pos
        for token, value in zip(entry.top_token_ids, entry.top_logprobs, strict=True):
            assert abs(float(row[token]) - value) <= TOL, (pos, token)


@pytest.mark.parametrize("chunk", [512, 5])
def test_scoring_returns_every_prompt_logprob_and_generates_nothing(tiny_llama_dir, reference, chunk):
    engine = _engine(tiny_llama_dir, chunked_prefill_size=chunk)
    out = engine.generate(input_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=TOP))[0]
    assert (out.token_ids, out.finish_reason, out.usage.completion_tokens) == ([], "length", 0)
    assert out.usage.prompt_tokens == len(PROMPT)
    assert_matches(out.prompt_logprobs, reference)
    assert_idle(engine)
    engine.shutdown()


def test_a_prefix_cache_hit_is_computed_again_and_others_still_hit(tiny_llama_dir, reference):
    engine = _engine(tiny_llama_dir)
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    first = engine.generate(input_ids=[PROMPT], sampling_params=greedy)[0]
    scored = engine.generate(
        input_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    )[0]
    assert scored.usage.cached_tokens == 0  # it took nothing from the cache
    assert scored.token_ids == first.token_ids
    assert_matches(scored.prompt_logprobs, reference, top=0)
    again = engine.generate(input_ids=[PROMPT], sampling_params=greedy)[0]
    assert again.usage.cached_tokens == (len(PROMPT) - 1) // 4 * 4  # every full block but the last token's
    assert first.prompt_logprobs is None
    assert_idle(engine)
    engine.shutdown()


def test_n_samples_share_one_prompt_logprobs(tiny_llama_dir, reference):
    engine = _engine(tiny_llama_dir, chunked_prefill_size=7)
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=-5, n=3, prompt_logprobs=1)
    out = engine.generate(input_ids=[PROMPT], sampling_params=params)[0]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3, 3]
    assert_matches(out.prompt_logprobs, reference, top=1)
    assert_idle(engine)
    engine.shutdown()


def test_a_one_token_prompt_has_only_position_0(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    out = engine.generate(input_ids=[[77]], sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert out.prompt_logprobs == PromptLogprobs(0, [77], [None], [0])
    assert (out.token_ids, out.finish_reason) == ([], "length")
    engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_under_memory_pressure_every_position_comes_once_and_right(tiny_llama_dir, hf_model, mode):
    prompts = [[500 + 37 * i + 3 * j for j in range(9 + i % 4)] for i in range(8)]
    host = 64 if mode == "swap" else 0
    engine = _engine(tiny_llama_dir, num_blocks=12, max_running_requests=6, preemption_mode=mode, num_host_blocks=host)
    params = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=1)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert engine.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.token_ids) == 8
        assert_matches(out.prompt_logprobs, hf_logprobs(hf_model, prompt), top=1, prompt=prompt)
    assert_idle(engine)
    engine.shutdown()


def test_positions_run_again_after_a_recompute_go_out_once(tiny_llama_dir):
    """The Finisher's rule: a chunk that starts before the positions already sent gives only the new ones."""
    engine = _engine(tiny_llama_dir)
    scheduler = engine.scheduler
    scheduler.add_request("r", PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0))
    seq = scheduler.requests["r"].seqs[0]
    finisher = scheduler._finisher

    def part(start: int, count: int) -> PromptLogprobs:
        ids = PROMPT[start : start + count]
        return PromptLogprobs(start, ids, [TokenLogprobs(-1.0 * t, [], []) for t in ids], [2] * count)

    finisher.on_prompt_logprobs(seq, part(1, 4))
    finisher.on_prompt_logprobs(seq, part(1, 6))  # recomputed from the start: positions 5 and 6 are new
    finisher.on_prompt_logprobs(seq, part(3, 2))  # nothing new
    outs = [o.prompt_logprobs for o in scheduler.drain_outputs()]
    assert [(o.start, o.token_ids, o.ranks) for o in outs if o is not None] == [
        (0, PROMPT[:5], [0, 2, 2, 2, 2]),
        (5, PROMPT[5:7], [2, 2]),
    ]
    scheduler.abort("r")
    engine.shutdown()
