"""int6_dot (engine/csrc/int6_dot.cpp), a GGUF Q6_K LM head as the file holds it, once per build of the kernels this
CPU can execute: exact where the activations' digits are, as close as int8's two digits on real activations, each row
the same alone as in a batch, one digit for many rows, the same bits in every build, its layout, its choice by
build_linear (int8 where a build has no kernel), and what it refuses."""

from __future__ import annotations

import pytest
import torch

from engine.model.head_linear import INT6_DOT_MAX_ROWS, Int6DotLinear, Int8DotLinear, Int8Linear
from engine.model.linear import Linear, RowSwitchedLinear, build_linear
from engine.platform import native
from engine.platform.cpu_features import cpu_features
from engine.weights.quantization import Int6Weight


def _int6(n: int, k: int, seed: int = 0) -> Int6Weight:
    """Random Q6_K values: codes over all of 0..63, sub-scales over all of -128..127 (a Q6_K scale is signed)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 64, (n, k), generator=gen, dtype=torch.uint8)
    subs = torch.randint(-128, 128, (n, k // 16), generator=gen, dtype=torch.int8)
    return Int6Weight(codes, subs, torch.rand(n, k // 256, generator=gen) * 1e-4 + 1e-5)


def _dot(kernels: native.Kernels) -> native.Kernels:
    if not kernels.has_int6_dot:
        pytest.skip(f"the {kernels.build.name} build has no int6 dot products (AVX2, or AVX-512 with VNNI)")
    return kernels


def _exact(x: torch.Tensor, weight: Int6Weight) -> torch.Tensor:
    return x.double() @ weight.dequantize().double().t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "inputs"), [(1, 256), (3, 512), (5, 768), (8, 256), (9, 256), (17, 2048)])
def test_int6_dot_is_exact_where_the_activations_quantise_exactly(
    kernels: native.Kernels, dtype: torch.dtype, rows: int, inputs: int
) -> None:
    """Integers with 127 in every run of 16 quantise exactly (leading digit, residual 0): only float rounding is
    left, so this pins the layout, the codes' +32 taken back off, both scales and the passes of rows."""
    weight = _int6(48, inputs, seed=rows)
    linear = Int6DotLinear.build(weight, None, _dot(kernels))
    x = torch.randint(-127, 128, (rows, inputs), generator=torch.Generator().manual_seed(inputs)).float()
    x[:, ::16] = 127.0
    x = x.to(dtype)
    got = linear(x)
    exact = _exact(x, weight)
    assert got.dtype == dtype and got.shape == (rows, 48)
    relative = 1e-5 if dtype == torch.float32 else 2.0**-7
    assert bool(((got.double() - exact).abs() <= relative * exact.abs().amax() + 1e-6).all())


def test_int6_dot_on_real_activations_is_as_close_as_two_digits_allow(kernels: native.Kernels) -> None:
    """Two digits per run of 16 resolve an activation to 1/16129 of its run's largest: a relative error below 1e-4."""
    weight = _int6(512, 768)
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(3))
    exact = _exact(x, weight)
    got = Int6DotLinear.build(weight, None, _dot(kernels))(x)
    assert ((got.double() - exact).norm() / exact.norm()).item() < 1e-4


def _one_digit(x: torch.Tensor) -> torch.Tensor:
    """x with each value rounded to its run's int8 grid (127ths of the run's largest), as one digit keeps it."""
    v = x.float().view(x.shape[0], -1, 16)
    scale = v.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(v * inverse).double() * scale.double()).view(x.shape)


@pytest.mark.parametrize("rows", [1, 9, 32])
def test_one_digit_is_the_product_of_the_activations_on_their_int8_grid(kernels: native.Kernels, rows: int) -> None:
    weight = _int6(64, 512, seed=rows)
    linear = Int6DotLinear.build(weight, None, _dot(kernels))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    got = linear.gemm(x).double()
    on_grid = _exact(_one_digit(x), weight)
    assert bool(((got - on_grid).abs() <= 1e-5 * on_grid.abs().amax()).all())
    exact = _exact(x, weight)
    assert (got - exact).norm() > 10 * (linear(x).double() - exact).norm()


def test_a_row_gives_the_same_bits_alone_as_in_a_batch(kernels: native.Kernels) -> None:
    """Each row's digits and sums are its own: a verify step's rows and a plain step's row get the same logits."""
    linear = Int6DotLinear.build(_int6(256, 512), None, _dot(kernels))
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(5)).bfloat16()
    batched = linear(x)
    for row in range(11):
        assert torch.equal(linear(x[row : row + 1])[0], batched[row])


def test_every_build_gives_the_same_bits(kernels: native.Kernels) -> None:
    """AVX2's `vpmaddubsw` and VNNI's `vpdpbusd` give the same int32 sums, folded into floats in the same order."""
    weight = _int6(64, 512)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(6)).bfloat16()
    first = next(
        (k for k in map(native.load_kernels, native.builds_for(cpu_features())) if k is not None and k.has_int6_dot),
        None,
    )
    assert first is not None
    linear = Int6DotLinear.build(weight, None, _dot(kernels))
    reference = Int6DotLinear.build(weight, None, first)
    assert torch.equal(linear(x), reference(x)) and torch.equal(linear.gemm(x), reference.gemm(x))


