"""int8_dot (engine/csrc/int8_dot.cpp), the int8 LM head by integer dot products, once per build of the kernels this
CPU can execute: exact where the activations' digits are, as close as the float path on real activations, each row
the same alone as in a batch (a verify step's rows must give what plain steps give), its layout, its choice by
build_linear, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from engine.model.linear import Int8DotLinear, Int8Linear, RowSwitchedLinear, build_linear
from engine.platform import native
from engine.platform.cpu_features import cpu_features
from engine.weights.quantization import Int8Weight


def _int8(n: int, k: int, seed: int = 0) -> Int8Weight:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)  # -128 too: the top bit's flip
    return Int8Weight(values, torch.rand(n, generator=gen) * 0.01 + 0.001)


def _dot(kernels: native.Kernels) -> native.Kernels:
    if not kernels.has_int8_dot:
        pytest.skip(f"the {kernels.build.name} build has no int8 dot products (AVX2, or AVX-512 with VNNI)")
    return kernels


def _exact(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    return x.double() @ (weight.values.double() * weight.scales.double()[:, None]).t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "inputs"), [(1, 64), (3, 96), (5, 576), (8, 128), (9, 64), (17, 2048)])
def test_int8_dot_is_exact_where_the_activations_quantise_exactly(
    kernels: native.Kernels, dtype: torch.dtype, rows: int, inputs: int
) -> None:
    """Integers with 127 in every group quantise exactly (leading digit, residual 0): only float rounding is left,
    so this pins the layout, the +128 taken back off and the passes of 8 rows."""
    weight = _int8(96, inputs, seed=rows)
    linear = Int8DotLinear.build(weight, None, dtype, _dot(kernels))
    x = torch.randint(-127, 128, (rows, inputs), generator=torch.Generator().manual_seed(inputs)).float()
    x[:, :: linear.group_size] = 127.0
    x = x.to(dtype)
    got = linear(x)
    exact = _exact(x, weight)
    assert got.dtype == dtype and got.shape == (rows, 96)
    relative = 1e-5 if dtype == torch.float32 else 2.0**-7
    assert bool(((got.double() - exact).abs() <= relative * exact.abs() + 1e-3).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_dot_on_real_activations_is_as_close_as_the_float_path(
    kernels: native.Kernels, dtype: torch.dtype
) -> None:
    """Two digits resolve an activation to 1/16129 of its group's largest: on bfloat16 that is within the output's
    own rounding (no worse than the float kernel, int8_gemv), on float32 a relative error below 1e-4."""
    weight = _int8(512, 576)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(3)).to(dtype)
    exact = _exact(x, weight)

    def relative(y: torch.Tensor) -> float:
        return ((y.double() - exact).norm() / exact.norm()).item()

    dot = relative(Int8DotLinear.build(weight, None, dtype, _dot(kernels))(x))
    if dtype == torch.bfloat16:
        assert dot <= 1.25 * relative(Int8Linear.build(weight, None, dtype, kernels)(x))
    else:
        assert dot < 1e-4


def _one_digit(x: torch.Tensor, group: int) -> torch.Tensor:
    """x with each value rounded to its group's int8 grid (127ths of the group's largest), as one digit keeps it."""
    v = x.float().view(x.shape[0], -1, group)
    scale = v.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(v * inverse).double() * scale.double()).view(x.shape)


@pytest.mark.parametrize(("rows", "inputs"), [(1, 64), (9, 576), (32, 576), (17, 2048)])
def test_one_digit_is_the_product_of_the_activations_on_their_int8_grid(
    kernels: native.Kernels, rows: int, inputs: int
) -> None:
    """`gemm` (int8_dot's one_digit, groups of 32) multiplies each activation rounded to one int8 digit: exactly
    that product up to float rounding, and a visibly coarser one than two digits' (so the residual really is off)."""
    weight = _int8(96, inputs, seed=rows)
    linear = Int8DotLinear.build(weight, None, torch.float32, _dot(kernels))
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(inputs + rows))
    got = linear.gemm(x).double()
    on_grid = _exact(_one_digit(x, 32), weight)
    assert bool(((got - on_grid).abs() <= 1e-5 * on_grid.abs() + 1e-4).all())
    exact = _exact(x, weight)
    assert (got - exact).norm() > 10 * (linear(x).double() - exact).norm()


def test_without_a_dense_copy_steps_past_the_switch_take_one_digit(kernels: native.Kernels) -> None:
    """`--int4-gemm`'s LM head: a RowSwitchedLinear with no dense copy runs two digits up to its row switch and one
    digit past it."""
    linear = Int8DotLinear.build(_int8(64, 576), None, torch.bfloat16, _dot(kernels))
    switched = RowSwitchedLinear(linear, None, max_quantized_rows=4)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(8)).bfloat16()
    assert torch.equal(switched(x[:4]), linear(x[:4]))
    assert torch.equal(switched(x), linear.gemm(x)) and not torch.equal(switched(x), linear(x))


