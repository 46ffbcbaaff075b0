"""Weight-only quantised weights: read from a GGUF file's own blocks, or quantised from dense weights at load.

Both forms are kept unpacked here (one value per element), so that the runner can concatenate q/k/v and gate/up
along the output rows before packing them for torch's kernels (engine/model/linear.py):

- `Int4Weight`: values 0..15 in groups of `group_size` along the input dimension, each group with a scale and a
  zero, dequantised as torch's int4 kernels do: w = (q - 8) * scale + zero.
  GGUF Q4_1 (w = d * q + m) maps exactly with scale = d, zero = m + 8d; Q4_0 (w = d * (q - 8)) with zero = 0.
- `Int8Weight`: int8 values with one scale per output row (torch's `_weight_int8pack_mm` has no groups).
- `Int6Weight`: GGUF Q6_K's values as the file holds them (engine/weights/kquants.py reads them), w = d * s * (q - 32),
  what llama.cpp keeps a 4-bit file's LM head in.

GGUF Q8_0 keeps a scale per 32 values, which a per-row int8 scale cannot hold; such tensors are requantised per
row (`int8_from_dense`) from their dequantised values, the loss measured in docs/quantization.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

GROUP_SIZE = 32  # GGUF's Q4/Q8 block size, and the int4 group the kernels use
_INT4_LEVELS = 15


@dataclass(frozen=True)
class Int4Weight:
    values: torch.Tensor  # [out, in] uint8 in 0..15
    scales: torch.Tensor  # [out, in // group_size] float32
    zeros: torch.Tensor  # [out, in // group_size] float32
    group_size: int = GROUP_SIZE

    def dequantize(self, scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in] float32, as torch's int4 matmul reads it with its scales and zeros in `scale_dtype` (the
        activations' dtype)."""
        scales = self.scales.to(scale_dtype).float().repeat_interleave(self.group_size, dim=1)
        zeros = self.zeros.to(scale_dtype).float().repeat_interleave(self.group_size, dim=1)
        return (self.values.float() - 8) * scales + zeros


@dataclass(frozen=True)
class Int8Weight:
    values: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] float32

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales[:, None]


