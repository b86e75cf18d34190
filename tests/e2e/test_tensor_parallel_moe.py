"""Tensor parallelism of a mixture-of-experts model end to end (issue 27): a real server with
--tensor-parallel-size 2 (two gloo worker ranks on this machine) serving a tiny random Qwen3-MoE (sparse layers 0
and 2 of 8 experts, top 2, a dense layer 1) gives the same greedy tokens as the in-process Engine at TP = 1 in
float32, for concurrent requests in a pool small enough to preempt. Each rank holds every expert's half of the
expert width; the block's output is all-reduced once per layer (runtime/model/parallel/layers.py, ReducedMoe)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from tests.e2e.servers import start_server
from tests.runtime.model.tiny_families import random_prompts
from tests.runtime.model.tiny_moe import save_tiny_moe

pytestmark = pytest.mark.slow

BLOCK = 16
NUM_BLOCKS = 24  # 23 usable blocks (368 tokens) for 4 requests of ~100 tokens each: the scheduler must preempt
NEW_TOKENS = 40
PROMPT_LENS = [61, 47, 70, 55]
FLAGS = ("--dtype", "float32", "--block-size", str(BLOCK), "--num-blocks", str(NUM_BLOCKS))


def test_tp2_qwen3_moe_server_equals_tp1_engine(tmp_path: Path, smollm2_tokenizer) -> None:
    folder = save_tiny_moe("qwen3_moe", tmp_path / "qwen3_moe", smollm2_tokenizer)
    prompts = random_prompts(PROMPT_LENS, seed=4)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    engine = Engine(model=str(folder), dtype="float32", block_size=BLOCK, num_blocks=NUM_BLOCKS, quantization="none")
    ref = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
    server = start_server(str(folder), tmp_path / "tp2.log", "--tensor-parallel-size", "2", *FLAGS)
    try:
        with server.client(timeout=120) as c:
            rids = [c.submit(input_ids=p, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True) for p in prompts]
            got = [c.result(rid).token_ids for rid in rids]
            preemptions = c.stats().num_preemptions
    finally:
        assert server.stop() == 0
    assert preemptions > 0
    assert [len(t) for t in got] == [NEW_TOKENS] * len(prompts)
    assert got == ref
