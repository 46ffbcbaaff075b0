"""The files a model loads from: checkpoint directories, and the cache of GGUF files converted into them.

GGUF files are dequantized once and cached as a float32 safetensors checkpoint, because transformers' GGUF parser
is slow (~20-40 s for SmolLM2-135M on a small CPU) and the cached checkpoint loads in under a second. Every load is
local: no Hugging Face hub lookup ever happens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from engine.phases import phase

logger = logging.getLogger("batchserve.loader")

CACHE_DIR_ENV = "BATCHSERVE_CACHE_DIR"
_HASH_CHUNK_BYTES = 1 << 20
_CACHE_KEY_HEX_CHARS = 16


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


def checkpoint_dtype(directory: Path) -> torch.dtype | None:
    """The dtype a checkpoint says its weights are stored in (config.json's `dtype`/`torch_dtype`)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    value = getattr(torch, name, None) if isinstance(name, str) else None
    return value if isinstance(value, torch.dtype) else None


def parameter_count(directory: Path) -> int:
    """The weights a checkpoint directory stores, read from its safetensors headers (no tensor is read)."""
    count = 0
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is no mapping)
                shape = tensors.get_slice(name).get_shape()
                count += int(torch.Size(shape).numel())
    return count


def load_checkpoint_dir(directory: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return model, tokenizer


def load_gguf_cached(
    gguf: Path, entry: Path, level: int = logging.INFO
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Serve from the conversion cache entry (saying so at `level`), converting (and filling it) on a miss."""
    if (entry / "config.json").is_file():
        logger.log(level, "loaded from cache %s (converted from %s)", entry, gguf)
        return load_checkpoint_dir(entry)
    return _convert(gguf, entry)


def convert_gguf(gguf: Path, cache_dir: Path | None = None) -> None:
    """Convert `gguf` into its cached float32 checkpoint unless that exists: a first start's phase of its own."""
    entry = gguf_checkpoint_dir(gguf, cache_dir)
    if not (entry / "config.json").is_file():
        _convert(gguf, entry)


def _convert(gguf: Path, entry: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    with phase(logger, "converting the GGUF into a float32 checkpoint", f"once per model file: {gguf}") as running:
        model, tokenizer = _load_gguf(gguf)
        _write_dir_atomically(entry, lambda tmp: _save_checkpoint(model, tokenizer, tmp))
        running.result = f"cached in {entry}; delete it to convert again"
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