def test_a_row_gives_the_same_bits_alone_as_in_a_batch(kernels: native.Kernels) -> None:
    """Each row's digits and sums are its own: a verify step's rows and a plain step's row get the same logits."""
    weight = _int8(256, 576)
    linear = Int8DotLinear.build(weight, None, torch.bfloat16, _dot(kernels))
    rows = min(11, kernels.int8_dot_max_rows or 11)  # past AVX2's limit the float kernel runs
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    batched = linear(x)
    for row in range(rows):
        assert torch.equal(linear(x[row : row + 1])[0], batched[row])


def test_every_build_gives_the_same_bits(kernels: native.Kernels) -> None:
    """The int32 dot products are exact in each build (AVX2 multiplies |w| by the digit with w's sign, VNNI w + 128
    and takes 128 times the digits back off) and folded into floats the same way: the same logits everywhere,
    against the first build with int8 dot products that this CPU runs."""
    weight = _int8(64, 576)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(6)).bfloat16()
    first = next(
        (k for k in map(native.load_kernels, native.builds_for(cpu_features())) if k is not None and k.has_int8_dot),
        None,
    )
    assert first is not None
    linear = Int8DotLinear.build(weight, None, torch.bfloat16, _dot(kernels))
    reference = Int8DotLinear.build(weight, None, torch.bfloat16, first)
    assert torch.equal(linear(x), reference(x)) and torch.equal(linear.gemm(x), reference.gemm(x))


def test_past_its_rows_an_avx2_build_runs_the_float_kernel(kernels: native.Kernels) -> None:
    """AVX2's two-digit route costs a row twice the float kernel's work: up to int8_dot_max_rows rows it runs,
    past them int8_gemv on the same int8 weights (a copy kept for it); VNNI builds run int8_dot at every count."""
    weight = _int8(64, 576)
    linear = Int8DotLinear.build(weight, None, torch.bfloat16, _dot(kernels))
    limit = kernels.int8_dot_max_rows
    assert (limit is None) == (linear.wide is None) == (kernels.build.level != "avx2")
    x = torch.randn(12, 576, generator=torch.Generator().manual_seed(7)).bfloat16()
    dot = kernels.ops.int8_dot(x, linear.packed, linear.group_size, linear.scales)
    if linear.wide is None:
        assert torch.equal(linear(x), dot)
    else:
        assert limit is not None and limit < 12
        assert torch.equal(linear(x), linear.wide(x)) and not torch.equal(linear(x), dot)
        assert torch.equal(linear(x[:limit]), dot[:limit])


def test_the_layout_is_blocks_of_16_rows_4_inputs_at_a_time(kernels: native.Kernels) -> None:
    weight = _int8(32, 64)
    packed = Int8DotLinear.build(weight, None, torch.bfloat16, _dot(kernels)).packed.view(-1)
    values = weight.values.to(torch.int32) + 128
    for row, column in ((0, 0), (5, 3), (15, 63), (16, 0), (31, 62)):
        block, lane = divmod(row, 16)
        index = block * 16 * 64 + (column // 4) * 64 + lane * 4 + column % 4
        assert int(packed[index]) == int(values[row, column])


def test_build_linear_chooses_it_with_int8_activations_where_the_build_has_it(kernels: native.Kernels) -> None:
    weight = _int8(48, 64)
    assert Int8DotLinear.supports(weight)
    assert not Int8DotLinear.supports(_int8(40, 64)) and not Int8DotLinear.supports(_int8(48, 48))
    plain = build_linear(weight, None, torch.bfloat16, prepack=False, kernels=kernels, int8_activations=False)
    assert isinstance(plain, Int8Linear)
    chosen = build_linear(weight, None, torch.bfloat16, prepack=False, kernels=kernels, int8_activations=True)
    assert isinstance(chosen, Int8DotLinear if kernels.has_int8_dot else Int8Linear)
    assert kernels.has_int8_dot == (kernels.build.name in ("avx512_bf16", "avx512_vnni", "avx2_vnni", "avx2"))


def test_int8_dot_names_a_bad_operand(kernels: native.Kernels) -> None:
    linear = Int8DotLinear.build(_int8(32, 64), None, torch.float32, _dot(kernels))
    with pytest.raises(RuntimeError, match="packed must be"):
        linear(torch.randn(1, 32))
    with pytest.raises(RuntimeError, match="multiple of the group"):
        kernels.ops.int8_dot(torch.randn(1, 64), linear.packed, 48, linear.scales)
    with pytest.raises(RuntimeError, match="scales must be"):
        kernels.ops.int8_dot(torch.randn(1, 64), linear.packed, 32, linear.scales.bfloat16())
