"""Q6_K blocks (a 4-bit GGUF's LM head) load as `Int6Weight` exactly as the gguf package dequantises them, and the
head is found where llama.cpp writes it: `output.weight`, or the token embedding it is tied to
(engine/weights/kquants.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from engine.weights.kquants import decode_q6_k, read_q6_k_head
from engine.weights.quantization import concat_rows, open_gguf


def _random_q6_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q6_K bytes [rows, cols / 256 * 210] with a finite f16 d (every other byte random: all codes, signed
    scales)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 256, 210), dtype=np.uint8)
    raw[..., 208:210] = (rng.standard_normal((rows, cols // 256, 1)) * 1e-3).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q6_k_blocks_decode_as_gguf_dequantizes_them(seed: int) -> None:
    raw = _random_q6_k(rows=5, cols=512, seed=seed)
    expected = dequantize(raw, GGMLQuantizationType.Q6_K).reshape(5, 512)
    weight = decode_q6_k(raw, rows=5)
    assert (
        weight.values.shape == (5, 512) and weight.sub_scales.shape == (5, 32) and weight.super_scales.shape == (5, 2)
    )
    assert int(weight.values.max()) == 63 and int(weight.values.min()) == 0
    assert weight.sub_scales.dtype == torch.int8 and int(weight.sub_scales.min()) < 0
    torch.testing.assert_close(weight.dequantize(), torch.from_numpy(expected), rtol=0, atol=0)
    assert concat_rows([weight]) is weight  # a lone head passes through the runner's row fusion


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]) -> Path:
    writer = GGUFWriter(str(path), "llama")
    for name, (blocks, kind) in tensors.items():
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_head_is_output_weight_or_the_tied_embedding(tmp_path: Path) -> None:
    embedding, head = _random_q6_k(32, 256, seed=3), _random_q6_k(32, 256, seed=4)
    q6_k = GGMLQuantizationType.Q6_K
    tied = read_q6_k_head(open_gguf(_write(tmp_path / "tied.gguf", {"token_embd.weight": (embedding, q6_k)})))
    assert tied is not None
    torch.testing.assert_close(tied.dequantize(), torch.from_numpy(dequantize(embedding, q6_k).reshape(32, 256)))
    both = {"token_embd.weight": (embedding, q6_k), "output.weight": (head, q6_k)}
    untied = read_q6_k_head(open_gguf(_write(tmp_path / "untied.gguf", both)))
    assert untied is not None
    torch.testing.assert_close(untied.dequantize(), torch.from_numpy(dequantize(head, q6_k).reshape(32, 256)))


def test_a_head_of_another_type_is_left_to_int8(tmp_path: Path) -> None:
    dense = np.random.default_rng(5).standard_normal((32, 256)).astype(np.float32)
    q8_0 = GGMLQuantizationType.Q8_0
    path = _write(tmp_path / "q8.gguf", {"output.weight": (quantize(dense, q8_0), q8_0)})
    assert read_q6_k_head(open_gguf(path)) is None
