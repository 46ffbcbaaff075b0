"""A decoder layer's element-wise work as fused CPU kernels (engine/csrc/fused_ops.cpp), with torch fallbacks.

Each entry point runs the compiled op when the extension is loaded and the tensors fit it (CPU, float32 or
bfloat16, matching dtypes), and otherwise the torch ops it replaces. Both follow transformers' Llama numerics in
the tensor's dtype: float32 throughout for float32 (bit-identical except RMSNorm's sum of squares, which may
differ in the last bit), and for bfloat16 a rounding wherever the torch modules round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.platform import native

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _silu_types() -> tuple[type[nn.Module], ...]:
    """The modules that compute exactly F.silu: torch's, and transformers' (what ACT2FN["silu"] builds)."""
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # an older transformers builds nn.SiLU
        return (nn.SiLU,)
    return (nn.SiLU, SiLUActivation)


_SILU_TYPES = _silu_types()


def is_silu(act: nn.Module) -> bool:
    """Whether the activation module computes exactly F.silu."""
    return type(act) in _SILU_TYPES


# Elements per step of torch's vectorised bfloat16 loop at each capability (two vectors: 2 x 32 with AVX-512, 2 x 16
# with AVX2); the rest of a row takes its scalar std::exp. DEFAULT's "vectors" call std::exp too, so any split holds.
_TORCH_BF16_STEP = {"AVX512": 64, "AVX2": 32}


def bf16_silu_table() -> torch.Tensor:
    """torch's own SiLU of every bfloat16 bit pattern, as float32 [65536] indexed by the input's bits: what its
    vectorised loop gives each value (65,536 is a whole number of steps at every capability)."""
    every_value = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return F.silu(every_value).float()


def _fits(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return first.device.type == "cpu" and first.dtype in _KERNEL_DTYPES and all(t.dtype == first.dtype for t in tensors)


@dataclass(frozen=True)
class RotaryTables:
    """One step's RoPE tables, built once and shared by every layer."""

    cos: torch.Tensor  # [tokens, head_dim]
    sin: torch.Tensor  # [tokens, head_dim]
    signed_sin: torch.Tensor  # [tokens, 1, head_dim]: sin with its first half negated (torch path)
    swap: torch.Tensor  # [head_dim] int64: the halves exchanged, as rotate_half does (torch path)

    @classmethod
    def build(cls, cos: torch.Tensor, sin: torch.Tensor) -> RotaryTables:
        """From a rotary embedding's (cos, sin), each [tokens, head_dim]."""
        half = cos.shape[-1] // 2
        # rotate_half(x) * sin == x[..., swapped halves] * (sin with its first half negated): one gather, no cat.
        signed = torch.cat((-sin[:, None, :half], sin[:, None, half:]), dim=-1)
        swap = torch.cat((torch.arange(half, 2 * half), torch.arange(half))).to(cos.device)
        return cls(cos.contiguous(), sin.contiguous(), signed, swap)


@dataclass(frozen=True)
class ElementwiseOps:
    """The fused ops of a layer, through `kernels` (a loaded build, engine/platform/native.py) or torch's ops when None.

    SiLU * up runs fused only where it gives torch's bits: in bfloat16 always, through a table of torch's own SiLU
    of every bfloat16 value (`silu_table`); in float32 only where the build calls torch's exp
    (`Kernels.silu_matches_torch`). Exactness is a property of the format, so where the kernel cannot match torch,
    torch's op runs."""

    kernels: native.Kernels | None
    fused_silu: bool = False
    silu_table: torch.Tensor | None = None  # bf16_silu_table(), where the kernels are loaded
    silu_vector_step: int = 1  # torch's bfloat16 loop step here: table lookups up to the row's last whole step

    @classmethod
    def build(cls, kernels: native.Kernels | None) -> ElementwiseOps:
        if kernels is None:
            return cls(None)
        step = _TORCH_BF16_STEP.get(torch.backends.cpu.get_cpu_capability(), 1)
        return cls(kernels, kernels.silu_matches_torch, bf16_silu_table(), step)

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += delta (in place; skipped when None), then LlamaRMSNorm(residual) with `weight`.

        residual: [rows, hidden], contiguous. Returns [rows, hidden] in the residual's dtype."""
        others = (weight,) if delta is None else (weight, delta)
        if self.kernels and residual.dim() == 2 and residual.is_contiguous() and _fits(residual, *others):
            return self.kernels.ops.add_rms_norm(residual, delta, weight, eps)  # type: ignore[no-any-return]
        if delta is not None:
            residual.add_(delta)
        if residual.dtype == torch.float32 and weight.dtype == torch.float32:
            # One op; in float32 it gives bit for bit what LlamaRMSNorm's six ops give
            # (tests/engine/model/test_fused_ops.py).
            return F.rms_norm(residual, (residual.shape[-1],), weight, eps)
        x = residual.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(residual.dtype)

    def fuses_silu(self, act: nn.Module) -> bool:
        """Whether `act` * up runs as the compiled silu_mul (for tensors that fit it)."""
        return self.kernels is not None and self.fused_silu and is_silu(act)

    def gated_activation(self, gate_up: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """act(gate) * up over a fused [rows, 2 n] gate|up projection: [rows, n]."""
        if (
            self.kernels
            and self.silu_table is not None
            and is_silu(act)
            and gate_up.dim() == 2
            and gate_up.dtype == torch.bfloat16
            and gate_up.device.type == "cpu"
        ):
            return self.kernels.ops.silu_mul_table(  # type: ignore[no-any-return]
                gate_up, self.silu_table, self.silu_vector_step
            )
        if self.kernels and self.fuses_silu(act) and gate_up.dim() == 2 and _fits(gate_up):
            return self.kernels.ops.silu_mul(gate_up)  # type: ignore[no-any-return]
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up  # type: ignore[no-any-return]

    def rope_write_cache(
        self,
        qkv: torch.Tensor,
        rotary: RotaryTables,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        heads: int,
        kv_heads: int,
    ) -> torch.Tensor:
        """RoPE on the queries and keys of a fused [tokens, (heads + 2 kv_heads) * dim] projection; the keys and
        values go to their cache slots ([kv_heads, slots, dim] caches). Returns the queries [tokens, heads, dim]."""
        if (
            self.kernels
            and qkv.dim() == 2
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
            and _fits(qkv, rotary.cos, key_cache, value_cache)
        ):
            return self.kernels.ops.rope_write_cache(  # type: ignore[no-any-return]
                qkv, rotary.cos, rotary.sin, key_cache, value_cache, slot_mapping, heads, kv_heads
            )
        tokens, dim = qkv.shape[0], key_cache.shape[-1]
        qk_width = (heads + kv_heads) * dim
        qk = qkv[:, :qk_width].view(tokens, heads + kv_heads, dim)
        cos = rotary.cos[:, None, :]
        qk = qk * cos + qk.index_select(-1, rotary.swap) * rotary.signed_sin  # separate mul and add, as HF rounds
        query, key = qk[:, :heads], qk[:, heads:]
        value = qkv[:, qk_width:].view(tokens, kv_heads, dim)
        key_cache.index_copy_(1, slot_mapping, key.transpose(0, 1))
        value_cache.index_copy_(1, slot_mapping, value.transpose(0, 1))
        return query
