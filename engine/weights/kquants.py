"""GGUF K-quant blocks: Q4_K as `Int4Weight`, Q6_K (a 4-bit file's LM head) as `Int6Weight`, and which GGUF files
load as int4.

A Q4_K super-block holds 256 weights: f16 d and dmin, 12 bytes packing eight 6-bit scales and mins, and 128 bytes
of nibbles. Each 32-weight sub-block j dequantises as w = d * sc[j] * q - dmin * m[j], which is an `Int4Weight`
group of 32 exactly: scale = d * sc[j], zero = 8 * scale - dmin * m[j], the 4-bit codes unchanged.

A Q6_K super-block holds 256 weights in 210 bytes: 128 of low nibbles, 64 of top two bits, 16 signed 8-bit scales
(one per 16 weights) and an f16 d; w = d * sc[j] * (q - 32). llama.cpp's 4-bit files keep the LM head (or the tied
token embedding) in it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.weights.quantization import Int4Weight, Int6Weight

Q4_K = "Q4_K"
Q6_K = "Q6_K"
_BLOCK_BYTES = 144  # f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles
_Q6_K_BLOCK_BYTES = 210  # 128 bytes of low nibbles, 64 of top bits, 16 scales, f16 d
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


def decode_q6_k(data: np.ndarray, rows: int) -> Int6Weight:
    """A Q6_K tensor's blocks as an `Int6Weight` (no requantisation). Per 128-weight half of a super-block, 32-weight
    runs m = 0..3 take their low nibbles from bytes 0-31 / 32-63 of the half's 64 (low, low, high, high nibbles) and
    their top two bits from bits 2m..2m+1 of the half's 32 bytes of `qh`."""
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1, _Q6_K_BLOCK_BYTES)
    supers = blocks.shape[1]
    low = blocks[..., :128].reshape(rows, supers, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    top = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    codes = (low & 0x0F).reshape(rows, supers, 2, 4, 32) | (top & 0x03) << 4
    sub_scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(rows, -1)
    d = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16).astype(np.float32).reshape(rows, supers)
    return Int6Weight(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1)),
        torch.from_numpy(sub_scales.copy()),
        torch.from_numpy(d),
    )


def read_q6_k_head(reader: Any) -> Int6Weight | None:
    """The file's LM head (`output.weight`, else the token embedding it is tied to) if it is Q6_K, else None."""
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if head is None or head.tensor_type.name != Q6_K:
        return None
    return decode_q6_k(head.data, int(head.shape[1]))  # GGUF lists dimensions innermost first: [in, out]


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
