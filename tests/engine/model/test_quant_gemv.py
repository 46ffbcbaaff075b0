"""The compiled weight-only matmuls (engine/csrc/int4_gemv.cpp, int8_gemv.cpp, int4_dot.cpp) against an exact
float64 reference, once per build of the kernels this CPU can execute, and the row-switched linear that picks
quantised or dense weights by a step's row count."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from engine.model.linear import (
    Int4DotLinear,
    Int4Linear,
    Int8Linear,
    Linear,
    RowSwitchedLinear,
    build_linear,
    pack_int4_blocks,
)
from engine.platform import native
from engine.platform.compute_thread import run_on_passing_thread
from engine.platform.cpu_features import cpu_features
from engine.weights.quantization import Int4Weight, Int8Weight
from tests.engine.helpers import int4_dot_kernels, random_int4

GROUP = 32


_dot_kernels = int4_dot_kernels
_int4 = random_int4


def _int8(n: int, k: int, seed: int = 0) -> Int8Weight:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return Int8Weight(values, torch.rand(n, generator=gen) * 0.01 + 0.001)


def _tolerance(dtype: torch.dtype, exact: torch.Tensor) -> torch.Tensor:
    # float32: summation order only; bfloat16: one rounding of the output (2^-8 relative) on top.
    relative = 1e-5 if dtype == torch.float32 else 2.0**-7
    return relative * exact.abs() + (1e-5 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 20])
def test_int4_gemv_matches_the_dequantised_weights(kernels: native.Kernels, dtype: torch.dtype, rows: int) -> None:
    weight = _int4(192, 96)
    linear = Int4Linear.build(weight, None, dtype, kernels)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = linear(x)
    assert got.dtype == dtype and got.shape == (rows, 192)
    exact = x.double() @ weight.dequantize(dtype).double().t()  # scales as the kernel reads them
    assert bool(((got.double() - exact).abs() <= _tolerance(dtype, exact)).all())
    torch_kernel = Int4Linear.build(weight, None, dtype)(x)
    torch.testing.assert_close(got.float(), torch_kernel.float(), rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module")
def lm_head_128k() -> Int4Weight:
    """Llama-3.2-1B's LM head shape (128,256 x 2,048), made once for every build."""
    return _int4(128_256, 2_048, seed=5)


def _rows(weight: Int4Weight, index: torch.Tensor) -> Int4Weight:
    return Int4Weight(weight.values[index], weight.scales[index], weight.zeros[index], weight.group_size)


def test_int4_kernels_at_a_128k_vocabulary_lm_head(kernels: native.Kernels, lm_head_128k: Int4Weight) -> None:
    """A shape the default model (49,152 x 576) never runs: a sample of output columns, spread over the whole
    vocabulary, against float64 on the same weights; the integer-dot path as close as the float path is."""
    weight = lm_head_128k
    x = torch.randn(5, 2_048, generator=torch.Generator().manual_seed(5))
    sample = torch.arange(384) * 334 + 3  # 384 columns (a multiple of 16, as torch packs), the last near the end
    sampled = _rows(weight, sample)
    got = Int4Linear.build(weight, None, torch.float32, kernels)(x)
    assert got.shape == (5, 128_256)
    exact = x.double() @ sampled.dequantize(torch.float32).double().t()
    assert bool(((got[:, sample].double() - exact).abs() <= _tolerance(torch.float32, exact)).all())
    if kernels.has_int4_dot:
        bf16_exact = x.double() @ sampled.dequantize(torch.bfloat16).double().t()  # its scales are bf16
        dot = Int4DotLinear.build(weight, None, kernels)(x)[:, sample].double()
        float_path = Int4Linear.build(sampled, None, torch.bfloat16)(x.bfloat16()).double()
        error = (dot - bf16_exact).norm() / bf16_exact.norm()
        assert error <= 1.25 * (float_path - bf16_exact).norm() / bf16_exact.norm()


