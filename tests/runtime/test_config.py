"""ServerArgs: ranges and the combinations that can never serve are refused at construction."""

from __future__ import annotations

import pytest

from runtime.config import InvalidConfig, ServerArgs


def test_defaults_are_valid_and_unknown_fields_are_named():
    args = ServerArgs()
    assert (args.model, args.block_size, args.host, args.enable_prefix_caching) == ("smollm2", 16, "127.0.0.1", True)
    with pytest.raises(InvalidConfig, match=r"unknown ServerArgs field\(s\) \['blok_size'\]"):
        ServerArgs.from_kwargs(blok_size=16)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 12}, "block_size must be a power of two"),
        ({"num_blocks": 1}, "num_blocks must be >= 5"),
        ({"num_blocks": 4}, "num_blocks must be >= 5"),
        ({"max_prompt_chars": 0}, "max_prompt_chars must be None or >= 1"),
        ({"port": 70000}, "port must be in"),
        ({"preemption_mode": "swap"}, "needs num_host_blocks > 0"),
        ({"num_scheduler_steps": 0}, r"num_scheduler_steps must be None or in \[1, 64\], got 0"),
        ({"num_scheduler_steps": 65}, r"num_scheduler_steps must be None or in \[1, 64\], got 65"),
        (
            {"num_scheduler_steps": 4, "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'},
            "num_scheduler_steps > 1 and speculative_config both",
        ),
        ({"num_scheduler_steps": 4, "tensor_parallel_size": 2}, r"runs on one rank \(tensor_parallel_size 1\)"),
    ],
)
def test_out_of_range_values_raise(kwargs, message):
    with pytest.raises(InvalidConfig, match=message):
        ServerArgs(**kwargs)


def test_scheduler_steps_default_to_4_and_to_1_beside_speculation_or_tensor_parallelism():
    assert ServerArgs().scheduler_steps() == 4
    assert ServerArgs(num_scheduler_steps=1).scheduler_steps() == 1
    ngram = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert ServerArgs(speculative_config=ngram).scheduler_steps() == 1
    assert ServerArgs(tensor_parallel_size=2).scheduler_steps() == 1


def test_triton_backend_needs_cuda_unless_interpreted(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InvalidConfig, match="needs a CUDA device"):
        ServerArgs(attention_backend="triton")
    assert ServerArgs(attention_backend="triton", device="cuda").attention_backend == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ServerArgs(attention_backend="triton").device == "cpu"
    assert ServerArgs(preemption_mode="swap", num_host_blocks=8).num_host_blocks == 8
