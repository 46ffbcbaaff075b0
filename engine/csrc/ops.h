// The entry points one source of a build calls in another (decode_layers.cpp runs a decode step's layers through
// them without going back to Python). They live in the build's own namespace (BATCHSERVE_OPS, e.g.
// batchserve_avx2), so that builds loaded into one process never bind to each other's symbols.

#pragma once

#include <torch/types.h>

#include <cstdint>
#include <optional>

#include "scalar.h"  // BATCHSERVE_OPS

namespace BATCHSERVE_OPS {

// fused_ops.cpp
torch::Tensor add_rms_norm(torch::Tensor residual, const std::optional<torch::Tensor>& delta,
                           const torch::Tensor& weight, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
torch::Tensor rope_write_cache(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                               torch::Tensor key_cache, torch::Tensor value_cache, const torch::Tensor& slot_mapping,
                               int64_t heads, int64_t kv_heads);

// paged_decode_attention.cpp
torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                                     const torch::Tensor& value_cache, const torch::Tensor& block_table,
                                     const torch::Tensor& context_lens, int64_t block_size, double scale);

// quant_gemv.cpp
torch::Tensor int4_dot(const torch::Tensor& x, const torch::Tensor& packed, int64_t group, const torch::Tensor& scales,
                       const torch::Tensor& zeros);

}  // namespace BATCHSERVE_OPS
