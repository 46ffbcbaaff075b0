"""The tiny test model written as a GGUF file, as llama.cpp lays one out: what `--model x.gguf` and the default model
go through (the conversion to a float32 checkpoint, int4 from the file's own Q4_1 blocks, `auto`'s measurement), in
seconds rather than the real model's minutes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.quants import quantize
from transformers import PreTrainedModel

from tests.conftest import build_tiny_causal_lm
from tests.server_harness import TINY_CHAT_TEMPLATE, tiny_loaded_model, tiny_tokenizer

# Which GGUF type a layer's projection is written as: (layer index, llama.cpp tensor name) -> type.
ProjectionKinds = Callable[[int, str], GGMLQuantizationType]

_LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (transformers reverses it when it reads a GGUF)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """Q4_K blocks [rows, cols / 256 * 144] of a float32 [rows, cols] weight, by plain min/max per 32-weight
    sub-block (gguf-py reads Q4_K but cannot write it; llama.cpp searches the scales, this need not)."""
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // 256, 8, 32).astype(np.float32)
    low, high = np.minimum(groups.min(-1), 0), np.maximum(groups.max(-1), 0)  # [rows, blocks, 8]
    scale, mins = (high - low) / 15, -low
    d = np.maximum(scale.max(-1, keepdims=True) / 63, 1e-6).astype(np.float16)
    dmin = np.maximum(mins.max(-1, keepdims=True) / 63, 1e-6).astype(np.float16)
    sc = np.clip(np.round(scale / d.astype(np.float32)), 1, 63).astype(np.uint8)
    m = np.clip(np.round(mins / dmin.astype(np.float32)), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32) * sc)[..., None]
    offset = (dmin.astype(np.float32) * m)[..., None]
    codes = np.clip(np.round((groups + offset) / step), 0, 15).astype(np.uint8)  # [rows, blocks, 8, 32]
    # ggml's get_scale_min_k4 layout: 6-bit scales and mins in 12 bytes
    scale_bytes, min_bytes = sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6
    packed = np.concatenate([scale_bytes, min_bytes, (sc[..., 4:] & 15) | m[..., 4:] << 4], axis=-1)
    nibbles = codes[..., 0::2, :] | codes[..., 1::2, :] << 4  # 32-byte chunk c: sub-blocks 2c (low) and 2c + 1
    blocks = np.concatenate(
        [d.view(np.uint8), dmin.view(np.uint8), packed, nibbles.reshape(rows, cols // 256, 128)], axis=-1
    )
    return blocks.reshape(rows, -1)


def write_tiny_gguf(
    path: Path,
    model: PreTrainedModel | None = None,
    kinds: ProjectionKinds | None = None,
    file_type: LlamaFileType | None = None,
    head_kind: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    tied: bool = False,
) -> Path:
    """The tiny Llama (tests.server_harness; or `model`, with its tokenizer) with its projections as Q4_1 blocks
    (or as `kinds` says), its LM head Q8_0 (or `head_kind`), the rest F32, and its byte-level BPE tokenizer and chat
    template, as SmolLM2's GGUF holds them. `tied`: one tensor for the embedding and the head, `token_embd` in
    `head_kind` (the model's embedding), as llama.cpp writes Llama-3.2-1B."""
    model, tokenizer = model or tiny_loaded_model().model, tiny_tokenizer()
    config = model.config
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in tokenizer.all_special_tokens else 1 for token in tokens])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(merge) if isinstance(merge, list) else merge for merge in merges])
    writer.add_eos_token_id(int(tokenizer.eos_token_id))
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    if file_type is not None:
        writer.add_file_type(int(file_type))

    def add(name: str, weight: np.ndarray, kind: GGMLQuantizationType) -> None:
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, weight)
        else:
            own = {GGMLQuantizationType.Q4_K: quantize_q4_k, GGMLQuantizationType.Q6_K: quantize_q6_k}
            blocks = own[kind](weight) if kind in own else quantize(weight, kind)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)

    state = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    add("token_embd.weight", state["model.embed_tokens.weight"], head_kind if tied else GGMLQuantizationType.F32)
    add("output_norm.weight", state["model.norm.weight"], GGMLQuantizationType.F32)
    if not tied:
        add("output.weight", state["lm_head.weight"], head_kind)
    for layer in range(config.num_hidden_layers):
        for ours, theirs in _LAYER_TENSORS.items():
            weight = state[f"model.layers.{layer}.{ours}.weight"]
            if theirs in ("attn_q", "attn_k"):
                weight = _permute(weight, heads if theirs == "attn_q" else kv_heads)
            add(
                f"blk.{layer}.{theirs}.weight",
                weight,
                GGMLQuantizationType.F32 if weight.ndim == 1 else (kinds or _all_q4_1)(layer, theirs),
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _all_q4_1(layer: int, name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType.Q4_1


def _q4_k_m_kinds(layer: int, name: str) -> GGMLQuantizationType:
    """Q4_K, with Q6_K for the last layer's attn_v and ffn_down, as llama.cpp's Q4_K_M gives some layers."""
    return GGMLQuantizationType.Q6_K if layer == 1 and name in ("attn_v", "ffn_down") else GGMLQuantizationType.Q4_K


def write_tiny_q4_k_m_gguf(path: Path, only_q4_k: bool = False) -> Path:
    """A tiny Llama as a Q4_K_M file (`only_q4_k`: every projection Q4_K), its LM head Q6_K as llama.cpp writes it:
    hidden size 256 and intermediate 512, so that every projection's input is whole K-quant super-blocks (256
    weights)."""
    tokenizer = tiny_tokenizer()
    model = build_tiny_causal_lm("llama", vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512)
    kinds = (lambda layer, name: GGMLQuantizationType.Q4_K) if only_q4_k else _q4_k_m_kinds
    return write_tiny_gguf(path, model, kinds, LlamaFileType.MOSTLY_Q4_K_M, GGMLQuantizationType.Q6_K)


def write_tiny_tied_q6_k_gguf(path: Path) -> Path:
    """A tiny Llama as llama.cpp's `llama-quantize Q4_0` writes Llama-3.2-1B: Q4_0 projections, and one Q6_K tensor
    for the tied embedding and LM head (hidden size 256: whole Q6_K super-blocks)."""
    tokenizer = tiny_tokenizer()
    model = build_tiny_causal_lm("llama", vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512)
    q4_0 = lambda layer, name: GGMLQuantizationType.Q4_0  # noqa: E731
    return write_tiny_gguf(path, model, q4_0, LlamaFileType.MOSTLY_Q4_0, GGMLQuantizationType.Q6_K, tied=True)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """Q6_K blocks [rows, cols / 256 * 210] of a float32 [rows, cols] weight: per 16-weight group a signed 8-bit
    scale of the super-block's f16 d, values -32..31 (symmetric round-to-nearest; gguf-py cannot write Q6_K)."""
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // 256, 16, 16).astype(np.float32)
    group_scale = np.abs(groups).max(-1) / 31  # [rows, blocks, 16]
    d = np.maximum(group_scale.max(-1, keepdims=True) / 127, 1e-8).astype(np.float16)
    sc = np.clip(np.round(group_scale / d.astype(np.float32)), 1, 127).astype(np.int8)
    step = (d.astype(np.float32) * sc)[..., None]
    q = (np.clip(np.round(groups / step), -32, 31) + 32).astype(np.uint8).reshape(rows, -1, 2, 4, 32)
    # per 128-weight half: 4 runs of 32; ql holds runs 0/1 low nibbles (then 2/3 as high), qh their top 2 bits
    low = q & 15
    ql = np.concatenate([low[:, :, :, 0] | low[:, :, :, 2] << 4, low[:, :, :, 1] | low[:, :, :, 3] << 4], axis=-1)
    qh = q[:, :, :, 0] >> 4 | (q[:, :, :, 1] >> 4) << 2 | (q[:, :, :, 2] >> 4) << 4 | (q[:, :, :, 3] >> 4) << 6
    blocks = np.concatenate(
        [ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8), d.view(np.uint8)], axis=-1
    )
    return blocks.reshape(rows, -1)