@pytest.fixture(scope="module")
def int8_lm_head_128k() -> Int8Weight:
    return _int8(128_256, 2_048, seed=6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemv_at_a_128k_vocabulary_lm_head(
    kernels: native.Kernels, int8_lm_head_128k: Int8Weight, dtype: torch.dtype
) -> None:
    """The LM head as bf16 serving holds it (int8 per row, engine/weights/loader.py) at Llama-3.2-1B's shape: a
    sample of output columns over the whole vocabulary against float64 on the same weights."""
    weight = int8_lm_head_128k
    x = torch.randn(5, 2_048, generator=torch.Generator().manual_seed(6)).to(dtype)
    got = kernels.ops.int8_gemv(x, weight.values, weight.scales.to(dtype))
    assert got.dtype == dtype and got.shape == (5, 128_256)
    sample = torch.arange(384) * 334 + 3
    values, scales = weight.values[sample].double().t(), weight.scales[sample].to(dtype).double()
    exact = (x.double() @ values) * scales
    # Over 2,048 terms float32's summation error scales with the terms' magnitudes, not with their (cancelling) sum.
    magnitude = (x.double().abs() @ values.abs()) * scales
    tolerance = 1e-5 * magnitude + (2.0**-7 * exact.abs() if dtype == torch.bfloat16 else 0)
    assert bool(((got[:, sample].double() - exact).abs() <= tolerance).all())


def test_int4_linear_falls_back_to_torch_for_widths_the_kernel_does_not_tile(kernels: native.Kernels) -> None:
    weight = _int4(48, 64)  # 48 output rows: not a multiple of the 64-row tile
    x = torch.randn(2, 64)
    linear = Int4Linear.build(weight, None, torch.float32, kernels)
    assert linear.kernels is None
    assert torch.equal(linear(x), Int4Linear.build(weight, None, torch.float32)(x))
    with pytest.raises(RuntimeError, match="blocks of 64"):
        kernels.ops.int4_gemv(x, linear.packed, GROUP, linear.scales_and_zeros)


def test_the_kernels_int4_layout_is_torchs_at_its_avx512_capability() -> None:
    weight = _int4(128, 64)
    ours = pack_int4_blocks(weight.values)
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert torch.equal(ours, torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.values.to(torch.int32), 1))
    # Unpacked by hand: block 1, input 5, row 64 + 33 sits in byte 1's high nibble.
    assert int(ours.view(2, 64, 32)[1, 5, 1]) >> 4 == int(weight.values[64 + 33, 5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 12])
# K = 72 and 75: past the unrolled loop (several sums per row at 1-3 rows), a one-vector tail, and a scalar one.
@pytest.mark.parametrize("k", [72, 75])
def test_int8_gemv_matches_the_dequantised_weights(
    kernels: native.Kernels, dtype: torch.dtype, rows: int, k: int
) -> None:
    weight = _int8(300, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    # The op itself: Int8Linear hands large bfloat16 steps to torch's kernel, which crashes on K = 72 (torch 2.13).
    got = kernels.ops.int8_gemv(x, weight.values, weight.scales.to(dtype))
    assert got.dtype == dtype and got.shape == (rows, 300)
    scales = weight.scales.to(dtype).double()
    exact = (x.double() @ weight.values.double().t()) * scales
    assert bool(((got.double() - exact).abs() <= _tolerance(dtype, exact)).all())
    # bfloat16 is float32's result rounded once: the same bits whichever dtype the caller runs in.
    in_float32 = kernels.ops.int8_gemv(x.float(), weight.values, weight.scales.to(dtype).float())
    assert torch.equal(got, in_float32.to(dtype))


def test_quantised_kernels_name_a_shape_mismatch(kernels: native.Kernels) -> None:
    linear = Int4Linear.build(_int4(64, 64), None, torch.float32, kernels)
    with pytest.raises(RuntimeError, match="K must match"):
        linear(torch.randn(1, 32))
    int8 = Int8Linear.build(_int8(64, 64), None, torch.float32, kernels)
    with pytest.raises(RuntimeError, match="values must be"):
        int8(torch.randn(1, 32))


def _int8_exact_activations(rows: int, k: int) -> torch.Tensor:
    """Integers in [-127, 127] with 127 in every group of 32: int8 quantisation (scale max/127 = 1) is exact."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randint(-127, 128, (rows, k), generator=gen).float()
    x[:, ::GROUP] = 127.0
    return x.bfloat16()  # integers up to 255 are exact in bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 11])
def test_int4_dot_is_exact_where_the_activations_quantise_exactly(
    kernels: native.Kernels, dtype: torch.dtype, rows: int
) -> None:
    """Activations that int8 holds exactly leave only float rounding: this pins the layout and the zero term."""
    weight = _int4(128, 96)
    linear = build_linear(weight, None, dtype, prepack=False, kernels=_dot_kernels(kernels), int8_activations=True)
    assert isinstance(linear, Int4DotLinear)
    x = _int8_exact_activations(rows, 96).to(dtype)
    got = linear(x)
    exact = x.double() @ weight.dequantize(torch.bfloat16).double().t()  # the kernel's scales are bf16
    assert got.dtype == dtype and got.shape == (rows, 128)
    assert bool(((got.double() - exact).abs() <= _tolerance(dtype, exact)).all())


@pytest.mark.parametrize("group", [16, 32, 64])
def test_int4_dot_gives_every_build_the_same_bits(kernels: native.Kernels, group: int) -> None:
    """The int32 dot products are exact in each build (AVX2 adds up to 32 inputs' pair sums in int16 for one or two
    rows, 16 for a group of 16, two runs for 64) and folded into floats alike: the same outputs as the first
    build with integer dot products that this CPU runs, at every row count."""
    first = next(k for k in map(native.load_kernels, native.builds_for(cpu_features())) if k and k.has_int4_dot)
    weight = random_int4(64, 576, seed=group, group=group)
    linear = Int4DotLinear.build(weight, None, _dot_kernels(kernels))
    reference = Int4DotLinear.build(weight, None, first)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(group)).bfloat16()
    for rows in (1, 2, 3, 5):
        assert torch.equal(linear(x[:rows]), reference(x[:rows]))


@pytest.mark.parametrize("rows", [1, 3, 8, 21])
def test_symmetric_weights_keep_no_zeros_and_give_the_same_bits(kernels: native.Kernels, rows: int) -> None:
    """Weights whose zeros are all 0 (GGUF Q4_0) are built without zeros, a tenth fewer bytes a step: int4_dot and
    int4_gemm take the zero term as -8 s, bit for bit what the same weights give with their zeros stored."""
    weight = random_int4(64, 576, seed=rows)
    symmetric = Int4Weight(weight.values, weight.scales, torch.zeros_like(weight.zeros), weight.group_size)
    linear = Int4DotLinear.build(symmetric, None, _dot_kernels(kernels))
    assert linear.zeros.numel() == 0 and Int4DotLinear.build(weight, None, kernels).zeros.numel() > 0
    stored = dataclasses.replace(linear, zeros=torch.zeros_like(linear.scales))
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(linear(x), stored(x)) and torch.equal(linear.gemm(x), stored.gemm(x))
    assert torch.equal(linear(x.bfloat16()), stored(x.bfloat16()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_dot_on_real_valued_activations_is_as_close_as_the_float_path(
    kernels: native.Kernels, dtype: torch.dtype
) -> None:
    """Two int8 digits per activation (leading and residual) leave an error at the output's own bf16 rounding:
    no worse than torch's float kernel (a single digit was 5x worse, and +1.6 % perplexity)."""
    weight = _int4(256, 576)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(3)).bfloat16().to(dtype)
    exact = x.double() @ weight.dequantize(torch.bfloat16).double().t()

    def relative(y: torch.Tensor) -> float:
        return ((y.double() - exact).norm() / exact.norm()).item()

    # The float path on bf16 activations: the reference the dot path's quality was measured against.
    float_path = relative(Int4Linear.build(weight, None, torch.bfloat16)(x.bfloat16()))
    assert relative(Int4DotLinear.build(weight, None, _dot_kernels(kernels))(x)) <= 1.25 * float_path


