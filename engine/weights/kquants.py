"""GGUF K-quant (Q4_K) blocks as `Int4Weight`, and which GGUF files load as int4.

A Q4_K super-block holds 256 weights: f16 d and dmin, 12 bytes packing eight 6-bit scales and mins, and 128 bytes
of nibbles. Each 32-weight sub-block j dequantises as w = d * sc[j] * q - dmin * m[j], which is an `Int4Weight`
group of 32 exactly: scale = d * sc[j], zero = 8 * scale - dmin * m[j], the 4-bit codes unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.weights.quantization import Int4Weight

Q4_K = "Q4_K"
_BLOCK_BYTES = 144  # f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles
# llama.cpp's general.file_type codes (gguf.LlamaFileType) whose 4-bit projections load as int4.
_INT4_FILE_TYPES = {2: "Q4_0", 3: "Q4_1", 14: "Q4_K_S", 15: "Q4_K_M"}


def _scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of each super-block, from its 12 bytes ([..., 12] -> two [..., 8])."""
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low & 0x3F, (extra & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([high & 0x3F, (extra >> 4) | ((high >> 2) & 0x30)], axis=-1)
    return scales, mins


def decode_q4_k(data: np.ndarray, rows: int) -> Int4Weight:
    """A Q4_K tensor's blocks as an `Int4Weight` with groups of 32 (no requantisation)."""
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1, _BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, blocks, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    sub_scales, sub_mins = _scales_mins(blocks[..., 4:16])
    scale = d * sub_scales.astype(np.float32)  # [rows, blocks, 8], as gguf's dequantizer computes it
    low = dmin * sub_mins.astype(np.float32)
    # 32-byte chunk c holds sub-block 2c in its low nibbles and sub-block 2c + 1 in its high ones.
    packed = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)
    codes = (packed >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F
    values = torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1))
    scales = torch.from_numpy(scale.reshape(rows, -1))
    return Int4Weight(values, scales, 8 * scales - torch.from_numpy(low.reshape(rows, -1)))


def gguf_file_type(reader: Any) -> int | None:
    """general.file_type of a `gguf.GGUFReader`, None if the file does not say."""
    field = reader.fields.get("general.file_type")
    return None if field is None else int(field.parts[field.data[0]][0])


def loads_as_int4(reader: Any, projection_types: list[str]) -> bool:
    """Whether a GGUF's projections load as int4: its file type is a 4-bit one (Q4_0, Q4_1, Q4_K_S, Q4_K_M),
    whatever mix of types llama.cpp chose per tensor; a file without a file type, if all its projections are
    4-bit. Projections of other types (Q6_K, Q8_0...) are then requantised to int4 from their dense weights."""
    file_type = gguf_file_type(reader)
    if file_type is not None:
        return file_type in _INT4_FILE_TYPES
    return bool(projection_types) and all(kind in ("Q4_0", "Q4_1", Q4_K) for kind in projection_types)
