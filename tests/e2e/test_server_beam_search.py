"""Beam search through the real processes (tokenizer, scheduler, worker over ZeroMQ): the K completions, best
first, each with its score, equal the in-process Engine's on the same model and flags; streamed, each completion
comes as one chunk; afterwards no block is held. Over HTTP, vLLM's use_beam_search / length_penalty extra fields give
the same choices."""

from __future__ import annotations

import pytest

from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from tests.e2e.http_servers import MODEL, start_tiny_http

BEAM = {
    "use_beam_search": True,
    "n": 3,
    "temperature": 0.0,
    "max_tokens": 10,
    "ignore_eos": True,
    "length_penalty": 0.5,
}


def test_beam_search_over_zeromq_equals_the_engine(tiny_server, tiny_llama_dir, wait_idle):
    prompts = [list(range(100, 117)), list(range(300, 340))]
    with tiny_server.client(timeout=300) as c:
        got = [c.generate(input_ids=p, **BEAM) for p in prompts]
        chunks = list(c.stream(input_ids=prompts[0], **BEAM))
        stats = wait_idle(c, 30)
    engine = Engine(
        str(tiny_llama_dir),
        num_blocks=1024,
        block_size=16,
        max_prefill_tokens=512,
        chunked_prefill_size=256,
        dtype="float32",
    )  # the flags of tiny_server
    refs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(**BEAM))
    for completion, ref in zip(got, refs, strict=True):
        assert [ch.index for ch in completion.choices] == [0, 1, 2]
        assert [ch.token_ids for ch in completion.choices] == [o.token_ids for o in ref.outputs]
        # scores to float32 rounding: the server runs the prompts one at a time, the Engine both in one batch,
        # and a matmul's rounding depends on its row count
        assert [ch.score for ch in completion.choices] == pytest.approx([o.score for o in ref.outputs], abs=1e-4)
        assert [ch.finish_reason for ch in completion.choices] == ["length"] * 3
        scores = [ch.score for ch in completion.choices]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(ch.token_ids) for ch in completion.choices}) == 3  # distinct beams
        assert completion.usage.completion_tokens == 30
    # streamed after generate, the request hits the cached prompt: its scores differ by float32 rounding
    streamed = sorted(chunks, key=lambda ch: ch.index)
    assert [(ch.index, ch.token_ids) for ch in streamed] == [(ch.index, ch.token_ids) for ch in got[0].choices]
    assert [ch.score for ch in streamed] == pytest.approx([ch.score for ch in got[0].choices], abs=1e-4)
    assert stats.num_used_blocks == 0


def test_http_use_beam_search_equals_the_zeromq_client(tiny_server, tiny_llama_dir, tmp_path):
    prompt = list(range(500, 521))
    server = start_tiny_http(tiny_server, tiny_llama_dir, tmp_path)
    try:
        with server.openai() as oai:
            r = oai.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=10,
                n=3,
                extra_body={"use_beam_search": True, "length_penalty": 0.5, "ignore_eos": True},
            )  # temperature 0 implied
            bad = None
            try:
                oai.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=4, n=1, extra_body={"use_beam_search": True}
                )
            except Exception as exc:  # a 400 naming the beam width
                bad = exc
    finally:
        assert server.stop() == 0
    with tiny_server.client(timeout=300) as c:
        ref = c.generate(input_ids=prompt, **BEAM)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [ch.text for ch in ref.choices]
    assert [ch.finish_reason for ch in r.choices] == ["length"] * 3
    assert r.usage.completion_tokens == 30
    assert bad is not None and getattr(bad, "status_code", None) == 400 and "beam width" in str(bad)
