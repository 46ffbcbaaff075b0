"""Runs a transformers Llama-family model's own modules over a packed batch with the engine's attention.

We reuse the loaded `AutoModelForCausalLM` (its weights, embeddings, norms, rotary embedding and activation)
but not its forward: the HF forward expects a rectangular padded batch and its own cache objects, while a
continuous-batching step is a ragged mix of prompt chunks and single decode tokens over a paged cache. The
q/k/v and gate/up projections are fused into one matmul each; the model's parameters become views of the
fused weights, so the model object stays valid (and is what the parity tests run `generate()` on).
On the CPU the projections run through oneDNN on reordered weight copies (see engine/model/linear.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import DEFAULT_MAX_QUANTIZED_ROWS, check_int4_gemm_scope
from engine.kv.kv_cache import KVCacheShape, PagedKVCache
from engine.model.attention import PreparedGroup, paged_attention, prepare
from engine.model.elementwise import ElementwiseOps, RotaryTables
from engine.model.forward_batch import ForwardBatch
from engine.model.fused_decode import FusedDecode, LayerWeights
from engine.model.linear import (
    AnyLinear,
    IntegerDotLinear,
    Linear,
    RowSwitchedLinear,
    build_linear,
    gemm_without_dense_copy,
)
from engine.model.prompt_scoring import DEFAULT_SLICE, PromptScores, score_positions
from engine.model.token_embedding import TokenEmbedding, build_embedding
from engine.platform.native import KernelBuild, Kernels, load_kernels, torch_runs_amx
from engine.weights.loader import held_parameter
from engine.weights.quantization import Int4Weight, QuantizedWeight, concat_rows


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [sampling rows, vocab] float32, at the last token of each sampling row
    prompt_scores: PromptScores | None = None  # for `batch.scoring`'s positions in its order; None without it


class ModelRunner(Protocol):
    """Computes next-token logits for the sampling rows of a batch and scores the prompt positions it asks
    for, writing keys and values to the cache."""

    vocab_size: int
    # The compiled kernels this runner was built with (None: torch's ops). The engine hands them to the sampler, so
    # a runner built without them samples without them too, whatever this process loaded before.
    kernels: Kernels | None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> KVCacheShape: ...

    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> ForwardOutput: ...


class UnsupportedModelError(ValueError):
    pass


# How prompt chunks over a bf16 cache attend (TransformersRunner's `prefill_attention`).
PREFILL_ATTENTION = ("auto", "kernel", "sdpa")


def _bias(module: nn.Linear) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.data


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the output rows of several Linear layers and make each layer's weight a view of them."""
    weight = torch.cat([lin.weight.data for lin in linears], dim=0)
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat(
            [lin.bias.data if lin.bias is not None else weight.new_zeros(lin.out_features) for lin in linears]
        )
    row = 0
    for lin in linears:
        lin.weight.data = weight[row : row + lin.out_features]
        if lin.bias is not None and bias is not None:
            lin.bias.data = bias[row : row + lin.out_features]
        row += lin.out_features
    return weight, bias


