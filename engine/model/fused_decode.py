"""A pure decode step's decoder layers in one call to the compiled kernels (engine/csrc/decode_layers.cpp).

At batch 1 a layer is about ten op calls, and each costs microseconds of Python and dispatch around a kernel of
tens: on a 2-core AVX2 machine that was about a fifth of a step. Where every projection of every layer is an int4
integer-dot matmul without bias (engine.model.linear.Int4DotLinear), the activation is SiLU and the element-wise ops are
the compiled ones, one call runs the same kernels with the same arguments in the same order, so its result is the
per-op path's bit for bit: int4_dot where every projection's row switch serves the step's rows from the int4
weights, int4_gemm (one digit) where every one runs them on one digit (`--int4-gemm`, or `auto`'s choice where one
digit was the faster at a few rows). Every other step (prefill, a mixed step, a projection on its dense copy) keeps
the per-op path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import nn

from engine.model.attention import PreparedGroup
from engine.model.elementwise import ElementwiseOps, RotaryTables, is_silu
from engine.model.linear import AnyLinear, Int4DotLinear, RowSwitchedLinear
from engine.platform.native import Kernels


@dataclass(frozen=True)
class LayerWeights:
    """What one decoder layer computes with, in the order a step uses it."""

    input_norm: torch.Tensor
    qkv_proj: AnyLinear
    o_proj: AnyLinear
    post_norm: torch.Tensor
    gate_up_proj: AnyLinear
    down_proj: AnyLinear


# Each layer's tensors in the one order decode_layers.cpp reads them: (LayerWeights field, tensor count), a norm one
# tensor and a projection three (its packed weights, scales, zeros). The C++ indexes them by the offsets of its
# `LayerTensor` constants, named after these fields (kInputNorm, kQkvProj, ...);
# tests/engine/model/test_decode_layers.py checks the two agree.
LAYER_TENSORS: tuple[tuple[str, int], ...] = (
    ("input_norm", 1),
    ("qkv_proj", 3),
    ("o_proj", 3),
    ("post_norm", 1),
    ("gate_up_proj", 3),
    ("down_proj", 3),
)


def layer_offsets() -> dict[str, int]:
    """Each LAYER_TENSORS field's first tensor among its layer's, and "layer_tensors": the tensors per layer."""
    names = [name for name, _ in LAYER_TENSORS] + ["layer_tensors"]
    return dict(zip(names, accumulate((count for _, count in LAYER_TENSORS), initial=0), strict=True))


def _int4_dot(linear: AnyLinear) -> tuple[Int4DotLinear, RowSwitchedLinear | None] | None:
    """The integer-dot matmul behind `linear` and its row switch (None: every step runs it), or None if it has none."""
    if isinstance(linear, RowSwitchedLinear) and isinstance(linear.quantized, Int4DotLinear):
        return linear.quantized, linear
    if isinstance(linear, Int4DotLinear):
        return linear, None
    return None


@dataclass(frozen=True)
class FusedDecode:
    kernels: Kernels
    tensors: list[torch.Tensor]  # per layer, in LAYER_TENSORS's order
    switches: tuple[RowSwitchedLinear, ...]  # one projection per distinct row switch
    unswitched: bool  # some projection has no row switch: it runs int4_dot at every step
    fused_silu: bool  # SiLU * up through the compiled kernel (else ATen's ops, as the per-op path does)

    @classmethod
    def build(cls, layers: Sequence[LayerWeights], ops: ElementwiseOps, act: nn.Module) -> FusedDecode | None:
        """The fused path for these layers, or None where a layer or op has no place in it. The caller decides
        whether decode attention runs in the native kernel, which the fused step needs."""
        kernels = ops.kernels
        if kernels is None or not is_silu(act) or not layers:
            return None
        tensors: list[torch.Tensor] = []
        switches: dict[tuple[int, int | None, bool], RowSwitchedLinear] = {}
        unswitched = False
        for layer in layers:
            for name, _ in LAYER_TENSORS:
                part: torch.Tensor | AnyLinear = getattr(layer, name)
                if isinstance(part, torch.Tensor):
                    tensors.append(part.contiguous())
                    continue
                found = _int4_dot(part)
                if found is None or found[0].bias is not None or found[0].kernels.build != kernels.build:
                    return None
                dot, switch = found
                tensors.extend((dot.packed, dot.scales, dot.zeros))
                if switch is None:
                    unswitched = True
                else:
                    switches.setdefault(switch.routing, switch)
        return cls(kernels, tensors, tuple(switches.values()), unswitched, ops.fuses_silu(act))

    def kernel(self, rows: int) -> str | None:
        """Which int4 kernel every projection runs a step of `rows` rows on: "int4_dot", "int4_gemm" (one digit), or
        None where they differ or one runs its dense copy."""
        paths = {switch.path(rows) for switch in self.switches} | ({"quantized"} if self.unswitched else set())
        if len(paths) != 1:
            return None
        return {"quantized": "int4_dot", "gemm": "int4_gemm"}.get(paths.pop())

    def accepts(self, groups: tuple[PreparedGroup, ...], rows: int) -> bool:
        """Whether a step with these attention groups and rows runs here: decode rows only, read in place by the
        native attention kernel, and every projection on the same int4 kernel."""
        return (
            len(groups) == 1
            and groups[0].group.is_decode
            and groups[0].block_index is None
            and self.kernel(rows) is not None
        )

    def __call__(
        self,
        x: torch.Tensor,
        cache_data: torch.Tensor,
        rotary: RotaryTables,
        slot_mapping: torch.Tensor,
        group: PreparedGroup,
        heads: int,
        kv_heads: int,
        scale: float,
        eps: float,
    ) -> None:
        """Runs every layer over the residual stream x ([rows, hidden], updated in place), writing the cache."""
        one_digit = self.kernel(x.shape[0]) == "int4_gemm"
        self.kernels.ops.decode_layers(
            x,
            cache_data,
            self.tensors,
            rotary.cos,
            rotary.sin,
            slot_mapping,
            group.group.block_table,
            group.group.context_lens,
            heads,
            kv_heads,
            group.block_size,
            scale,
            eps,
            self.fused_silu,
            one_digit,
        )
