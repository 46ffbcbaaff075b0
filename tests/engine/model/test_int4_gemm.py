"""The many-row int4 matmul (engine/csrc/int4_gemm.cpp: int4_dot's weights, one int8 digit per activation) against a
scalar reference of the same integer arithmetic, the float matmul, and int4_dot; once per build of the kernels this
CPU can execute (the AVX2 build included), and its place in the row-switched linear."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.linear import Int4DotLinear, Int8Linear, Linear, RowSwitchedLinear
from engine.model.model_runner import TransformersRunner
from engine.platform import native
from engine.sample.sampling_params import SamplingParams
from engine.weights.loader import load_model
from engine.weights.quantization import Int4Weight, Int8Weight
from tests.engine.helpers import count_int4_gemm_calls, int4_dot_kernels, random_int4

GROUP = 32


_gemm_kernels = int4_dot_kernels
_int4 = random_int4


def _reference(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """The kernel's arithmetic, scalar: per row and group, digits round(x / (max |x| / 127)) in float32 (ties to
    even, as nearbyint), int64 dot products with the 4-bit values, then the scales and the zero term (on the sum of
    the rounded values, the digits') in float64."""
    rows, k = x.shape
    groups = k // GROUP
    v = x.float().view(rows, groups, GROUP)
    scale = v.abs().amax(-1) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    digits = torch.round(v * inverse[..., None]).to(torch.int64)
    q = weight.values.to(torch.int64).view(-1, groups, GROUP)
    dots = torch.einsum("rgi,ngi->rng", digits, q)  # exact integers
    s = weight.scales.bfloat16().double()  # the kernel's scales and zeros are bf16
    z = weight.zeros.bfloat16().double() - 8 * s
    sums = digits.sum(-1).double() * scale.double()
    return torch.einsum("rng,ng->rn", dots.double() * scale.double()[:, None, :], s) + sums @ z.t()


@pytest.mark.parametrize(
    ("rows", "group"), [(1, 32), (3, 32), (7, 32), (8, 32), (9, 32), (17, 32), (33, 32), (5, 8), (13, 96)]
)
def test_int4_gemm_is_bit_exact_on_integer_activations(kernels: native.Kernels, rows: int, group: int) -> None:
    """Activations that one int8 digit holds exactly (scale 1), scales 1 and zeros 8: every float step is exact, so
    the output is the int32 dot products themselves, in every build alike; 48 outputs (3 blocks of 16), rows that
    leave partial tiles, and groups shorter and longer than the AVX2 build's 32 inputs summed in int16 (worst-case
    digits: all weights 15 against 127 would overflow int16 past 32 inputs)."""
    k = 192
    gen = torch.Generator().manual_seed(rows)
    values = torch.randint(0, 16, (48, k), generator=gen, dtype=torch.uint8)
    values[0] = 15
    weight = Int4Weight(values, torch.ones(48, k // group), torch.full((48, k // group), 8.0), group)
    x = torch.randint(-127, 128, (rows, k), generator=gen).float()
    x[:, ::group] = 127.0
    x[0] = 127.0
    linear = Int4DotLinear.build(weight, None, _gemm_kernels(kernels))
    got = linear.gemm(x)
    exact = (x.to(torch.int64) @ values.to(torch.int64).t()).float()
    assert got.shape == (rows, 48) and torch.equal(got, exact)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 16, 21])
def test_int4_gemm_matches_its_scalar_reference(
    kernels: native.Kernels, dtype: torch.dtype, rows: int, symmetric: bool
) -> None:
    weight = _int4(80, 576)
    if symmetric:  # zeros all 0 (Q4_0's): built without zeros, the zero term -8 s in the kernel
        weight = Int4Weight(weight.values, weight.scales, torch.zeros_like(weight.zeros), weight.group_size)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = Int4DotLinear.build(weight, None, _gemm_kernels(kernels)).gemm(x)
    reference = _reference(x, weight)
    # float32: summation order only; bfloat16: one rounding of the output on top.
    relative, floor = (1e-5, 1e-5) if dtype == torch.float32 else (2.0**-7, 1e-3)
    assert got.dtype == dtype
    assert bool(((got.double() - reference).abs() <= relative * reference.abs() + floor).all())


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_few_rows_read_packed_give_the_bits_of_the_same_rows_among_many(
    kernels: native.Kernels, dtype: torch.dtype, symmetric: bool
) -> None:
    """A step of at most one pass's rows (a decode step) reads the packed weights as they are; more rows unpack each
    block once and pass over it again. Each row's outputs are the same bits either way, so a sequence's one-digit
    step does not depend on how many others share it (1 to 3 rows against 24: past both builds' rows a pass)."""
    weight = _int4(48, 576, seed=5)
    if symmetric:
        weight = Int4Weight(weight.values, weight.scales, torch.zeros_like(weight.zeros), weight.group_size)
    linear = Int4DotLinear.build(weight, None, _gemm_kernels(kernels))
    x = torch.randn(24, 576, generator=torch.Generator().manual_seed(6)).to(dtype)
    many = linear.gemm(x)
    for rows in (1, 2, 3):
        assert torch.equal(linear.gemm(x[5 : 5 + rows]), many[5 : 5 + rows])


def test_int4_gemm_rounds_only_the_activations(kernels: native.Kernels) -> None:
    """The output is the exact product of the weights with the rounded activations (each one digit times its group's
    scale): the zero term takes the rounded values' sum too. With the float sum instead, the rounding error would be
    weighted by the stored 4-bit values (all positive) rather than by the weights, several times larger."""
    weight = _int4(96, 576, seed=3)
    x = torch.randn(24, 576, generator=torch.Generator().manual_seed(4)) * torch.linspace(0.1, 4.0, 576)
    v = x.view(24, -1, GROUP)
    scale = v.abs().amax(-1, keepdim=True) / 127.0
    rounded = (torch.round(v / scale) * scale).view_as(x)
    s, z = (t.bfloat16().double().repeat_interleave(GROUP, 1) for t in (weight.scales, weight.zeros))
    dense = (weight.values.double() - 8) * s + z  # the kernel's weights: bf16 scales and zeros, float arithmetic
    wanted = rounded.double() @ dense.t()
    got = Int4DotLinear.build(weight, None, _gemm_kernels(kernels)).gemm(x).double()
    rounding_error = (x.double() @ dense.t() - wanted).norm()
    assert (got - wanted).norm() < rounding_error / 100


def test_int4_gemm_is_close_to_the_float_matmul_and_int4_dot_closer(kernels: native.Kernels) -> None:
    """One digit: about 1 % relative error on Gaussian activations; int4_dot's two digits stay far below it."""
    weight = _int4(256, 576, seed=1)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(2))
    exact = x.double() @ weight.dequantize(torch.bfloat16).double().t()
    linear = Int4DotLinear.build(weight, None, _gemm_kernels(kernels))

    def relative(y: torch.Tensor) -> float:
        return ((y.double() - exact).norm() / exact.norm()).item()

    one_digit, two_digits = relative(linear.gemm(x)), relative(linear(x))
    assert 1e-3 < one_digit < 2e-2
    assert two_digits < one_digit / 10


