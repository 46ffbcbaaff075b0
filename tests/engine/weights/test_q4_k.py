"""Q4_K (K-quant) blocks load as int4 groups exactly as the gguf package dequantises them
(engine/weights/kquants.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.quants import Q4_K, dequantize

from engine.weights.kquants import Q4_K as Q4_K_NAME
from engine.weights.kquants import decode_q4_k, gguf_file_type, loads_as_int4
from engine.weights.quantization import open_gguf, read_gguf_int4


def _random_q4_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q4_K bytes [rows, cols / 256 * 144] with finite f16 d and dmin (every other byte random)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    halves = (rng.standard_normal((rows, cols // 256, 2)) * 0.01).astype(np.float16)
    raw[..., 0:4] = halves.view(np.uint8).reshape(rows, -1, 4)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q4_k_blocks_decode_into_groups_of_32_as_gguf_dequantizes_them(seed: int) -> None:
    raw = _random_q4_k(rows=6, cols=512, seed=seed)
    expected = dequantize(raw, GGMLQuantizationType.Q4_K).reshape(6, 512)
    weight = decode_q4_k(raw, rows=6)
    assert weight.group_size == 32 and weight.values.shape == (6, 512) and weight.scales.shape == (6, 16)
    assert int(weight.values.max()) <= 15
    blocks = raw.reshape(-1, 144)
    sub_scales, _ = Q4_K.get_scale_min(blocks[:, 4:16])
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    # the group scales are gguf's d * sc bit for bit; the min folds into the zero (float rounding only)
    assert np.array_equal(weight.scales.numpy().reshape(-1, 8), d * sub_scales.astype(np.float32))
    torch.testing.assert_close(weight.dequantize(), torch.from_numpy(expected), rtol=0, atol=1e-5)


def _write(path: Path, file_type: int | None, kind: GGMLQuantizationType, raw: np.ndarray) -> None:
    writer = GGUFWriter(path, "qwen2")
    if file_type is not None:
        writer.add_file_type(file_type)
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_shape=raw.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_q4_k_m_file_reads_its_q4_k_projections_and_is_int4_loadable_by_its_file_type(tmp_path: Path) -> None:
    raw = _random_q4_k(rows=4, cols=256, seed=3)
    path = tmp_path / "m.gguf"
    _write(path, int(LlamaFileType.MOSTLY_Q4_K_M), GGMLQuantizationType.Q4_K, raw)
    reader = open_gguf(path)
    assert gguf_file_type(reader) == int(LlamaFileType.MOSTLY_Q4_K_M)
    # decided by the file type, even though a Q4_K_M file mixes in Q6_K/Q8_0 projections
    assert loads_as_int4(reader, ["Q4_K", "Q6_K", "Q8_0"])
    weights = read_gguf_int4(reader, num_heads=1, num_kv_heads=1, decoders={Q4_K_NAME: decode_q4_k})
    expected = dequantize(raw, GGMLQuantizationType.Q4_K).reshape(4, 256)
    torch.testing.assert_close(
        weights["model.layers.0.mlp.up_proj"].dequantize(), torch.from_numpy(expected), rtol=0, atol=1e-5
    )


def test_other_file_types_are_not_int4_and_a_file_without_one_is_judged_by_its_projections(tmp_path: Path) -> None:
    raw = _random_q4_k(rows=4, cols=256, seed=4)
    q6 = tmp_path / "q6.gguf"
    _write(q6, int(LlamaFileType.MOSTLY_Q6_K), GGMLQuantizationType.Q4_K, raw)
    assert not loads_as_int4(open_gguf(q6), ["Q4_K"])
    bare = tmp_path / "bare.gguf"
    _write(bare, None, GGMLQuantizationType.Q4_K, raw)
    assert gguf_file_type(open_gguf(bare)) is None
    assert loads_as_int4(open_gguf(bare), ["Q4_K", "Q4_0"])
    assert not loads_as_int4(open_gguf(bare), ["Q4_K", "Q6_K"])
