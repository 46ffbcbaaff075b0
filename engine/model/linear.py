"""Weight matmuls: dense through oneDNN with weights reordered once at load (falling back to `F.linear`), and
weight-only int4 and int8 through torch's packed CPU kernels.

On the CPU, `F.linear` goes to MKL's sgemm, which on AMD processors takes a generic code path: the same
decode step's projections ran 2x faster (batch 1 to 64) and 1.3x faster (prefill) through oneDNN with the
weight reordered into its blocked layout ahead of time (the op torch's inductor emits for frozen CPU linears
with dynamic batch sizes). The reordered copy is extra memory (one more copy of the projection weights), so
it is optional. bfloat16 weights are reordered the same way. The LM head's int8 and Q6_K matmuls are in
engine/model/head_linear.py. The quantised kernels and the measurements that chose between them are in
docs/quantization.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import check_int4_gemm_scope
from engine.model.head_linear import Int6DotLinear, Int8DotLinear, Int8Linear
from engine.platform.cpu_features import cpu_features
from engine.platform.native import Kernels
from engine.weights.quantization import Int4Weight, Int6Weight, Int8Weight, QuantizedWeight, int8_from_dense


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can reorder and run this weight: bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT (without them
    torch's reorder raises), so on an AVX2 CPU, or under an AVX2 cap, bf16 weights stay in torch's layout."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        device.type == "cpu"
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_features().onednn_bf16))
        and torch.backends.mkldnn.is_available()
        and ops is not None
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


@dataclass(frozen=True)
class Linear:
    """y = x W^T + b, with W optionally held in oneDNN's reordered layout."""

    weight: torch.Tensor  # [out, in]: the model's own (what the fallback and generate() use), or only its shape
    bias: torch.Tensor | None
    packed: torch.Tensor | None = None  # opaque oneDNN tensor, None when not packed

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool, own_copy: bool = False) -> Linear:
        """`own_copy`: the weight is the caller's own copy (a dense copy of quantised weights), which nothing else
        reads: where it is packed, only its shape is kept (a meta tensor), not a second copy in memory."""
        if not (prepack and onednn_available(weight.device, weight.dtype)):
            return cls(weight, bias)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        return cls(weight.to("meta") if own_copy else weight, bias, packed)

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


INT4_BLOCK_ROWS = 64  # output rows per block of the kernels' int4_gemv layout


