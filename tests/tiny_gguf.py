"""The tiny test model written as a GGUF file, as llama.cpp lays one out: what `--model x.gguf` and the default model
go through (the conversion to a float32 checkpoint, int4 from the file's own Q4_1 blocks, `auto`'s measurement), in
seconds rather than the real model's minutes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from tests.server_harness import TINY_CHAT_TEMPLATE, tiny_loaded_model, tiny_tokenizer

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


def write_tiny_gguf(path: Path) -> Path:
    """The tiny Llama (tests.server_harness) with its projections as Q4_1 blocks, its LM head Q8_0, the rest F32,
    and its byte-level BPE tokenizer and chat template, as SmolLM2's GGUF holds them."""
    model, tokenizer = tiny_loaded_model().model, tiny_tokenizer()
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

    def add(name: str, weight: np.ndarray, kind: GGMLQuantizationType) -> None:
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, weight)
        else:
            blocks = quantize(weight, kind)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)

    state = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    add("token_embd.weight", state["model.embed_tokens.weight"], GGMLQuantizationType.F32)
    add("output_norm.weight", state["model.norm.weight"], GGMLQuantizationType.F32)
    add("output.weight", state["lm_head.weight"], GGMLQuantizationType.Q8_0)
    for layer in range(config.num_hidden_layers):
        for ours, theirs in _LAYER_TENSORS.items():
            weight = state[f"model.layers.{layer}.{ours}.weight"]
            if theirs in ("attn_q", "attn_k"):
                weight = _permute(weight, heads if theirs == "attn_q" else kv_heads)
            add(
                f"blk.{layer}.{theirs}.weight",
                weight,
                GGMLQuantizationType.F32 if weight.ndim == 1 else GGMLQuantizationType.Q4_1,
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
