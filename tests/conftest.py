"""Shared fixtures: tiny random Llama and Qwen2 model folders and the embedded SmolLM2 tokenizer; the `server`
marker by path (`make test-fast` runs neither the `server` tests nor those marked `slow`).

The tiny models use SmolLM2's tokenizer (saved into their folders, vocab 49152), so ServerArgs(model=<folder>) and
load_tokenizer(<folder>) both work on them. Their weights are drawn with a wide initializer so greedy decoding has
clear winners. The embedded model's GGUF conversion happens once per machine ($RADIXSERVE_CACHE).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from radix.blocks import cdiv

TINY_VOCAB = 49152
TESTS = Path(__file__).resolve().parent

# Every test under these folders starts server processes (real launchers, router replicas, benchmark servers).
SERVER_DIRS = ("e2e", "benchmarks", "router")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks each test `server` when its file is under SERVER_DIRS (paths relative to tests/). Slow in-process tests
    carry their own `slow` marker (a file's pytestmark or a test's decorator)."""
    for item in items:
        path = item.path.relative_to(TESTS)
        if path.parts[0] in SERVER_DIRS:
            item.add_marker(pytest.mark.server)


def _save_tiny(folder: Path, config, tokenizer, seed: int, max_shard_size: str | None = None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF initialises biases to 0 and norms to 1: randomise them so the tests see them
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.25)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), safe_serialization=True, **kwargs)
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The embedded SmolLM2-135M-Instruct tokenizer (a transformers fast tokenizer with its chat template)."""
    from runtime.model.loader import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A random 2-layer Llama (GQA 2:1, llama3 rope scaling, untied head) saved as sharded safetensors."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    config.architectures = ["LlamaForCausalLM"]
    return _save_tiny(tmp_path_factory.mktemp("tiny_llama"), config, smollm2_tokenizer, seed=1, max_shard_size="2MB")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A random 2-layer Qwen2 (qkv bias, GQA 4:1, tied embeddings) saved as one safetensors file."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    config.architectures = ["Qwen2ForCausalLM"]
    return _save_tiny(tmp_path_factory.mktemp("tiny_qwen2"), config, smollm2_tokenizer, seed=2)


CHAT_PROMPTS = [
    "What is the capital of France? Answer in two sentences.",
    "Write a short poem about the sea.",
    "Explain in simple words how a bicycle stays upright.",
    "List three tips for learning a new language.",
]


@pytest.fixture(scope="session")
def chat_prompt_ids(smollm2_tokenizer) -> list[list[int]]:
    """The token ids of 4 real chat prompts (SmolLM2 chat template, generation prompt added)."""
    return [
        list(
            smollm2_tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)[
                "input_ids"
            ]
        )
        for c in CHAT_PROMPTS
    ]


def _runner_greedy(
    runner,
    prompts: list[list[int]],
    max_new_tokens: int,
    chunk: int | None = None,
    block_order: list[int] | None = None,
) -> list[list[int]]:
    """Greedy-decode prompts together through runner.execute, as a scheduler would: prompt i joins at step i (so
    prefill, chunked prefill and decode share steps), prompts are prefilled in chunks of `chunk` tokens, and block ids
    come from block_order (default 1, 2, ...). Returns the max_new_tokens generated ids of each prompt."""
    from runtime.protocol import ForwardBatch, ScheduledSeq
    from runtime.sampling_params import SamplingParams

    bs = runner.block_size
    free = list(block_order) if block_order is not None else list(range(1, runner.num_blocks))
    tables = []
    for p in prompts:
        need = cdiv(len(p) + max_new_tokens, bs)
        tables.append([free.pop(0) for _ in range(need)])
    done_pos = [0] * len(prompts)  # tokens with KV
    outputs: list[list[int]] = [[] for _ in prompts]
    step = 0
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    while any(len(o) < max_new_tokens for o in outputs):
        seqs = []
        for i, p in enumerate(prompts):
            if i > step or len(outputs[i]) >= max_new_tokens:
                continue
            known = p + outputs[i]
            if done_pos[i] < len(p):
                end = len(p) if chunk is None else min(len(p), done_pos[i] + chunk)
            else:
                end = len(known)
            toks = known[done_pos[i] : end]
            first = done_pos[i] == 0
            seqs.append(
                ScheduledSeq(
                    i,
                    toks,
                    done_pos[i],
                    tables[i] if first else [],
                    end == len(known),
                    greedy if first else None,
                    len(p),
                )
            )
            done_pos[i] = end
        result = runner.execute(ForwardBatch(step_id=step, seqs=seqs))
        assert result.error is None
        for sid, tok in zip(result.seq_ids, result.token_ids, strict=True):
            outputs[sid].append(tok)
        step += 1
    return outputs


@pytest.fixture(scope="session")
def runner_greedy():
    """The function _runner_greedy(runner, prompts, max_new_tokens, chunk=None, block_order=None)."""
    return _runner_greedy


def _hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int):
    """transformers' greedy generate for prompts (one left-padded batch, EOS ignored): per prompt, (new token ids,
    float32 logits [max_new_tokens, vocab])."""
    import torch

    hf_model.generation_config.eos_token_id = None
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf_model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    logits = torch.stack(out.logits, dim=1).float()
    return [(out.sequences[i, width:].tolist(), logits[i]) for i in range(len(prompts))]


def _assert_same_greedy(mine: list[int], ref: list[int], ref_logits) -> None:
    """The project's "identical outputs" rule: equal, or the first difference is at a near-tie of the reference
    (its top-two logits differ by less than 1e-3 at that step)."""
    if mine == ref:
        return
    first = next(i for i, (a, b) in enumerate(zip(mine, ref, strict=True)) if a != b)
    top2 = ref_logits[first].topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < 1e-3, f"outputs differ at token {first} ({mine[first]} vs {ref[first]}), reference gap {gap}"


@pytest.fixture(scope="session")
def hf_greedy():
    """The functions (_hf_greedy, _assert_same_greedy)."""
    return _hf_greedy, _assert_same_greedy