class TransformersRunner:
    def __init__(
        self,
        model: Any,
        prepack_weights: bool = True,
        native_attention: bool = True,
        score_slice: int = DEFAULT_SLICE,
        fused_ops: bool = True,
        quantized: Mapping[str, QuantizedWeight] | None = None,
        max_quantized_rows: int | None = DEFAULT_MAX_QUANTIZED_ROWS,
        int8_activations: bool = True,
        min_gemm_rows: int | None = None,
        int4_gemm: str = "off",
        kernel_build: KernelBuild | None = None,
        fused_decode: bool = True,
        prefill_attention: str = "auto",
        keep_model_weights: bool = True,
    ) -> None:
        """`prepack_weights`: run the projections through oneDNN on reordered weight copies (CPU, float32).
        `native_attention`: decode attention and prompt scoring through the compiled CPU kernels where they build
        (engine/platform/native.py).
        `score_slice`: prompt positions per LM-head call when scoring prompts (bounds the logits' memory).
        `fused_ops`: with `native_attention`, also the compiled element-wise kernels (engine/model/elementwise.py):
        residual add + RMSNorm, SiLU * up, RoPE + cache write.
        `quantized`: int4/int8 weights replacing the dense ones, keyed by module name (`lm_head`,
        `model.layers.N.self_attn.q_proj`, ...; engine/weights/loader.py). The runner keeps neither them nor the
        model: only the matmuls it builds and the modules it runs (embedding, norms, rotary), so that what the loader
        held for building them is freed with the loaded model.
        `max_quantized_rows`: steps of more rows than this run the dense weights (linear.RowSwitchedLinear);
        None: every step runs the quantised ones.
        `int8_activations`: int4 matmuls quantise the activations to int8 digits for integer dot products where the
        kernel build has them: AVX2, or AVX-512 with VNNI (linear.Int4DotLinear; a quality change measured in
        docs/quantization.md), and so do int8 ones (the LM head) with VNNI (linear.Int8DotLinear).
        `min_gemm_rows`: with int8 activations, steps of at least this many rows (past `max_quantized_rows`) run the
        int4 weights through the many-row kernel (one int8 digit per activation, linear.Int4DotLinear.gemm) instead
        of the dense copy; None: never.
        `int4_gemm`: with int8 activations, which int4 weights keep no dense copy and run steps past
        `max_quantized_rows` on int4_gemm: "off", "except-qkv" (all but the fused q/k/v projection) or "all" (the
        serve flag --int4-gemm; engine.config.INT4_GEMM_SCOPES; quality and speed in docs/quantization.md).
        `kernel_build`: which build of the compiled kernels to run (engine/platform/native.py); default the best this
        CPU allows under BATCHSERVE_CPU_ISA.
        `fused_decode`: pure decode steps run every layer in one call where the layers allow it
        (engine/model/fused_decode.py; the same result as the per-op path, bit for bit).
        `prefill_attention`: how prompt chunks over a bfloat16 cache attend (float32 always takes torch's SDPA):
        "kernel", the compiled prefill kernel where the build has it (AVX512-BF16, head size 64 or 128, with
        `native_attention`); "sdpa", torch's; "auto", torch's where it runs on AMX tiles (native.torch_runs_amx:
        2.1-2.8x the kernel's speed at 1,024 tokens on a Sapphire Rapids Xeon, docs/prefill_attention.md), else the
        kernel.
        `keep_model_weights`: False where the model is no reference anyone runs (a serving load,
        engine/weights/loader.py): each dense weight packed for oneDNN is taken from the model once packed, so one copy
        is held, not two. The model cannot run, nor build another runner, after.
        """
        config = model.config
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
            raise UnsupportedModelError(
                f"{type(model).__name__} is not a Llama-family decoder (needs model.layers and model.rotary_emb)"
            )
        held = held_parameter(model)
        self.device, self.dtype = held.device, held.dtype
        self.vocab_size = int(config.vocab_size)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.eps = float(config.rms_norm_eps)
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm.weight
        self.prepack_weights = prepack_weights
        self.keep_model_weights = keep_model_weights
        self.score_slice = score_slice
        quantized = dict(quantized or {})  # consumed here: the runner keeps only the matmuls built from them
        self.embed: TokenEmbedding = inner.embed_tokens  # the model's table, unless the head's rows replace it below
        self.max_quantized_rows = max_quantized_rows
        use_kernel = native_attention and self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
        self.kernels = load_kernels(kernel_build) if use_kernel else None
        self.native_matmuls = self.kernels is not None and bool(quantized)
        self.int8_activations = int8_activations and self.kernels is not None and self.kernels.has_int4_dot
        self.min_gemm_rows = min_gemm_rows
        check_int4_gemm_scope(int4_gemm)  # before any weight is built
        self.int4_gemm = int4_gemm
        self.lm_head = self._build([model.lm_head], ["lm_head"], quantized)
        self.embed = build_embedding(inner.embed_tokens, config, quantized, self.lm_head, self.dtype)
        self.layers = [
            self._prepare_layer(layer, f"model.layers.{i}", quantized) for i, layer in enumerate(inner.layers)
        ]
        attention = inner.layers[0].self_attn
        self.scale = float(getattr(attention, "scaling", self.head_dim**-0.5))
        self.act = inner.layers[0].mlp.act_fn
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self.decode_kernel = self.kernels.decode_attention if self.kernels else None
        self.score_kernel = self.kernels.prompt_scores if self.kernels else None
        if prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"prefill_attention={prefill_attention!r}: use one of {', '.join(PREFILL_ATTENTION)}")
        wants_kernel = prefill_attention == "kernel" or (prefill_attention == "auto" and not torch_runs_amx())
        use_prefill = wants_kernel and self.dtype == torch.bfloat16 and self.head_dim in (64, 128)
        self.prefill_kernel = self.kernels.prefill_attention if self.kernels and use_prefill else None
        self.ops = ElementwiseOps.build(self.kernels if fused_ops else None)
        use_fused = fused_decode and self.decode_kernel is not None
        self.fused_decode = FusedDecode.build(self.layers, self.ops, self.act) if use_fused else None

    def _build(self, modules: list[nn.Linear], names: list[str], quantized: Mapping[str, QuantizedWeight]) -> AnyLinear:
        """The matmul for the modules `names` (fused along output rows where several): their quantised weights if
        all have one, else dense."""
        weight, bias = _fuse(modules) if len(modules) > 1 else (modules[0].weight.data, _bias(modules[0]))
        if not (quantized and all(name in quantized for name in names)):
            return self._dense(modules, names[0], weight, bias)
        weights = concat_rows([quantized[name] for name in names])
        kernels = self.kernels if self.native_matmuls else None
        matmul = build_linear(weights, bias, self.dtype, self.prepack_weights, kernels, self.int8_activations)
        if self.max_quantized_rows is None or isinstance(matmul, Linear):  # Linear: a Q6_K head without its kernel
            return matmul
        if gemm_without_dense_copy(self.int4_gemm, names) and isinstance(matmul, IntegerDotLinear):
            return RowSwitchedLinear(matmul, None, self.max_quantized_rows)
        # The dense copy holds the quantised weights' own values (as the kernels read them), not the checkpoint's:
        # large and small steps compute the same function.
        values = weights.dequantize(self.dtype) if isinstance(weights, Int4Weight) else weights.dequantize()
        dense = Linear.build(values.to(self.dtype), bias, self.prepack_weights, own_copy=True)
        return RowSwitchedLinear(matmul, dense, self.max_quantized_rows, self.min_gemm_rows)

    def _dense(self, modules: list[nn.Linear], name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        """The model's own weight; packed for oneDNN, and taken from the model where it is not kept (a serving
        load's), so that one copy is held, not two. A head tied to the embedding stays: tokens are looked up in it."""
        if weight.is_meta:
            raise ValueError(f"{name}: the model's weights were taken by a runner built before (keep_model_weights)")
        linear = build_linear(weight, bias, self.dtype, self.prepack_weights)
        assert isinstance(linear, Linear)
        tied = isinstance(self.embed, nn.Embedding) and any(m.weight is self.embed.weight for m in modules)
        if self.keep_model_weights or linear.packed is None or tied:
            return linear
        for module in modules:
            module.weight = nn.Parameter(module.weight.data.to("meta"), requires_grad=False)
        return dataclasses.replace(linear, weight=weight.to("meta"))

    def _prepare_layer(self, layer: Any, prefix: str, quantized: Mapping[str, QuantizedWeight]) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(attn, name, None), nn.Linear):
                raise UnsupportedModelError(f"attention module {type(attn).__name__} has no Linear {name}")
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not isinstance(getattr(mlp, name, None), nn.Linear):
                raise UnsupportedModelError(f"MLP module {type(mlp).__name__} has no Linear {name}")
        return LayerWeights(
            input_norm=layer.input_layernorm.weight,
            qkv_proj=self._build(
                [attn.q_proj, attn.k_proj, attn.v_proj], [f"{prefix}.self_attn.{n}_proj" for n in "qkv"], quantized
            ),
            o_proj=self._build([attn.o_proj], [f"{prefix}.self_attn.o_proj"], quantized),
            post_norm=layer.post_attention_layernorm.weight,
            gate_up_proj=self._build(
                [mlp.gate_proj, mlp.up_proj], [f"{prefix}.mlp.{n}_proj" for n in ("gate", "up")], quantized
            ),
            down_proj=self._build([mlp.down_proj], [f"{prefix}.mlp.down_proj"], quantized),
        )

    @staticmethod
    def layer_linears(layer: LayerWeights) -> tuple[AnyLinear, ...]:
        """The weight matmuls of one layer, in the order a step runs them."""
        return (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> KVCacheShape:
        return KVCacheShape(len(self.layers), self.num_kv_heads, self.head_dim, num_blocks, block_size)

    def _gather_scratch(
        self, groups: tuple[PreparedGroup, ...], cache: PagedKVCache
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Key and value gather buffers for a pure decode step, grown as contexts grow and reused by all layers."""
        if len(groups) != 1 or groups[0].block_index is None or not groups[0].group.is_decode:
            return None
        needed = groups[0].block_index.numel() * cache.shape.block_size * self.head_dim
        if self._scratch is None or self._scratch[0].numel() < needed:
            size = max(needed, 2 * (self._scratch[0].numel() if self._scratch is not None else 0))
            self._scratch = (cache.data.new_empty(size), cache.data.new_empty(size))
        return self._scratch

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # One fused op; in float32 it gives bit-for-bit what LlamaRMSNorm's six ops give (tested), which the
        # greedy parity with generate() relies on.
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head over last-layer hidden states: [rows, vocab] float32."""
        return self.lm_head(self._rms_norm(hidden, self.final_norm)).float()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> ForwardOutput:
        x = self.embed(batch.input_ids)  # [tokens, hidden]
        cos, sin = self.rotary(x, batch.positions[None])  # each [1, tokens, head_dim]
        rotary = RotaryTables.build(cos[0], sin[0])
        native = self.decode_kernel is not None
        # Shared by every layer.
        native_prefill = self.prefill_kernel is not None and cache.data.dtype == torch.bfloat16
        shape = cache.shape
        groups = prepare(batch.groups, self.num_kv_heads, shape.num_blocks, shape.block_size, native, native_prefill)
        fused = self.fused_decode
        if fused is not None and fused.accepts(groups, batch.num_tokens) and cache.data.dtype == x.dtype:
            fused(
                x,
                cache.data,
                rotary,
                batch.slot_mapping,
                groups[0],
                self.num_heads,
                self.num_kv_heads,
                self.scale,
                self.eps,
            )
        else:
            self._layers(x, batch, cache, rotary, groups)
        logits = self._logits(x[batch.sample_index])
        scoring = batch.scoring
        if scoring is None:
            return ForwardOutput(logits)
        scores = score_positions(
            x, scoring.index, scoring.target, scoring.top_k, self._logits, self.score_slice, self.score_kernel
        )
        return ForwardOutput(logits, scores)

    def _layers(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
        rotary: RotaryTables,
        groups: tuple[PreparedGroup, ...],
    ) -> None:
        """Every decoder layer, one op at a time, over the residual stream x (updated in place)."""
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        tokens = batch.num_tokens
        scratch = self._gather_scratch(groups, cache)
        ops = self.ops
        mlp_out: torch.Tensor | None = None  # the previous layer's MLP output, added to x by the next norm
        for index, layer in enumerate(self.layers):
            h = ops.add_rms_norm(x, mlp_out, layer.input_norm, self.eps)  # x (the residual) is updated in place
            qkv = layer.qkv_proj(h)  # [tokens, (heads + 2 kv_heads) * dim]
            key_cache, value_cache = cache.layer(index)
            query = ops.rope_write_cache(qkv, rotary, key_cache, value_cache, batch.slot_mapping, heads, kv_heads)
            attended = paged_attention(
                query, key_cache, value_cache, groups, self.scale, scratch, self.decode_kernel, self.prefill_kernel
            )
            h = ops.add_rms_norm(x, layer.o_proj(attended.reshape(tokens, heads * dim)), layer.post_norm, self.eps)
            mlp_out = layer.down_proj(ops.gated_activation(layer.gate_up_proj(h), self.act))
        if mlp_out is not None:
            x.add_(mlp_out)