def test_row_switched_linear_runs_int4_gemm_from_its_row_count() -> None:
    kernels = native.load_kernels()
    if kernels is None or not kernels.has_int4_dot:
        pytest.skip("no build with integer dot products here")
    weight = _int4(64, 64)
    quantized = Int4DotLinear.build(weight, None, kernels)
    dense = Linear(torch.zeros(64, 64), None)  # distinguishable: every dense output is 0
    switched = RowSwitchedLinear(quantized, dense, max_quantized_rows=4, min_gemm_rows=8)
    few, some, many = (torch.randn(n, 64) for n in (4, 7, 8))
    assert torch.equal(switched(few), quantized(few))
    assert torch.equal(switched(some), torch.zeros(7, 64))
    assert torch.equal(switched(many), quantized.gemm(many)) and not torch.equal(switched(many), quantized(many))


def test_the_runner_prefills_through_int4_gemm_only_when_asked(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 12-token prompt is a 12-row step: past the row switch of 2, it runs int4_gemm with min_gemm_rows=8 and the
    dense copy without; the 1-row decode steps run int4_dot either way."""
    calls = count_int4_gemm_calls(monkeypatch)
    loaded = load_model(tiny_checkpoint, dtype="float32", quantization="int4")
    for min_gemm_rows in (None, 8):
        calls.clear()
        runner = TransformersRunner(
            loaded.model, quantized=loaded.quantized, max_quantized_rows=2, min_gemm_rows=min_gemm_rows
        )
        engine = Engine(runner, EngineConfig(max_rows=2, kv_cache_tokens=64, block_size=4), dtype=torch.float32)
        engine.add(0, list(range(1, 13)), SamplingParams(max_tokens=3, temperature=0.0))
        engine.reserve(0, 15)
        first = engine.step([(0, 12)]).tokens
        assert len(first) == 1 and engine.step([(0, 1)]).tokens
        # Every int4 projection of the 12-row step (each layer's), none of the decode step's.
        assert set(calls) == (set() if min_gemm_rows is None else {12}) and len(calls) % len(runner.layers) == 0


def test_a_row_switch_without_a_dense_copy_takes_only_int4_dot_weights() -> None:
    kernels = native.load_kernels()
    if kernels is None or not kernels.has_int4_dot:
        pytest.skip("no build with integer dot products here")
    weight = _int4(64, 64)
    switched = RowSwitchedLinear(Int4DotLinear.build(weight, None, kernels), None, max_quantized_rows=4)
    many = torch.randn(5, 64)
    assert switched.in_features == 64 and torch.equal(switched(many), switched.quantized.gemm(many))
    int8 = Int8Linear.build(Int8Weight(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16)), None, torch.float32)
    with pytest.raises(ValueError, match="dense copy"):
        RowSwitchedLinear(int8, None, max_quantized_rows=4)
