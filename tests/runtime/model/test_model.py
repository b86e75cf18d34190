"""The Llama-family model on paged KV against transformers' own models on the same weights (float32: every runner
here passes dtype="float32"; bfloat16 is measured against float32 in test_bf16_agreement.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from radix.blocks import cdiv
from runtime.config import ServerArgs
from runtime.model.loader import resolve_model
from runtime.model.runner import ModelRunner
from runtime.protocol import ForwardBatch, ScheduledSeq
from runtime.sampling_params import SamplingParams
from tests.runtime.model.step_logits import StepLogits, step_logits

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def smol_runner():
    return ModelRunner(ServerArgs(model="smollm2", num_blocks=128, dtype="float32", quantization="none"))


@pytest.fixture(scope="module")
def smol_hf():
    return AutoModelForCausalLM.from_pretrained(str(resolve_model("smollm2")), dtype=torch.float32).eval()


def _prefill(runner: ModelRunner, seq_id: int, tokens: list[int], blocks: list[int], start_pos: int = 0) -> StepLogits:
    """One step of a new sequence running tokens from start_pos: its last token's logits (row 0) and the tokens run."""
    batch = ForwardBatch(
        step_id=0, seqs=[ScheduledSeq(seq_id, tokens, start_pos, blocks, True, GREEDY, start_pos + len(tokens))]
    )
    return step_logits(runner, batch)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smol_runner, smol_hf, chat_prompt_ids):
    prompt = chat_prompt_ids[0]
    blocks = list(range(1, 1 + cdiv(len(prompt), smol_runner.block_size)))
    mine = _prefill(smol_runner, 100, prompt, blocks).logits[0]
    with torch.no_grad():
        ref = smol_hf(torch.tensor([prompt])).logits[0, -1].float()
    assert mine.shape == (smol_runner.config.vocab_size,)
    assert float((mine - ref).abs().max()) <= 1e-3


@pytest.mark.slow
def test_smollm2_greedy_matches_generate(smol_runner, smol_hf, chat_prompt_ids, runner_greedy, hf_greedy):
    hf_generate, assert_same = hf_greedy
    runner = ModelRunner(ServerArgs(model="smollm2", num_blocks=64, dtype="float32", quantization="none"))
    mine = runner_greedy(runner, chat_prompt_ids, 32, chunk=24)
    for out, (ref, ref_logits) in zip(mine, hf_generate(smol_hf, chat_prompt_ids, 32), strict=True):
        assert len(out) == 32
        assert_same(out, ref, ref_logits)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_llama_dir"])
def test_tiny_models_greedy_match_generate(fixture, request, chat_prompt_ids, runner_greedy, hf_greedy):
    folder = request.getfixturevalue(fixture)
    hf_generate, assert_same = hf_greedy
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    runner = ModelRunner(ServerArgs(model=str(folder), num_blocks=64, block_size=8, dtype="float32"))
    order = list(range(1, 64))
    order = [order[i] for i in torch.randperm(len(order), generator=torch.Generator().manual_seed(3)).tolist()]
    mine = runner_greedy(runner, chat_prompt_ids, 32, chunk=16, block_order=order)
    for out, (ref, ref_logits) in zip(mine, hf_generate(hf, chat_prompt_ids, 32), strict=True):
        assert_same(out, ref, ref_logits)


def test_tiny_logits_match_transformers_past_rope_scaling_context(tiny_llama_dir):
    # positions up to 200 > original_max_position_embeddings (64): every llama3 rope band is exercised.
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    runner = ModelRunner(ServerArgs(model=str(tiny_llama_dir), num_blocks=64, dtype="float32"))
    tokens = torch.randint(3, 49152, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    mine = _prefill(runner, 1, tokens, list(range(1, 14))).logits[0]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0, -1].float()
    assert float((mine - ref).abs().max()) <= 1e-3


def test_extend_over_shared_blocks_equals_full_prefill(tiny_qwen2_dir):
    runner = ModelRunner(ServerArgs(model=str(tiny_qwen2_dir), num_blocks=16, block_size=16, dtype="float32"))
    tokens = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    first = _prefill(runner, 1, tokens, [7, 3, 9])
    # Seq 2 shares seq 1's first two (full) blocks, so it computes only its last 8 tokens into its own block 5.
    second = _prefill(runner, 2, tokens[32:], [7, 3, 5], start_pos=32)
    assert (first.num_tokens, second.num_tokens) == (40, 8)
    full = first.logits[0]
    extend = second.logits[0]
    torch.testing.assert_close(extend, full, atol=1e-4, rtol=0)
    assert int(extend.argmax()) == int(full.argmax())
    torch.testing.assert_close(runner.k_cache[:, 5, :8], runner.k_cache[:, 9, :8], atol=1e-5, rtol=0)
