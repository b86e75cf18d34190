"""A base model without a chat template (as gemma3-270m's GGUF): completions work, and a chat request is refused with
an invalid-request error (HTTP 400) that says what to do instead, leaving nothing queued."""

from __future__ import annotations

import json
import shutil

import pytest

from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from runtime.scheduler.request import RequestRejected


@pytest.fixture
def base_model_dir(tiny_llama_dir, tmp_path):
    folder = tmp_path / "base"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_chat_is_refused_clearly_and_completions_work(base_model_dir):
    engine = Engine(model=str(base_model_dir), dtype="float32", num_blocks=32, block_size=4)
    try:
        assert engine.tokenizer is not None and engine.tokenizer.chat_template is None
        with pytest.raises(RequestRejected, match=r"no chat template .*send a prompt to /v1/completions") as info:
            engine.generate(messages=[[{"role": "user", "content": "hi"}]])
        assert info.value.code == "invalid_request"
        out = engine.generate("Once upon a time", sampling_params=SamplingParams(max_tokens=4, temperature=0.0))[0]
        assert len(out.token_ids) == 4 and out.finish_reason == "length"
    finally:
        engine.shutdown()
