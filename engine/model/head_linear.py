"""The LM head's weight matmuls: int8 per output row (any checkpoint's head, and `--quantization int8`'s projections)
through torch's or the kernels' int8 products, and a GGUF's Q6_K head (llama.cpp's 4-bit files keep it so) as the
file holds it. engine/model/linear.py chooses between them (build_linear)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.platform.cpu_features import cpu_features
from engine.platform.native import Kernels
from engine.weights.quantization import Int6Weight, Int8Weight

INT8_DOT_BLOCK_ROWS = 16  # output rows per block of int8_dot's (and int6_dot's) layout
ONE_DIGIT_GROUP = 32  # inputs per activation scale with one int8 digit (int4_gemm's, llama.cpp's Q8_0 blocks)
# Steps of up to this many rows run a Q6_K head on int6_dot, more on an int8 copy. On Zen 5 the 1B's head took 0.89x,
# 0.74x and 0.92x int8_dot's time at 1, 2 and 3 rows, 1.32x and 1.21x at 4 and 5, where the float work of a scale
# per 16 inputs outgrows the bytes saved (kernel-ab, docs/kernels.md).
INT6_DOT_MAX_ROWS = 3


@dataclass(frozen=True)
class Int8Linear:
    """y = x (q * scale)^T + b with int8 weights and one scale per output row (`_weight_int8pack_mm`)."""

    values: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] in the activations' dtype
    bias: torch.Tensor | None
    kernels: Kernels | None = None  # through their int8_gemv where it is measured faster (see __call__)
    max_kernel_bf16_rows: int | None = None  # bfloat16 steps of more rows run torch's kernel; None: never

    # Where the CPU has bf16 in hardware, up to this many bfloat16 rows the compiled kernel's prefetching streams the
    # weights faster than torch's (an LM head step: 2.0 ms against 2.8 cold) and past it torch's is as fast. Without
    # it torch's bf16 kernel is emulated: ours was 2x faster at 1 to 32 rows on an AVX2 EPYC (27.7 against 53.1 ms
    # for a [32, 576] x [49152, 576] head). On float32 ours is 9x faster at any size.
    NATIVE_BF16_ROWS = 8

    @classmethod
    def build(
        cls, weight: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype, kernels: Kernels | None = None
    ) -> Int8Linear:
        limit = cls.NATIVE_BF16_ROWS if cpu_features().native_bf16 else None
        return cls(weight.values.contiguous(), weight.scales.to(dtype), bias, kernels, limit)

    @property
    def in_features(self) -> int:
        return int(self.values.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        limit = self.max_kernel_bf16_rows
        if self.kernels and (x.dtype == torch.float32 or limit is None or x.shape[0] <= limit):
            y = self.kernels.ops.int8_gemv(x, self.values, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, self.values, self.scales)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class Int8DotLinear:
    """Int8Linear's function by integer dot products (engine/csrc/int8_dot.cpp: AVX2, VNNI), for int8 weights where
    activations may be quantised: each row's as two int8 digits per group of inputs, as Int4DotLinear's. Two
    `vpdpbusd` cover 64 weights of a row where float FMAs cover 16 each, so the LM head's extra rows (a verify
    step's drafts, a batch) cost a fraction of what they did; one row reads the same bytes."""

    packed: torch.Tensor  # [out, in] uint8: w + 128, in blocks of 16 output rows (int8_dot.cpp has the layout)
    scales: torch.Tensor  # [out] float32
    group_size: int  # inputs per activation scale
    bias: torch.Tensor | None
    kernels: Kernels
    dtype: torch.dtype  # the activations'
    wide: Int8Linear | None = None  # steps of more rows than the build's int8_dot_max_rows run it (AVX2)

    @staticmethod
    def supports(weight: Int8Weight) -> bool:
        out, inputs = weight.values.shape
        return out % INT8_DOT_BLOCK_ROWS == 0 and inputs % 32 == 0

    @classmethod
    def build(
        cls, weight: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype, kernels: Kernels
    ) -> Int8DotLinear:
        out, inputs = weight.values.shape
        # w + 128 is w's byte with its top bit flipped: no wider copy of the weights on the way.
        unsigned = weight.values.contiguous().view(torch.uint8).bitwise_xor(128)
        blocks = unsigned.view(out // INT8_DOT_BLOCK_ROWS, INT8_DOT_BLOCK_ROWS, inputs // 4, 4).transpose(1, 2)
        packed = blocks.contiguous().view(out, inputs)
        group = 64 if inputs % 64 == 0 else 32
        wide = None if kernels.int8_dot_max_rows is None else Int8Linear.build(weight, bias, dtype, kernels)
        return cls(packed, weight.scales.float().contiguous(), group, bias, kernels, dtype, wide)

    @property
    def in_features(self) -> int:
        return int(self.packed.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        limit = self.kernels.int8_dot_max_rows
        if self.wide is not None and limit is not None and x.shape[0] > limit:
            return self.wide(x)
        y = self.kernels.ops.int8_dot(x, self.packed, self.group_size, self.scales)
        return y if self.bias is None else y + self.bias

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """The same weights for many rows: one int8 digit per activation in groups of 32 (as int4_gemm's), half
        the integer work of two (`--int4-gemm`'s LM head; its quality: docs/quantization.md)."""
        y = self.kernels.ops.int8_dot(x, self.packed, ONE_DIGIT_GROUP, self.scales, True)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class Int6DotLinear:
    """A GGUF Q6_K weight (a 4-bit file's LM head) as the file holds it, by integer dot products
    (engine/csrc/int6_dot.cpp: AVX2, VNNI): 6 bits a weight and 0.56 of scales, where int8 per row takes 8. A batch-1
    step reads the head at memory's pace, so its time goes with its bytes: the 1B's head is 216 MB this way, 263 as
    int8. The activations are two int8 digits per 16 inputs (one, `gemm`, for many rows), as Int8DotLinear's. Steps
    of more than INT6_DOT_MAX_ROWS rows run `wide`, the same values as int8 per row, where there is one."""

    packed: torch.Tensor  # [out, in * 3 / 4] uint8, int6_dot.cpp's layout
    sub_scales: torch.Tensor  # [out / 16, in / 16, 16] int8
    super_scales: torch.Tensor  # [out / 16, in / 256, 16] float32
    bias: torch.Tensor | None
    kernels: Kernels
    wide: Int8DotLinear | Int8Linear | None = None  # None: every step on int6_dot

    @staticmethod
    def supports(weight: Int6Weight) -> bool:
        out, inputs = weight.values.shape
        return out % INT8_DOT_BLOCK_ROWS == 0 and inputs % 256 == 0

    @classmethod
    def build(
        cls,
        weight: Int6Weight,
        bias: torch.Tensor | None,
        kernels: Kernels,
        wide: Int8DotLinear | Int8Linear | None = None,
    ) -> Int6DotLinear:
        out, inputs = weight.values.shape
        blocks, runs = out // INT8_DOT_BLOCK_ROWS, inputs // 16
        # [block, run, register v (inputs 4v..4v+3 of the run), row, input]: a register's 64 bytes, row-major.
        codes = weight.values.view(blocks, INT8_DOT_BLOCK_ROWS, runs, 4, 4).permute(0, 2, 3, 1, 4)
        low, top = codes & 0x0F, codes >> 4
        packed = torch.stack(
            (
                low[:, :, 0] | low[:, :, 1] << 4,
                low[:, :, 2] | low[:, :, 3] << 4,
                top[:, :, 0] | top[:, :, 1] << 2 | top[:, :, 2] << 4 | top[:, :, 3] << 6,
            ),
            dim=2,
        )
        sub = weight.sub_scales.view(blocks, INT8_DOT_BLOCK_ROWS, runs).transpose(1, 2)
        supers = weight.super_scales.float().view(blocks, INT8_DOT_BLOCK_ROWS, inputs // 256).transpose(1, 2)
        packed = packed.contiguous().view(out, inputs * 3 // 4)
        return cls(packed, sub.contiguous(), supers.contiguous(), bias, kernels, wide)

    @property
    def in_features(self) -> int:
        return int(self.packed.shape[1]) * 4 // 3

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), in] float32: the weight's rows `ids` read back from the layout, Int6Weight.dequantize's values
        bit for bit (a tied embedding's lookup, engine/model/token_embedding.py)."""
        blocks, runs = self.sub_scales.shape[:2]
        block, row = ids // INT8_DOT_BLOCK_ROWS, ids % INT8_DOT_BLOCK_ROWS
        # [tokens, run, byte k of (low 0|1, low 2|3, tops), input i of register v]
        data = self.packed.view(blocks, runs, 3, INT8_DOT_BLOCK_ROWS, 4)[block, :, :, row]
        pairs, tops = data[:, :, :2], data[:, :, 2:3]
        low = torch.stack((pairs & 0x0F, pairs >> 4), dim=3).flatten(2, 3)  # [tokens, run, v, i], v = 2k + nibble
        top = torch.cat([(tops >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=2)
        codes = (low | top << 4).flatten(1)  # input 16 run + 4 v + i
        return Int6Weight(codes, self.sub_scales[block, :, row], self.super_scales[block, :, row]).dequantize()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.wide is not None and x.shape[0] > INT6_DOT_MAX_ROWS:
            return self.wide(x)
        y = self.kernels.ops.int6_dot(x, self.packed, self.sub_scales, self.super_scales)
        return y if self.bias is None else y + self.bias

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """The same weights for many rows: one int8 digit per activation, half the integer work of two (the int8
        copy's one digit past INT6_DOT_MAX_ROWS rows, where it has one)."""
        if self.wide is not None and x.shape[0] > INT6_DOT_MAX_ROWS:
            return self.wide.gemm(x) if isinstance(self.wide, Int8DotLinear) else self.wide(x)
        y = self.kernels.ops.int6_dot(x, self.packed, self.sub_scales, self.super_scales, True)
        return y if self.bias is None else y + self.bias
