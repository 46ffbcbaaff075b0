"""engine.model.linear.Linear: the oneDNN prepacked matmul gives F.linear's result, and is really used on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from engine.model.linear import Linear, onednn_available
from engine.model.model_runner import TransformersRunner

needs_onednn = pytest.mark.skipif(
    not onednn_available(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN"
)


def _weights(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator)
    return weight, bias


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 32, 257])
@pytest.mark.parametrize("with_bias", [True, False])
def test_packed_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    weight, bias = _weights(96, 40, seed=rows)
    bias_or_none = bias if with_bias else None
    packed = Linear.build(weight, bias_or_none, prepack=True)
    assert packed.packed is not None
    x = torch.randn(rows, 40)
    torch.testing.assert_close(packed(x), F.linear(x, weight, bias_or_none), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_linear_accepts_a_strided_slice() -> None:
    weight, bias = _weights(16, 24, seed=1)
    x = torch.randn(5, 48)[:, 8:32]  # not contiguous, as the runner's slices of fused outputs are
    packed = Linear.build(weight, bias, prepack=True)
    torch.testing.assert_close(packed(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_packed_copy_of_the_callers_own_keeps_only_the_weights_shape() -> None:
    """A dense copy made for the runner (of quantised weights) is read only through its oneDNN copy: holding the
    plain one too would be a second copy in memory. Unpacked, the weight is what runs, and is kept."""
    weight, bias = _weights(96, 40, seed=4)
    own = Linear.build(weight.clone(), bias, prepack=True, own_copy=True)
    assert own.weight.is_meta and own.weight.shape == weight.shape and own.in_features == 40
    x = torch.randn(5, 40)
    assert torch.equal(own(x), Linear.build(weight, bias, prepack=True)(x))
    assert not Linear.build(weight, bias, prepack=False, own_copy=True).weight.is_meta


def test_unpacked_linear_is_exactly_f_linear() -> None:
    weight, bias = _weights(32, 16, seed=2)
    plain = Linear.build(weight, bias, prepack=False)
    x = torch.randn(7, 16)
    assert plain.packed is None
    assert torch.equal(plain(x), F.linear(x, weight, bias))


def test_packing_is_skipped_where_onednn_cannot_run() -> None:
    weight, _ = _weights(8, 8, seed=3)
    assert not onednn_available(torch.device("meta"), torch.float32)
    assert not onednn_available(torch.device("cpu"), torch.float16)
    assert Linear.build(weight.half(), None, prepack=True).packed is None


@needs_onednn
def test_runner_packs_every_projection_and_the_lm_head(tiny_qwen2: PreTrainedModel) -> None:
    runner = TransformersRunner(tiny_qwen2)
    linears = [lin for layer in runner.layers for lin in runner.layer_linears(layer)] + [runner.lm_head]
    # dense weights (no quantisation asked for), so every projection is a Linear
    assert all(isinstance(lin, Linear) and lin.packed is not None for lin in linears)
    qkv_proj = runner.layers[0].qkv_proj
    assert isinstance(qkv_proj, Linear) and qkv_proj.bias is not None  # Qwen2's q/k/v biases survive the fusion
    plain = TransformersRunner(tiny_qwen2, prepack_weights=False)
    assert all(isinstance(lin, Linear) and lin.packed is None for lin in plain.layer_linears(plain.layers[0]))
