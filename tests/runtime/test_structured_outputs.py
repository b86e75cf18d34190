"""StructuredOutputs on SamplingParams and on the wire: the options it is refused with, and a GenerateRequest that
carries one through the ZeroMQ client's encoding and the tokenizer process's strict decode unchanged (and a malformed
one rejected there, naming the field)."""

from __future__ import annotations

import msgspec
import pytest

from runtime import protocol as p
from runtime.client.wire import build_request, encode_request
from runtime.protocol.client_frame import decode_client_frame
from runtime.sampling_params import InvalidSamplingParams, SamplingParams
from runtime.structured_outputs import InvalidStructuredOutputs, StructuredOutputs

SO = StructuredOutputs(json='{"type": "object"}')


def test_refused_with_beam_search_ignore_eos_and_min_tokens():
    with pytest.raises(InvalidSamplingParams, match="use_beam_search"):
        SamplingParams(n=2, temperature=0.0, use_beam_search=True, structured_outputs=SO)
    with pytest.raises(InvalidSamplingParams, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=SO)
    # min_tokens masks EOS, which a complete constraint alone allows: the row had no token left, and the request
    # failed with a 500 ("the grammar rejects sampled token 0") whenever the constraint ended before min_tokens
    with pytest.raises(InvalidSamplingParams, match="min_tokens"):
        SamplingParams(min_tokens=5, structured_outputs=SO)
    with pytest.raises(InvalidSamplingParams, match="must be a StructuredOutputs"):
        SamplingParams(structured_outputs={"json": "{}"})  # type: ignore[arg-type]
    assert SamplingParams(n=3, temperature=1.0, structured_outputs=SO).structured_outputs == SO


def test_exactly_one_constraint():
    with pytest.raises(InvalidStructuredOutputs, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(InvalidStructuredOutputs, match="exactly one"):
        StructuredOutputs()
    assert [StructuredOutputs(**{k: v}).kind for k, v in (("regex", "a"), ("json_object", True))] == [
        "regex",
        "json_object",
    ]


def test_the_zeromq_wire_carries_it_unchanged():
    for so in (SO, StructuredOutputs(choice=["yes", "no"]), StructuredOutputs(structural_tag='{"type": "x"}')):
        params = {"max_tokens": 8, "temperature": 0.0, "structured_outputs": so}
        req = build_request("r1", "hi", None, None, False, None, params)
        decoded = decode_client_frame(encode_request(req), 1 << 20)
        assert isinstance(decoded, p.GenerateRequest)
        assert decoded.sampling_params.structured_outputs == so


def test_a_malformed_constraint_on_the_wire_is_rejected_naming_it():
    frame = msgspec.msgpack.encode(
        {"type": "generate", "rid": "r2", "prompt": "hi", "sampling_params": {"structured_outputs": {"regex": ""}}}
    )
    answer = decode_client_frame(frame, 1 << 20)
    assert isinstance(answer, p.ErrorResponse) and answer.rid == "r2"
    assert "structured_outputs.regex is empty" in answer.message