@dataclass(frozen=True)
class Int6Weight:
    values: torch.Tensor  # [out, in] uint8 in 0..63
    sub_scales: torch.Tensor  # [out, in // 16] int8, one per 16 inputs
    super_scales: torch.Tensor  # [out, in // 256] float32, one per 256 inputs

    def dequantize(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """[out, in] float32 (those `rows`: a slice or row indices): d * s * (q - 32), as gguf's dequantizer computes
        it."""
        codes = self.values[rows]
        out, inputs = codes.shape
        scales = self.super_scales[rows].repeat_interleave(16, dim=1) * self.sub_scales[rows].float()  # [out, in/16]
        return ((codes.float() - 32).view(out, inputs // 16, 16) * scales[..., None]).view(out, inputs)


QuantizedWeight = Int4Weight | Int8Weight | Int6Weight


def embedding_in_q6_k_head(config: Any, quantized: Mapping[str, QuantizedWeight]) -> bool:
    """Whether the model's token embedding is its LM head's Q6_K values, tokens looked up in the head's rows: where
    the model ties the two and the head is Q6_K (llama.cpp's 4-bit files keep that one tensor so, a 128k-token
    vocabulary's 216 MB)."""
    return isinstance(quantized.get("lm_head"), Int6Weight) and bool(getattr(config, "tie_word_embeddings", False))


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack several weights' output rows (fused q/k/v, gate/up); all must have the same kind and groups."""
    first = weights[0]
    if len(weights) == 1:
        return first
    if isinstance(first, Int4Weight):
        int4 = [w for w in weights if isinstance(w, Int4Weight) and w.group_size == first.group_size]
        if len(int4) != len(weights):
            raise ValueError("cannot fuse int4 weights with other kinds or group sizes")
        return Int4Weight(
            torch.cat([w.values for w in int4]),
            torch.cat([w.scales for w in int4]),
            torch.cat([w.zeros for w in int4]),
            first.group_size,
        )
    int8 = [w for w in weights if isinstance(w, Int8Weight)]
    if len(int8) != len(weights):
        raise ValueError("cannot fuse int8 weights with other kinds")
    return Int8Weight(torch.cat([w.values for w in int8]), torch.cat([w.scales for w in int8]))


def int4_from_dense(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Weight:
    """Asymmetric min/max quantisation per group of `group_size` inputs: w ~ scale * q + min, q in 0..15."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"input size {in_features} is not a multiple of the int4 group size {group_size}")
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / _INT4_LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
    values = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, _INT4_LEVELS)
    return Int4Weight(values.to(torch.uint8).reshape(out_features, in_features), scales, low + 8 * scales, group_size)


# Rows converted at a time: bounds a conversion's float32 temporaries (a 128k-token vocabulary's head: 100 MB, not
# the 3 GB that converting it whole held at the load's peak).
_CONVERT_ROWS = 4096


def int8_from_dense(weight: torch.Tensor | Int6Weight) -> Int8Weight:
    """Symmetric per-row int8: w ~ scale * q, q in -127..127, of a dense weight or an Int6Weight's values."""
    out, inputs = weight.values.shape if isinstance(weight, Int6Weight) else weight.shape
    values = torch.empty(out, inputs, dtype=torch.int8)
    scales = torch.empty(out, dtype=torch.float32)
    for start in range(0, out, _CONVERT_ROWS):
        rows = slice(start, min(start + _CONVERT_ROWS, out))
        dense = weight.dequantize(rows) if isinstance(weight, Int6Weight) else weight[rows].detach().float()
        scales[rows] = (dense.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        values[rows] = torch.round(dense / scales[rows, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(values, scales)


# --- GGUF blocks ---------------------------------------------------------------------------------------------

_Q4_0, _Q4_1 = "Q4_0", "Q4_1"
INT4_GGUF_TYPES = frozenset({_Q4_0, _Q4_1})

# llama.cpp's tensor names for one decoder layer's projections -> the Hugging Face module under `model.layers.N`.
_LAYER_PROJECTIONS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Architectures whose converter permutes q/k rows for llama.cpp's RoPE layout (transformers reverses it).
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama", "mistral"})


def hf_module_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj`; `output.weight` -> `lm_head`; else None."""
    if gguf_name == "output.weight":
        return "lm_head"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_PROJECTIONS:
        return f"model.layers.{parts[1]}.{_LAYER_PROJECTIONS[parts[2]]}"
    return None


def _blocks(data: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    """The raw bytes of a quantised tensor as [rows, blocks per row, bytes per block]."""
    return np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> torch.Tensor:
    return torch.from_numpy(
        np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0].copy()
    ).float()


def _nibbles(packed: np.ndarray) -> torch.Tensor:
    """ggml's Q4 layout: byte j holds element j in its low nibble and element j + 16 in its high one."""
    quants = torch.from_numpy(packed.copy())
    values = torch.cat((quants & 0x0F, quants >> 4), dim=-1)  # [rows, blocks, 32]
    return values.reshape(values.shape[0], -1)


def decode_q4(kind: str, data: np.ndarray, rows: int) -> Int4Weight:
    """A Q4_0 or Q4_1 tensor's blocks as an `Int4Weight`, with the file's own scales (no requantisation)."""
    if kind == _Q4_1:  # per block: f16 d, f16 m, 16 bytes of nibbles; w = d * q + m
        blocks = _blocks(data, rows, 20)
        scale, low = _f16(blocks, 0), _f16(blocks, 2)
        return Int4Weight(_nibbles(blocks[..., 4:]), scale, low + 8 * scale)
    if kind == _Q4_0:  # per block: f16 d, 16 bytes of nibbles; w = d * (q - 8)
        blocks = _blocks(data, rows, 18)
        scale = _f16(blocks, 0)
        return Int4Weight(_nibbles(blocks[..., 2:]), scale, torch.zeros_like(scale))
    raise ValueError(f"not a 4-bit GGUF type: {kind}")


def _unpermute_rows(weight: Int4Weight, heads: int) -> Int4Weight:
    """Undo llama.cpp's q/k row interleaving, as transformers' GGUF loader does for dense weights."""
    rows = weight.values.shape[0]
    order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)
    return Int4Weight(weight.values[order], weight.scales[order], weight.zeros[order], weight.group_size)


def open_gguf(path: Path) -> Any:
    """A `gguf.GGUFReader` over the file (memory-mapped; parsing its metadata takes a few seconds)."""
    from gguf import GGUFReader

    return GGUFReader(path)


def gguf_projection_types(reader: Any) -> dict[str, str]:
    """GGUF tensor type name (`Q4_1`, `Q8_0`, `F32`...) of each projection, keyed by Hugging Face module name."""
    types = {}
    for tensor in reader.tensors:
        name = hf_module_name(tensor.name)
        if name is not None:
            types[name] = tensor.tensor_type.name
    return types


def read_gguf_int4(
    reader: Any,
    num_heads: int,
    num_kv_heads: int,
    decoders: Mapping[str, Callable[[np.ndarray, int], Int4Weight]] | None = None,
) -> dict[str, Int4Weight]:
    """Every Q4_0/Q4_1 projection of the file (`open_gguf`), and those of the types `decoders` decodes (Q4_K:
    engine/weights/kquants.py), keyed by Hugging Face module name; other types are left out."""
    decoders = decoders or {}
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field is not None else ""
    weights: dict[str, Int4Weight] = {}
    for tensor in reader.tensors:
        name = hf_module_name(tensor.name)
        kind = tensor.tensor_type.name
        if name is None or (kind not in INT4_GGUF_TYPES and kind not in decoders):
            continue
        rows = int(tensor.shape[1])  # GGUF lists dimensions innermost first: [in, out]
        weight = decoders[kind](tensor.data, rows) if kind in decoders else decode_q4(kind, tensor.data, rows)
        if arch in _PERMUTED_QK_ARCHITECTURES and name.endswith(("q_proj", "k_proj")):
            weight = _unpermute_rows(weight, num_heads if name.endswith("q_proj") else num_kv_heads)
        weights[name] = weight
    return weights


def check_matches(quantized: Mapping[str, QuantizedWeight], modules: Mapping[str, torch.Tensor]) -> None:
    """Fail loudly if a quantised weight is not the dense weight it replaces (a wrong name map or permutation).

    Only for weights read from a file (exact up to float rounding): checks every tensor's shape and the values of
    the first layer's."""
    for name, weight in quantized.items():
        dense = modules[name]
        if tuple(weight.values.shape) != tuple(dense.shape):
            raise ValueError(f"{name}: quantised shape {tuple(weight.values.shape)} != model's {tuple(dense.shape)}")
        if name.startswith("model.layers.0."):
            error = (weight.dequantize() - dense.float()).abs().max().item()
            if error > 1e-3 * max(dense.abs().max().item(), 1e-6):
                raise ValueError(f"{name}: GGUF blocks do not match the model's weight (max error {error:.3g})")
