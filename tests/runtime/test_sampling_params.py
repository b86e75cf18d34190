"""SamplingParams bounds: every field is bounded to what the code below can represent, with an exact message naming
the field, in Python and on the wire (decode_client_frame answers ERR_INVALID with the same words)."""

from __future__ import annotations

import msgspec
import pytest

from runtime import protocol as p
from runtime import sampling_params as sp
from runtime.sampling_params import InvalidSamplingParams, SamplingParams

I32 = 2**31 - 1
BOUNDS = {
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens must be in [1, 2147483647], got 0"),
    "max_tokens past int32": ({"max_tokens": 2**31}, "max_tokens must be in [1, 2147483647], got 2147483648"),
    "max_tokens uint64": ({"max_tokens": 2**64 - 1}, "max_tokens must be in [1, 2147483647], got 18446744073709551615"),
    "top_k -2": ({"top_k": -2}, "top_k must be -1, 0 (all tokens) or in [1, 2147483647], got -2"),
    "top_k past int32": ({"top_k": 2**31}, "top_k must be -1, 0 (all tokens) or in [1, 2147483647], got 2147483648"),
    "top_k int64 overflow": (
        {"top_k": 2**63},
        "top_k must be -1, 0 (all tokens) or in [1, 2147483647], got 9223372036854775808",
    ),
    "stop token id past int32": (
        {"stop_token_ids": [1, 2**31]},
        "stop_token_ids must be ints in [0, 2147483647], stop_token_ids[1] is 2147483648",
    ),
    "stop token id negative": (
        {"stop_token_ids": [-1]},
        "stop_token_ids must be ints in [0, 2147483647], stop_token_ids[0] is -1",
    ),
    "1025 stop token ids": ({"stop_token_ids": [5] * 1025}, "stop_token_ids has 1025 ids, at most 1024 are allowed"),
    "65 stop strings": ({"stop": ["a"] * 65}, "stop has 65 strings, at most 64 are allowed"),
    "4097 stop characters": (
        {"stop": ["a" * 4000, "b" * 97]},
        "stop strings have 4097 characters in all, at most 4096 are allowed",
    ),
    "empty stop string": ({"stop": ["x", ""]}, "stop strings must be non-empty strings, stop[1] is ''"),
    "temperature past 1e4": ({"temperature": 1e5}, "temperature must be finite and in [0, 10000], got 100000.0"),
    "temperature inf": ({"temperature": float("inf")}, "temperature must be finite and in [0, 10000], got inf"),
    "temperature negative": ({"temperature": -0.5}, "temperature must be finite and in [0, 10000], got -0.5"),
    "top_p 0": ({"top_p": 0.0}, "top_p must be finite and in (0, 1], got 0.0"),
    "min_p nan": ({"min_p": float("nan")}, "min_p must be finite and in [0, 1], got nan"),
    "seed 2**63": ({"seed": 2**63}, "seed must be in [-2**63, 2**63), got 9223372036854775808"),
    "min_tokens over max_tokens": (
        {"max_tokens": 4, "min_tokens": 5},
        "min_tokens must be in [0, max_tokens=4], got 5",
    ),
    "min_tokens negative": ({"min_tokens": -1}, "min_tokens must be in [0, max_tokens=16], got -1"),
    "logit_bias 101": ({"logit_bias": {7: 101.0}}, "logit_bias[7] must be finite and in [-100, 100], got 101.0"),
    "logit_bias negative id": (
        {"logit_bias": {-1: 5.0}},
        "logit_bias keys must be token ids in [0, 2147483647], got -1",
    ),
    "1025 logit_bias entries": (
        {"logit_bias": dict.fromkeys(range(1025), 1.0)},
        "logit_bias has 1025 entries, at most 1024 are allowed",
    ),
    "prompt_logprobs 21": ({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20], got 21"),
    "beam search with logit_bias": (
        {"use_beam_search": True, "n": 2, "temperature": 0.0, "logit_bias": {1: 1.0}, "prompt_logprobs": 0},
        "use_beam_search does not support logit_bias, prompt_logprobs",
    ),
    "n 65": ({"n": 65}, "n must be in [1, 64], got 65"),
    "logprobs 21": ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
    "frequency_penalty 2.5": ({"frequency_penalty": 2.5}, "frequency_penalty must be finite and in [-2, 2], got 2.5"),
    "frequency_penalty nan": (
        {"frequency_penalty": float("nan")},
        "frequency_penalty must be finite and in [-2, 2], got nan",
    ),
    "presence_penalty -2.01": (
        {"presence_penalty": -2.01},
        "presence_penalty must be finite and in [-2, 2], got -2.01",
    ),
    "repetition_penalty 0": (
        {"repetition_penalty": 0.0},
        "repetition_penalty must be finite and in [0.1, 10], got 0.0",
    ),
    "repetition_penalty 1e-40": (
        {"repetition_penalty": 1e-40},
        "repetition_penalty must be finite and in [0.1, 10], got 1e-40",
    ),
    "repetition_penalty negative": (
        {"repetition_penalty": -1.5},
        "repetition_penalty must be finite and in [0.1, 10], got -1.5",
    ),
    "repetition_penalty 10.5": (
        {"repetition_penalty": 10.5},
        "repetition_penalty must be finite and in [0.1, 10], got 10.5",
    ),
    "repetition_penalty inf": (
        {"repetition_penalty": float("inf")},
        "repetition_penalty must be finite and in [0.1, 10], got inf",
    ),
}


@pytest.mark.parametrize("name", list(BOUNDS))
def test_each_bound_raises_naming_the_field_and_is_invalid_request_on_the_wire(name):
    kwargs, message = BOUNDS[name]
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message
    frame = msgspec.msgpack.encode({"type": "generate", "rid": "r", "prompt": "x", "sampling_params": kwargs})
    assert p.decode_client_frame(frame, 1 << 20) == p.ErrorResponse(
        "r", p.ERR_INVALID, f"invalid sampling_params: {message}"
    )


PYTHON_ONLY = {  # values msgpack cannot carry or the client passes by mistake: never a raw TypeError/OverflowError
    "stop token id 2**70": (
        {"stop_token_ids": [2**70]},
        "stop_token_ids must be ints in [0, 2147483647], stop_token_ids[0] is an int of 71 bits",
    ),
    "max_tokens 10**5000": (
        {"max_tokens": 10**5000},
        "max_tokens must be in [1, 2147483647], got an int of 16610 bits",
    ),
    "temperature 10**400": (
        {"temperature": 10**400},
        "temperature must be finite and in [0, 10000], got an int of 1329 bits",
    ),
    "seed below -2**63": ({"seed": -(2**63) - 1}, "seed must be in [-2**63, 2**63), got -9223372036854775809"),
    "lone surrogate stop": ({"stop": ["ok", "\ud800"]}, "stop[1] is not valid UTF-8 text (a lone surrogate)"),
    "stop as a string": ({"stop": "\n"}, "stop must be a list of strings, got str"),
    "temperature as a string": ({"temperature": "hot"}, "temperature must be a number, got str"),
    "max_tokens as a bool": ({"max_tokens": True}, "max_tokens must be an int, got bool"),
    "top_k as a float": ({"top_k": 5.0}, "top_k must be an int, got float"),
    "ignore_eos as an int": ({"ignore_eos": 1}, "ignore_eos must be a bool, got int"),
    "presence_penalty as a string": ({"presence_penalty": "high"}, "presence_penalty must be a number, got str"),
    "repetition_penalty as a bool": ({"repetition_penalty": True}, "repetition_penalty must be a number, got bool"),
}


@pytest.mark.parametrize("name", list(PYTHON_ONLY))
def test_values_of_the_wrong_type_or_beyond_msgpack_raise_invalid_sampling_params(name):
    kwargs, message = PYTHON_ONLY[name]
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message


def test_the_limits_themselves_are_accepted():
    params = SamplingParams(
        max_tokens=I32,
        top_k=I32,
        stop=["s" * 64] * 64,
        stop_token_ids=[I32] * 1024,
        temperature=1e4,
        seed=2**63 - 1,
        n=64,
        logprobs=20,
        min_tokens=I32,
        logit_bias={t: (-100.0 if t % 2 else 100) for t in range(1023)} | {I32: 0.5},
        prompt_logprobs=20,
    )
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0  # scoring: the prompt only
    assert SamplingParams(seed=-(2**63)).seed_word == 2**63
    assert SamplingParams(seed=-1).seed_word == 2**64 - 1
    assert SamplingParams(logit_bias={49151: 1.0, 49152: 2.0, 90000: 3.0}).vocab_problem(49152) == (
        "logit_bias token ids outside the vocabulary [0, 49152): [49152, 90000]"
    )
    assert (params.max_tokens, params.top_k, len(params.stop), len(params.stop_token_ids)) == (I32, I32, 64, 1024)
    assert (sp.INT32_MAX, sp.MAX_STOP_STRINGS, sp.MAX_STOP_CHARS, sp.MAX_STOP_TOKEN_IDS) == (I32, 64, 4096, 1024)


def test_temperatures_below_1e_5_are_greedy():
    assert [SamplingParams(temperature=t).greedy for t in (0.0, 1e-30, 1e-38, 9.99e-6, 1e-5, 0.5)] == [
        True,
        True,
        True,
        True,
        False,
        False,
    ]
    assert sp.GREEDY_TEMPERATURE == 1e-5


def test_the_penalty_limits_are_accepted_and_only_non_defaults_are_penalties():
    for value in (-2, -2.0, 2.0, 0.0):
        assert SamplingParams(frequency_penalty=value, presence_penalty=value).frequency_penalty == value
    assert [SamplingParams(repetition_penalty=r).repetition_penalty for r in (0.1, 1, 10.0)] == [0.1, 1, 10.0]
    assert (
        sp.MAX_FREQUENCY_PENALTY,
        sp.MAX_PRESENCE_PENALTY,
        sp.MIN_REPETITION_PENALTY,
        sp.MAX_REPETITION_PENALTY,
    ) == (2.0, 2.0, 0.1, 10.0)
    assert [
        SamplingParams(**kw).has_penalties
        for kw in (
            {},
            {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0},
            {"frequency_penalty": -0.1},
            {"presence_penalty": 0.5},
            {"repetition_penalty": 0.9},
        )
    ] == [False, False, True, True, True]