def test_int4_dot_is_chosen_only_where_its_layout_and_the_build_allow(kernels: native.Kernels) -> None:
    weight = _int4(48, 64)  # 48 rows: a multiple of 16
    assert Int4DotLinear.supports(weight, torch.bfloat16) and Int4DotLinear.supports(weight, torch.float32)
    assert not Int4DotLinear.supports(_int4(40, 64), torch.bfloat16)
    plain = build_linear(weight, None, torch.bfloat16, prepack=False, kernels=kernels, int8_activations=False)
    assert isinstance(plain, Int4Linear)
    chosen = build_linear(weight, None, torch.bfloat16, prepack=False, kernels=kernels, int8_activations=True)
    assert isinstance(chosen, Int4DotLinear if kernels.has_int4_dot else Int4Linear)


def test_which_builds_have_integer_dot_products(kernels: native.Kernels) -> None:
    assert kernels.has_int4_dot == (kernels.build.name in ("avx512_bf16", "avx512_vnni", "avx2_vnni", "avx2"))


def test_row_switched_linear_uses_quantised_weights_up_to_its_limit_and_dense_past_it() -> None:
    weight = _int4(64, 64)
    quantized = Int4Linear.build(weight, None, torch.float32)
    dense = Linear(torch.zeros(64, 64), None)  # distinguishable: every dense output is 0
    switched = RowSwitchedLinear(quantized, dense, max_quantized_rows=4)
    small, large = torch.randn(4, 64), torch.randn(5, 64)
    assert torch.equal(switched(small), quantized(small)) and bool(switched(small).abs().sum() > 0)
    assert torch.equal(switched(large), torch.zeros(5, 64))
    assert switched.in_features == 64


def test_passing_thread_returns_the_result_and_ends() -> None:
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 7

    assert run_on_passing_thread(work) == 7
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()


def test_passing_thread_reraises_the_work_s_exception() -> None:
    def work() -> None:
        raise ValueError("bad checkpoint")

    with pytest.raises(ValueError, match="bad checkpoint"):
        run_on_passing_thread(work)