def pack_int4_blocks(values: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 into the kernels' int4_gemv layout (engine/csrc/int4_gemv.cpp), [N, K / 2] uint8: per
    block of 64 rows and per input k, 32 bytes, byte j = row j (low nibble) | row j + 32 (high nibble). It is the
    layout torch's packing has at its AVX-512 capability, written here so that it holds at every capability."""
    out, inputs = values.shape
    halves = values.view(out // INT4_BLOCK_ROWS, 2, INT4_BLOCK_ROWS // 2, inputs)
    packed = (halves[:, 0] | (halves[:, 1] << 4)).transpose(1, 2)  # [blocks, K, 32]
    return packed.contiguous().view(out, inputs // 2)


@dataclass(frozen=True)
class Int4Linear:
    """y = x dequant(W)^T + b with W 4-bit in torch's CPU packed layout, groups of `group_size` inputs.

    torch reads each group as (q - 8) * scale + zero; with float32 activations the scales stay float32, so GGUF
    Q4_1 blocks (w = d * q + m) are used exactly as stored (engine/weights/quantization.py)."""

    packed: torch.Tensor  # [out, in / 2] uint8, torch's layout
    scales_and_zeros: torch.Tensor  # [in / group_size, out, 2] in the activations' dtype
    group_size: int
    bias: torch.Tensor | None
    in_features: int
    kernels: Kernels | None = None  # through their int4_gemv (engine/csrc/int4_gemv.cpp) rather than torch's kernel

    @classmethod
    def build(
        cls, weight: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype, kernels: Kernels | None = None
    ) -> Int4Linear:
        """Through `kernels` where the weight tiles into their blocks of 64 rows, else torch's kernel."""
        scales_and_zeros = torch.stack((weight.scales.t(), weight.zeros.t()), dim=-1).to(dtype).contiguous()
        inputs = int(weight.values.shape[1])
        if kernels and weight.values.shape[0] % INT4_BLOCK_ROWS == 0 and weight.group_size % 16 == 0:
            return cls(pack_int4_blocks(weight.values), scales_and_zeros, weight.group_size, bias, inputs, kernels)
        # torch's packing depends on its CPU capability; only its own kernel reads it.
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.values.to(torch.int32), 1)
        return cls(packed, scales_and_zeros, weight.group_size, bias, inputs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()  # the int4 kernels refuse strided inputs (the runner passes slices of fused outputs)
        # Ours reads each weight byte once for up to 8 rows (torch's costs grow with the rows as if each were a
        # pass) and is 20x faster on float32 activations: docs/quantization.md has the measurements.
        mm = self.kernels.ops.int4_gemv if self.kernels else torch.ops.aten._weight_int4pack_mm_for_cpu
        y = mm(x, self.packed, self.group_size, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class Int4DotLinear:
    """y = x dequant(W)^T + b through integer dot products: int4 weights (the file's own values, scales and zeros)
    times activations written as two int8 digits per group of 32 (the kernels' `int4_dot`: AVX-512 VNNI, or AVX2's
    `vpmaddubsw`), on float32 or bfloat16 activations.

    Two digits (leading, and the rounding error in 127ths) keep the activations good to ~1/32000 of their group's
    largest value: perplexity +0.30 % against float32, as the float path's +0.32 % (one digit, llama.cpp's Q8
    activations: +1.59 %). The weights live in the kernel's own layout, 4 bits a weight as in torch's packing."""

    packed: torch.Tensor  # [out, in / 2] uint8, blocks of 16 rows (engine/csrc/int4_dot.cpp)
    scales: torch.Tensor  # [out / 16, in / group, 16] bfloat16
    zeros: torch.Tensor  # [out / 16, in / group, 16] bfloat16, or empty: symmetric weights (every zero 0, GGUF Q4_0)
    group_size: int
    bias: torch.Tensor | None
    in_features: int
    kernels: Kernels

    BLOCK = 16  # output rows per block of the layout

    @classmethod
    def supports(cls, weight: Int4Weight, dtype: torch.dtype) -> bool:
        out, inputs = weight.values.shape
        return (
            dtype in (torch.float32, torch.bfloat16)
            and out % cls.BLOCK == 0
            and weight.group_size % 8 == 0
            and inputs % 8 == 0
        )

    @classmethod
    def build(cls, weight: Int4Weight, bias: torch.Tensor | None, kernels: Kernels) -> Int4DotLinear:
        out, inputs = weight.values.shape
        # Per block of 16 rows and run of 8 inputs: 4 bytes a row, byte j = input j (low nibble) | input 4 + j (high).
        runs = weight.values.view(out // cls.BLOCK, cls.BLOCK, inputs // 8, 2, 4)
        packed = (runs[:, :, :, 0, :] | (runs[:, :, :, 1, :] << 4)).permute(0, 2, 1, 3).contiguous()
        groups = inputs // weight.group_size

        def blocked(per_group: torch.Tensor) -> torch.Tensor:
            return per_group.view(out // cls.BLOCK, cls.BLOCK, groups).permute(0, 2, 1).contiguous().bfloat16()

        # Symmetric weights (Q4_0's w = d (q - 8)) keep no zeros: the kernels take the zero term as -8 s, the same
        # bits, and a step reads a tenth fewer bytes of weights.
        symmetric = not bool(weight.zeros.bfloat16().any())
        return cls(
            packed.view(out, inputs // 2),
            blocked(weight.scales),
            torch.empty(0, dtype=torch.bfloat16) if symmetric else blocked(weight.zeros),
            weight.group_size,
            bias,
            inputs,
            kernels,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.ops.int4_dot(x, self.packed, self.group_size, self.scales, self.zeros)
        return y if self.bias is None else y + self.bias

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """The same weights for many rows (a prefill chunk): one int8 digit per activation, half the integer work
        of two (engine/csrc/int4_gemm.cpp; its quality: docs/quantization.md, `--int4-gemm`)."""
        y = self.kernels.ops.int4_gemm(x, self.packed, self.group_size, self.scales, self.zeros)
        return y if self.bias is None else y + self.bias


IntegerDotLinear = Int4DotLinear | Int8DotLinear | Int6DotLinear  # those that run large steps on one digit (`gemm`)
QuantizedLinear = Int4Linear | Int8Linear | IntegerDotLinear


@dataclass(frozen=True)
class RowSwitchedLinear:
    """Quantised weights for small steps, a dense copy (or one-digit integer dot products) for large ones.

    A step of a few rows is bound by the bytes of weights it reads, where 4-bit weights win; a step of many rows
    (prefill, a large decode batch) is bound by arithmetic, where dequantising every weight for every group of
    rows costs far more than a dense bfloat16 matmul (4x at 64 rows, 8x at 512: docs/quantization.md). The
    dense copy holds the quantised weights' own dequantised values in the activations' dtype (built by
    TransformersRunner), so both paths compute the same function. Without one (`dense` None, weights with integer
    dot products only), large steps run int4_gemm (int8: int8_dot's one digit) on the same weights: one int8 digit
    per activation, a quality change docs/quantization.md measures, and no second copy of the weights in memory."""

    quantized: QuantizedLinear
    dense: Linear | None
    max_quantized_rows: int
    min_gemm_rows: int | None = None  # steps of this many rows or more run one digit (`gemm`) where the weights allow

    def __post_init__(self) -> None:
        if self.dense is None and not isinstance(self.quantized, IntegerDotLinear):
            raise ValueError("only weights with integer dot products run large steps without a dense copy")

    @property
    def in_features(self) -> int:
        return self.quantized.in_features

    @property
    def routing(self) -> tuple[int, int | None, bool]:
        """What `path` reads beside the kind of `quantized`: two integer-dot switches with the same routing send every
        step the same way (FusedDecode keeps one of each)."""
        return self.max_quantized_rows, self.min_gemm_rows, self.dense is None

    def path(self, rows: int) -> str:
        """What a step of `rows` rows runs: "quantized", "gemm" (one digit on the same weights) or "dense"."""
        if rows <= self.max_quantized_rows:
            return "quantized"
        gemm = self.dense is None or (self.min_gemm_rows is not None and rows >= self.min_gemm_rows)
        return "gemm" if gemm and isinstance(self.quantized, IntegerDotLinear) else "dense"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        path = self.path(x.shape[0])
        if path == "quantized":
            return self.quantized(x)
        if path == "gemm" and isinstance(self.quantized, IntegerDotLinear):
            return self.quantized.gemm(x)
        assert self.dense is not None  # __post_init__: only the integer-dot linears go without
        return self.dense(x)


AnyLinear = Linear | QuantizedLinear | RowSwitchedLinear

QKV_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def gemm_without_dense_copy(scope: str, names: list[str]) -> bool:
    """Whether the (fused) projection of modules `names` runs its large steps on one digit with no dense copy, under
    an engine.config.INT4_GEMM_SCOPES scope. "except-qkv" keeps the attention's input projection on its dense copy:
    one digit there cost four times what it cost the MLP's, per weight (docs/quantization.md)."""
    check_int4_gemm_scope(scope)
    if scope == "except-qkv":
        return not any(name.rsplit(".", 1)[-1] in QKV_PROJECTIONS for name in names)
    return scope == "all"


def build_linear(
    weight: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    prepack: bool,
    kernels: Kernels | None = None,
    int8_activations: bool = False,
) -> Linear | QuantizedLinear:
    """The matmul for a dense weight (in `dtype`, oneDNN-prepacked if asked and possible) or a quantised one
    (`kernels`: through that loaded build of the compiled kernels; `int8_activations`: int4 and int8 weights through
    integer dot products where the build has them, see Int4DotLinear and Int8DotLinear)."""
    if isinstance(weight, Int4Weight):
        if kernels and int8_activations and kernels.has_int4_dot and Int4DotLinear.supports(weight, dtype):
            return Int4DotLinear.build(weight, bias, kernels)
        return Int4Linear.build(weight, bias, dtype, kernels)
    if isinstance(weight, Int6Weight):
        if kernels and int8_activations and kernels.has_int6_dot and Int6DotLinear.supports(weight):
            # Large steps run its values as int8 per row, on whichever int8 matmul this build would choose.
            wide = build_linear(int8_from_dense(weight), bias, dtype, prepack, kernels, int8_activations)
            assert isinstance(wide, Int8DotLinear | Int8Linear)
            return Int6DotLinear.build(weight, bias, kernels, wide)
        # No kernel here: its own values, dense (int8 would be another function than the file's and the reference's).
        return Linear.build(weight.dequantize().to(dtype), bias, prepack)
    if isinstance(weight, Int8Weight):
        if kernels and int8_activations and kernels.has_int8_dot and Int8DotLinear.supports(weight):
            return Int8DotLinear.build(weight, bias, dtype, kernels)
        return Int8Linear.build(weight, bias, dtype, kernels)
    return Linear.build(weight, bias, prepack)