def test_without_a_dense_copy_steps_past_the_switch_take_one_digit(kernels: native.Kernels) -> None:
    linear = Int6DotLinear.build(_int6(64, 256), None, _dot(kernels))
    switched = RowSwitchedLinear(linear, None, max_quantized_rows=4)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(8)).bfloat16()
    assert torch.equal(switched(x[:4]), linear(x[:4]))
    assert torch.equal(switched(x), linear.gemm(x)) and not torch.equal(switched(x), linear(x))


def test_the_layout_is_blocks_of_16_rows_and_runs_of_16_inputs(kernels: native.Kernels) -> None:
    weight = _int6(32, 512)
    packed = Int6DotLinear.build(weight, None, _dot(kernels)).packed.view(-1)
    codes = weight.values.to(torch.int32)
    for row, column in ((0, 0), (5, 3), (15, 511), (16, 4), (31, 262), (7, 13)):
        block, lane = divmod(row, 16)
        run, within = divmod(column, 16)
        register, i = divmod(within, 4)
        base = (block * 32 + run) * 192  # 32 runs of 16 inputs a block
        nibbles = int(packed[base + 64 * (register // 2) + lane * 4 + i])
        low = nibbles >> 4 if register % 2 else nibbles & 0x0F
        top = int(packed[base + 128 + lane * 4 + i]) >> (2 * register) & 3
        assert low | top << 4 == int(codes[row, column])


def test_rows_read_back_from_the_layout_are_the_weights_values_bit_for_bit(kernels: native.Kernels) -> None:
    """A tied embedding's lookup (engine/model/token_embedding.py): any rows, in any order, repeated, across blocks."""
    weight = _int6(48, 768, seed=3)
    linear = Int6DotLinear.build(weight, None, _dot(kernels))
    ids = torch.tensor([0, 47, 16, 5, 5, 31, 17, 15])
    assert torch.equal(linear.rows(ids), weight.dequantize(ids))
    assert torch.equal(linear.rows(torch.arange(48)), weight.dequantize())


def test_build_linear_chooses_it_with_an_int8_copy_for_large_steps_or_dense_without_a_kernel(
    kernels: native.Kernels,
) -> None:
    """With int8 activations and the kernel: int6_dot up to INT6_DOT_MAX_ROWS rows, the same values as int8 per row
    past them (both digit modes). Without the kernel: the file's values, dense, exactly as the reference holds them."""
    weight = _int6(48, 256)
    assert Int6DotLinear.supports(weight) and not Int6DotLinear.supports(_int6(40, 256))
    plain = build_linear(weight, None, torch.float32, prepack=False, kernels=kernels, int8_activations=False)
    assert isinstance(plain, Linear) and torch.equal(plain.weight, weight.dequantize())
    chosen = build_linear(weight, None, torch.bfloat16, prepack=False, kernels=kernels, int8_activations=True)
    if not kernels.has_int6_dot:
        assert isinstance(chosen, Linear)
        return
    assert isinstance(chosen, Int6DotLinear) and isinstance(chosen.wide, Int8DotLinear | Int8Linear)
    x = torch.randn(INT6_DOT_MAX_ROWS + 1, 256, generator=torch.Generator().manual_seed(9)).bfloat16()
    small = x[:INT6_DOT_MAX_ROWS]
    assert torch.equal(
        chosen(small), kernels.ops.int6_dot(small, chosen.packed, chosen.sub_scales, chosen.super_scales)
    )
    assert torch.equal(chosen(x), chosen.wide(x))
    wide_gemm = chosen.wide.gemm(x) if isinstance(chosen.wide, Int8DotLinear) else chosen.wide(x)
    assert torch.equal(chosen.gemm(x), wide_gemm) and torch.equal(chosen.gemm(small), Int6DotLinear.gemm(chosen, small))
    exact = _exact(x, weight)
    assert ((chosen(x).double() - exact).norm() / exact.norm()).item() < 0.01  # int8 per row of the same values
    assert kernels.has_int6_dot == (kernels.build.name in ("avx512_bf16", "avx512_vnni", "avx2_vnni", "avx2"))


def test_int6_dot_names_a_bad_operand(kernels: native.Kernels) -> None:
    linear = Int6DotLinear.build(_int6(32, 256), None, _dot(kernels))
    with pytest.raises(RuntimeError, match="multiple of 256"):
        linear(torch.randn(1, 128))
    with pytest.raises(RuntimeError, match="packed must be"):
        kernels.ops.int6_dot(torch.randn(1, 512), linear.packed, linear.sub_scales, linear.super_scales)
    with pytest.raises(RuntimeError, match="super_scales must be"):
        kernels.ops.int6_dot(torch.randn(1, 256), linear.packed, linear.sub_scales, linear.super_scales.double())
