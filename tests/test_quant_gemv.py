"""The compiled weight-only matmuls (engine/csrc/quant_gemv.cpp) against an exact float64 reference, and the
row-switched linear that picks quantised or dense weights by a step's row count."""

from __future__ import annotations

import threading

import pytest
import torch

from engine import native
from engine.compute_thread import run_on_passing_thread
from engine.linear import Int4DotLinear, Int4Linear, Int8Linear, Linear, RowSwitchedLinear, build_linear
from engine.quantization import Int4Weight, Int8Weight

needs_kernels = pytest.mark.skipif(not native.load_fused_ops(), reason="the C++ extension does not build here")
needs_vnni = pytest.mark.skipif(
    not (native.load_fused_ops() and native.cpu_has("avx512_vnni", "avx512bw")), reason="needs AVX-512 VNNI"
)
GROUP = 32


def _int4(n: int, k: int, seed: int = 0) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // GROUP, generator=gen) * 0.05 + 0.01
    zeros = (torch.rand(n, k // GROUP, generator=gen) - 0.5) * 0.1
    return Int4Weight(values, scales, zeros, GROUP)


def _int8(n: int, k: int, seed: int = 0) -> Int8Weight:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return Int8Weight(values, torch.rand(n, generator=gen) * 0.01 + 0.001)


def _tolerance(dtype: torch.dtype, exact: torch.Tensor) -> torch.Tensor:
    # float32: summation order only; bfloat16: one rounding of the output (2^-8 relative) on top.
    relative = 1e-5 if dtype == torch.float32 else 2.0**-7
    return relative * exact.abs() + (1e-5 if dtype == torch.float32 else 1e-3)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
def test_int4_gemv_matches_the_dequantised_weights(dtype: torch.dtype, rows: int) -> None:
    weight = _int4(192, 96)
    linear = Int4Linear.build(weight, None, dtype, native=True)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = linear(x)
    assert got.dtype == dtype and got.shape == (rows, 192)
    exact = x.double() @ weight.dequantize(dtype).double().t()  # scales as the kernel reads them
    assert bool(((got.double() - exact).abs() <= _tolerance(dtype, exact)).all())
    torch_kernel = Int4Linear.build(weight, None, dtype, native=False)(x)
    torch.testing.assert_close(got.float(), torch_kernel.float(), rtol=2e-2, atol=2e-2)


@needs_kernels
def test_int4_gemv_falls_back_to_torch_for_widths_it_does_not_tile() -> None:
    weight = _int4(48, 64)  # 48 output rows: not a multiple of the 64-row tile
    x = torch.randn(2, 64)
    got = torch.ops.batchserve.int4_gemv(
        x,
        Int4Linear.build(weight, None, torch.float32).packed,
        GROUP,
        Int4Linear.build(weight, None, torch.float32).scales_and_zeros,
    )
    assert torch.equal(got, Int4Linear.build(weight, None, torch.float32, native=False)(x))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 8, 12])
def test_int8_gemv_matches_the_dequantised_weights(dtype: torch.dtype, rows: int) -> None:
    weight = _int8(300, 72)  # K = 72: a tail past the 16-wide vector loop
    x = torch.randn(rows, 72, generator=torch.Generator().manual_seed(rows)).to(dtype)
    # The op itself: Int8Linear hands large bfloat16 steps to torch's kernel, which crashes on K = 72 (torch 2.13).
    got = torch.ops.batchserve.int8_gemv(x, weight.values, weight.scales.to(dtype))
    assert got.dtype == dtype and got.shape == (rows, 300)
    scales = weight.scales.to(dtype).double()
    exact = (x.double() @ weight.values.double().t()) * scales
    assert bool(((got.double() - exact).abs() <= _tolerance(dtype, exact)).all())


@needs_kernels
def test_quantised_kernels_name_a_shape_mismatch() -> None:
    linear = Int4Linear.build(_int4(64, 64), None, torch.float32, native=True)
    with pytest.raises(RuntimeError, match="K must match"):
        linear(torch.randn(1, 32))
    int8 = Int8Linear.build(_int8(64, 64), None, torch.float32, native=True)
    with pytest.raises(RuntimeError, match="values must be"):
        int8(torch.randn(1, 32))


def _int8_exact_activations(rows: int, k: int) -> torch.Tensor:
    """Integers in [-127, 127] with 127 in every group of 32: int8 quantisation (scale max/127 = 1) is exact."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randint(-127, 128, (rows, k), generator=gen).float()
    x[:, ::GROUP] = 127.0
    return x.bfloat16()  # integers up to 255 are exact in bfloat16


@needs_vnni
@pytest.mark.parametrize("rows", [1, 2, 8, 11])
def test_int4_dot_is_exact_where_the_activations_quantise_exactly(rows: int) -> None:
    """Activations that int8 holds exactly leave only float rounding: this pins the layout and the zero term."""
    weight = _int4(128, 96)
    linear = build_linear(weight, None, torch.bfloat16, prepack=False, native=True, int8_activations=True)
    assert isinstance(linear, Int4DotLinear)
    x = _int8_exact_activations(rows, 96)
    got = linear(x)
    exact = x.double() @ weight.dequantize(torch.bfloat16).double().t()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 128)
    assert bool(((got.double() - exact).abs() <= _tolerance(torch.bfloat16, exact)).all())


@needs_vnni
def test_int4_dot_on_real_valued_activations_is_as_close_as_the_float_path() -> None:
    """Two int8 digits per activation (leading and residual) leave an error at the output's own bf16 rounding:
    no worse than torch's float kernel (a single digit was 5x worse, and +1.6 % perplexity)."""
    weight = _int4(256, 576)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    exact = x.double() @ weight.dequantize(torch.bfloat16).double().t()

    def relative(y: torch.Tensor) -> float:
        return ((y.double() - exact).norm() / exact.norm()).item()

    float_path = relative(Int4Linear.build(weight, None, torch.bfloat16, native=False)(x))
    assert relative(Int4DotLinear.build(weight, None)(x)) <= 1.25 * float_path


def test_int4_dot_is_chosen_only_where_its_layout_applies() -> None:
    weight = _int4(48, 64)  # 48 rows: a multiple of 16
    assert Int4DotLinear.supports(weight, torch.bfloat16)
    assert not Int4DotLinear.supports(weight, torch.float32)  # float32 keeps float activations
    assert not Int4DotLinear.supports(_int4(40, 64), torch.bfloat16)
    plain = build_linear(weight, None, torch.bfloat16, prepack=False, native=True, int8_activations=False)
    assert isinstance(plain, Int4Linear)


def test_row_switched_linear_uses_quantised_weights_up_to_its_limit_and_dense_past_it() -> None:
    weight = _int4(64, 64)
    quantized = Int4Linear.build(weight, None, torch.float32, native=False)
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
