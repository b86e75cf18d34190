"""Fixtures of the Engine tests on the loopy tiny Llama (tests/runtime/spec_helpers.py) that several files share; a
file that defines its own fixture of the same name uses that one."""

from __future__ import annotations

import pytest

from tests.runtime.spec_helpers import loopy_engine_maker, save_loopy_llama


@pytest.fixture(scope="module")
def loopy_dir(tmp_path_factory, smollm2_tokenizer):
    """The loopy tiny Llama (vocab 512), saved once per test module."""
    return save_loopy_llama(tmp_path_factory.mktemp("loopy_llama"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def make_engine(loopy_dir):
    """make(**kw) -> an Engine on the loopy model (spec_helpers.loopy_engine_maker)."""
    return loopy_engine_maker(loopy_dir)
