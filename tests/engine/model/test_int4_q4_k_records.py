"""A Q4_K tensor's own terms in the integer-dot kernels (engine/model/linear.py q4_k_records, engine/csrc/quant.h
GroupTerms): per group a scale code and a min code, per super-block f16 d and dmin, 2.5 bytes a group and row where
bf16 scales and zeros take 4. int4_dot and int4_gemm read them exactly, in every build this CPU executes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.model.linear import Int4DotLinear
from engine.platform import native
from engine.weights.kquants import decode_q4_k
from engine.weights.quantization import Int4Weight, concat_rows
from tests.engine.helpers import int4_dot_kernels, random_int4
from tests.tiny_gguf import quantize_q4_k

ROWS_OUT, INPUTS = 48, 768  # 3 blocks of 16 rows, 3 super-blocks of 8 groups of 32


def _q4_k(seed: int, codes_below: int = 64) -> tuple[Int4Weight, torch.Tensor]:
    """A Q4_K weight decoded as the loader decodes it, and gguf's own dequantisation of the same blocks. With
    `codes_below` 32 and d = dmin = 2^-9, every scale (code * 2^-9) and zero ((8 code - min code) * 2^-9, at most 8
    significant bits) is exact in bfloat16 too."""
    rng = np.random.default_rng(seed)
    blocks = quantize_q4_k((rng.standard_normal((ROWS_OUT, INPUTS)) * 0.02).astype(np.float32))
    if codes_below < 64:
        raw = blocks.reshape(ROWS_OUT, -1, 144)
        raw[..., 0:4] = np.array([2.0**-9, 2.0**-9], dtype=np.float16).view(np.uint8)  # d, dmin
        # Bytes 4-11 hold codes 0-3 in bits 0-5 and codes 4-7's top two bits in bits 6-7: below 32 all.
        raw[..., 4:12] &= 0x1F
    reference = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q4_K).reshape(ROWS_OUT, INPUTS))
    return decode_q4_k(blocks, rows=ROWS_OUT), reference


def _exact_activations(rows: int) -> torch.Tensor:
    """Integers in [-127, 127] with 127 in every group of 32: one or two int8 digits hold them exactly."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randint(-127, 128, (rows, INPUTS), generator=gen).float()
    x[:, ::32] = 127.0
    return x


def test_a_q4_k_weight_builds_its_records_and_others_their_bfloat16_terms(kernels: native.Kernels) -> None:
    build = int4_dot_kernels(kernels)
    weight, _ = _q4_k(seed=0)
    linear = Int4DotLinear.build(weight, None, build)
    assert linear.scales.dtype == torch.uint8 and linear.scales.shape == (ROWS_OUT // 16, INPUTS // 256, 320)
    assert linear.zeros.numel() == 0
    plain = Int4DotLinear.build(dataclasses.replace(weight, q4_k=None), None, build)
    assert plain.scales.dtype == torch.bfloat16 and plain.zeros.numel() > 0
    # 2.5 bytes a group and row against 4
    assert linear.scales.numel() * 8 == (plain.scales.numel() + plain.zeros.numel()) * 2 * 5
    # Fused rows keep the records only where every part has them (a Q4_K_M file's requantised Q6_K rows have none).
    assert concat_rows([weight, weight]).q4_k is not None  # type: ignore[union-attr]
    assert concat_rows([weight, random_int4(16, INPUTS)]).q4_k is None  # type: ignore[union-attr]


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 21])
def test_q4_k_records_give_gguf_s_own_weights_where_the_activations_quantise_exactly(
    kernels: native.Kernels, rows: int
) -> None:
    """s = d * code and z - 8 s = -dmin * min code in float32 are gguf's dequantisation exactly, so only the float
    sums' order is left (1e-5 of the terms' magnitude); bf16 scales and zeros would miss by up to 3.6 % of a step."""
    weight, reference = _q4_k(seed=rows)
    linear = Int4DotLinear.build(weight, None, int4_dot_kernels(kernels))
    x = _exact_activations(rows)
    exact = x.double() @ reference.double().t()
    bound = 1e-5 * (x.double().abs() @ reference.double().abs().t()) + 1e-9
    for got in (linear(x), linear.gemm(x)):
        assert got.shape == (rows, ROWS_OUT)
        assert bool(((got.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17])
def test_q4_k_records_give_the_bits_of_the_same_values_as_bfloat16_terms(
    kernels: native.Kernels, dtype: torch.dtype, rows: int
) -> None:
    """Where every scale and zero is exact in bfloat16 (codes below 32, power-of-two d and dmin) both forms hold the
    same numbers, so int4_dot and int4_gemm give the same bits from either: the records are read for the right
    group, row and super-block, on the packed and the unpacked int4_gemm paths alike."""
    weight, _ = _q4_k(seed=10 + rows, codes_below=32)
    assert weight.q4_k is not None and int(weight.q4_k.scale_codes.max()) < 32 and int(weight.q4_k.min_codes.max()) < 32
    assert torch.equal(weight.scales.bfloat16().float(), weight.scales)
    assert torch.equal(weight.zeros.bfloat16().float(), weight.zeros)
    build = int4_dot_kernels(kernels)
    records = Int4DotLinear.build(weight, None, build)
    plain = Int4DotLinear.build(dataclasses.replace(weight, q4_k=None), None, build)
    assert records.scales.dtype == torch.uint8 and plain.scales.dtype == torch.bfloat16
    x = torch.randn(rows, INPUTS, generator=torch.Generator().manual_seed(rows)).to(dtype)
    assert torch.equal(records(x), plain(x))
    assert torch.equal(records.gemm(x), plain.gemm(x))


def test_the_kernels_name_malformed_records(kernels: native.Kernels) -> None:
    linear = Int4DotLinear.build(_q4_k(seed=3)[0], None, int4_dot_kernels(kernels))
    x = torch.randn(1, INPUTS)
    with pytest.raises(RuntimeError, match="Q4_K records must be"):
        linear.kernels.ops.int4_dot(x, linear.packed, 32, linear.scales[:, :2].contiguous(), linear.zeros)
    with pytest.raises(RuntimeError, match="Q4_K records must be"):
        linear.kernels.ops.int4_gemm(x, linear.packed, 32, linear.scales, torch.zeros(48, dtype=torch.bfloat16))
