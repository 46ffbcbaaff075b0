// Every op of a build, declared in one place: bindings.cpp registers each with torch, and decode_layers.cpp calls
// some of them straight from C++. The comment above each group names the file that defines it.
//
// Each build of the extension (one per instruction set, engine/native.py) compiles these into its own namespace,
// BATCHSERVE_OPS (e.g. batchserve_avx2), which is also its torch.ops namespace: several builds can then be loaded
// into one process and compared, and none binds to another's symbols.

#pragma once

#ifndef BATCHSERVE_OPS
#define BATCHSERVE_OPS batchserve
#endif

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace BATCHSERVE_OPS {

// paged_decode_attention.cpp
torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                                     const torch::Tensor& value_cache, const torch::Tensor& block_table,
                                     const torch::Tensor& context_lens, int64_t block_size, double scale);

// paged_prefill_attention.cpp (the kernel only in the avx512_bf16 build: prefill_attention_available)
torch::Tensor paged_prefill_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                                      const torch::Tensor& value_cache, const torch::Tensor& block_table,
                                      const torch::Tensor& token_start, const torch::Tensor& counts,
                                      const torch::Tensor& context_lens, int64_t block_size, double scale);
bool prefill_attention_available();

// fused_ops.cpp
torch::Tensor add_rms_norm(torch::Tensor residual, const std::optional<torch::Tensor>& delta,
                           const torch::Tensor& weight, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
torch::Tensor silu_mul_table(const torch::Tensor& gate_up, const torch::Tensor& silu_table, int64_t vector_step);
torch::Tensor rope_write_cache(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                               torch::Tensor key_cache, torch::Tensor value_cache, const torch::Tensor& slot_mapping,
                               int64_t heads, int64_t kv_heads);

// sampling.cpp
torch::Tensor argmax_rows(const torch::Tensor& logits);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> prompt_scores(const torch::Tensor& logits,
                                                                                     const torch::Tensor& target,
                                                                                     int64_t k);

// int4_gemv.cpp
torch::Tensor int4_gemv(const torch::Tensor& x, const torch::Tensor& packed, int64_t group,
                        const torch::Tensor& scales_and_zeros);

// int8_gemv.cpp
torch::Tensor int8_gemv(const torch::Tensor& x, const torch::Tensor& values, const torch::Tensor& scales);

// int4_dot.cpp
torch::Tensor int4_dot(const torch::Tensor& x, const torch::Tensor& packed, int64_t group, const torch::Tensor& scales,
                       const torch::Tensor& zeros);
bool int4_dot_available();

// int8_dot.cpp (the int8 LM head by integer dot products)
// one_digit: the activations' leading int8 digit alone (half the integer work; docs/quantization.md has its cost).
torch::Tensor int8_dot(const torch::Tensor& x, const torch::Tensor& packed, int64_t group, const torch::Tensor& scales,
                       bool one_digit);
bool int8_dot_available();

// int6_dot.cpp (GGUF Q6_K weights by integer dot products: a 4-bit file's LM head)
torch::Tensor int6_dot(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sub_scales,
                       const torch::Tensor& super_scales, bool one_digit);
bool int6_dot_available();

// int4_gemm.cpp (int4_dot's weights, many rows, one int8 digit per activation)
torch::Tensor int4_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t group, const torch::Tensor& scales,
                        const torch::Tensor& zeros);

// decode_layers.cpp
void decode_layers(torch::Tensor x, const torch::Tensor& cache, at::TensorList layers, const torch::Tensor& cos,
                   const torch::Tensor& sin, const torch::Tensor& slot_mapping, const torch::Tensor& block_table,
                   const torch::Tensor& context_lens, int64_t heads, int64_t kv_heads, int64_t block_size,
                   double scale, double eps, bool fused_silu, bool one_digit);

}  // namespace BATCHSERVE_OPS
