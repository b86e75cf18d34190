"""Speculative decoding test helpers: a tiny random Llama that repeats itself (tied embeddings, small weights: its
greedy output settles into runs of one token and returns to earlier tokens, so prompt lookup proposes drafts that
are partly accepted and partly rejected), and the n-gram --speculative-config the tests use."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from runtime.engine import Engine
from runtime.sampling_params import SamplingParams

# disable_by_batch_size 64: every step of these small batches drafts (the measured gate of spec_gate.py would close
# on the random model's rejections; tests/runtime/scheduler/test_spec_gate.py tests it)
NGRAM = json.dumps(
    {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "disable_by_batch_size": 64,
    }
)
# prompts whose greedy continuations on the loopy model mix accepted and rejected drafts
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [3, 4, 3, 4, 3, 4, 3], list(range(20, 45))]


def save_loopy_llama(folder: Path, tokenizer, vocab_size: int = 512) -> Path:
    """Save the loopy tiny Llama (vocab 512, 2 layers, hidden 64, tied embeddings, init std 0.1) into folder;
    vocab_size 49152 covers the tokenizer (structured outputs compile against its whole vocabulary)."""
    from transformers import LlamaConfig

    from tests.conftest import _save_tiny

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    return _save_tiny(folder, config, tokenizer, seed=3)


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Workers made inside it run on one torch thread ($RADIXSERVE_THREADS): the tiny models' many small ops
    (per-sequence attention of extends and verifications) run several times faster than on the thread pool of a
    busy machine. torch's process-wide count is restored on exit."""
    import torch

    from runtime.model.threads import THREADS_ENV

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(THREADS_ENV, "1")
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def loopy_engine_maker(loopy_dir: Path) -> Callable[..., Engine]:
    """make(**kw) -> an Engine on the loopy model: 128 blocks of 4 tokens (runs cross block boundaries), float32,
    any ServerArgs keyword overriding those."""

    def make(**kw) -> Engine:
        kw.setdefault("num_blocks", 128)
        kw.setdefault("block_size", 4)
        kw.setdefault("dtype", "float32")
        return Engine(model=str(loopy_dir), **kw)

    return make


def memoised_plain(engine: Engine) -> Callable[[list[list[int]], SamplingParams], list[list[int]]]:
    """run(prompts, params) -> plain decoding's token ids per prompt on engine, memoised by (prompts, params)."""
    memo: dict[str, list[list[int]]] = {}

    def run(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        key = repr((prompts, params))
        if key not in memo:
            memo[key] = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
        return memo[key]

    return run
