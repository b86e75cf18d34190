"""ModelRunner's context limit: max_model_len above the model's max_position_embeddings is capped, with one warning
naming both values (issue 12, class 6: no silent misconfiguration)."""

from __future__ import annotations

from runtime.config import ServerArgs
from runtime.model.runner import ModelRunner

CAP = 1024  # the tiny model's max_position_embeddings (tests/conftest.py)


def _runner_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "runtime.model.runner" and r.levelname == "WARNING"]


def test_max_model_len_above_the_model_is_capped_with_one_warning_and_only_then(tiny_llama_dir, caplog):
    with caplog.at_level("WARNING", logger="runtime.model.runner"):
        runner = ModelRunner(ServerArgs(model=str(tiny_llama_dir), num_blocks=300, block_size=4, max_model_len=100000))
    assert runner.max_model_len == runner.ready.max_model_len == CAP
    assert _runner_warnings(caplog) == [
        f"max_model_len 100000 exceeds the model's max_position_embeddings {CAP}: capped at {CAP}"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="runtime.model.runner"):  # within the model, or unset: nothing logged
        for max_model_len, expected in ((CAP, CAP), (None, CAP), (200, 200)):
            args = ServerArgs(model=str(tiny_llama_dir), num_blocks=300, block_size=4, max_model_len=max_model_len)
            assert ModelRunner(args).max_model_len == expected
    assert _runner_warnings(caplog) == []
