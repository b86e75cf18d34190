"""Shared fixtures: tiny random Llama and Qwen2 model folders and the embedded SmolLM2 tokenizer; the `server` and
`slow` markers by path (`make test-fast` runs the tests with neither).

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
# In-process tests that take seconds each (a model against transformers' generate, the Triton interpreter,
# hypothesis state machines): a file, or file::test function (every parametrization). make test runs them,
# make test-fast does not. Chosen from `pytest --durations` on a 2-core machine: each took over 1 s there.
SLOW = (
    "kernels/test_attention_benchmark.py",
    "kernels/test_cpu_decode.py::test_build_command_prints_the_library",
    "kernels/test_cpu_decode.py::test_one_and_two_threads_give_identical_results",
    "kernels/test_triton_interpreter.py",
    "radix/test_bench_smoke.py",
    "radix/test_cases.py::test_c9_insert_evict_cycles_leave_memory_where_it_started",
    "radix/test_stateful.py",
    "runtime/client/test_client_liveness.py",
    "runtime/model/test_bf16_agreement.py",
    "runtime/model/test_loader.py::test_gguf_is_converted_once_then_read_from_the_cache",
    "runtime/model/test_loader.py::test_tokenizer_loads_without_torch",
    "runtime/model/test_model.py::test_smollm2_greedy_matches_generate",
    "runtime/model/test_model.py::test_smollm2_logits_match_transformers",
    "runtime/model/test_model.py::test_tiny_models_greedy_match_generate",
    "runtime/model/test_penalties.py",
    "runtime/model/test_quant.py::test_int4_model_agrees_with_float32_on_top1_of_real_text",
    "runtime/model/test_quant.py::test_int8_model_agrees_with_float32_on_top1_of_real_text",
    "runtime/model/test_runner.py::test_seeded_sampling_is_independent_of_batch_composition",
    "runtime/scheduler/test_beam_blocks.py",
    "runtime/scheduler/test_beam_search.py::test_beams_that_end_on_eos_equal_transformers",
    "runtime/scheduler/test_beam_search.py::test_fixed_length_beams_equal_transformers",
    "runtime/scheduler/test_failure_isolation.py::test_engine_a_failing_request_leaves_the_others_of_its_steps_unchanged",
    "runtime/scheduler/test_failure_isolation.py::test_engine_keeps_no_state_of_requests_that_ended",
    "runtime/serve/tokenizer/test_frame_fuzz.py::test_decode_client_frame_is_total_on_every_msgpack_value_and_any_bytes",
    "runtime/serve/tokenizer/test_prompt_worker.py::test_streaming_and_heartbeats_go_on_while_three_max_size_prompts_are_tokenized",
    "runtime/test_engine.py::test_c3_same_step_duplicates_and_abort_after_first_chunk",
    "runtime/test_engine.py::test_c5_multi_turn_cache_includes_reply_and_stop_string_keeps_cache_short",
    "runtime/test_engine.py::test_c8_hit_rate_and_chunks",
    "runtime/test_engine_serving.py::test_abort_waiting_mid_prefill_mid_decode",
    "runtime/test_engine_serving.py::test_forward_tokens_equal_prompt_minus_cached",
    "runtime/test_engine_serving.py::test_memory_pressure_every_request_completes_unchanged",
    "runtime/test_engine_serving.py::test_parallel_samples_share_one_prefill_and_copy_on_write",
    "runtime/test_engine_smollm2.py",
    "runtime/test_host_tier_engine.py::test_a_tiny_pool_with_a_host_tier_gives_the_unlimited_pools_outputs",
    "runtime/test_host_tier_engine.py::test_host_tier_size_from_bytes_or_blocks",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks each test `server` when its file is under SERVER_DIRS and `slow` when its file or its function is in
    SLOW (paths relative to tests/)."""
    for item in items:
        path = item.path.relative_to(TESTS)
        if path.parts[0] in SERVER_DIRS:
            item.add_marker(pytest.mark.server)
        function = f"{path.as_posix()}::{getattr(item, 'originalname', item.name)}"
        if path.as_posix() in SLOW or function in SLOW:
            item.add_marker(pytest.mark.slow)


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
