// The element-wise work of a decoder layer, fused: one pass over each row instead of one torch op (and one
// allocation) per step of the formula. At batch 1 a step's element-wise ops cost more in dispatch than in
// arithmetic; at large batches each fused op also reads its rows once instead of several times.
//
// Numerics follow transformers' Llama modules in the tensor's own dtype: every place where the torch code rounds
// to bfloat16, these kernels round too (`round_as`), and float32 is computed in the same order as torch, with no
// fused multiply-adds (the pragma below: GCC contracts a * b + c in C++ by default, which rounds once where torch
// rounds twice). So in float32 the residual add, RoPE, the cache write and SiLU(gate) * up give torch's bits;
// RMSNorm's sum of squares is taken in double and may differ from torch's float sum in the last bit.
//
//   add_rms_norm:  residual += delta (in place), then RMSNorm(residual) * weight
//   silu_mul:      [rows, 2 n] gate|up -> [rows, n] SiLU(gate) * up
//   silu_mul_table: the same for bfloat16, SiLU read from a table of torch's own values
//   rope_write_cache: RoPE on q and k of a fused qkv projection, k and v written to their paged cache slots

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

// vector_exp.h: torch's vectorised exp at its AVX-512 and AVX2 capabilities (libtorch_cpu exports both): calling
// the routine torch calls at the same capability makes this SiLU give the bits of torch's own. The builds without
// either match torch's DEFAULT capability, whose vectorised exp is std::exp element by element.

#include "ops.h"
#include "scalar.h"
#include "vector_exp.h"
#include "vector_lanes.h"

namespace BATCHSERVE_OPS {
namespace {

using batchserve::narrow;
using batchserve::round_as;
using batchserve::widen;

bool float_or_bf16(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16;
}

// Rows per task so that a task has at least ~16k elements: smaller batches run on the calling thread.
int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elements)); }

#if defined(__AVX512F__) || defined(__AVX2__)
// The vector builds' SiLU and RoPE loops go a vector at a time with the same operations per element in the same order
// (vector_lanes.h widens and rounds as widen, narrow and round_as do): the bits are the scalar loops'.
namespace lanes = batchserve::lanes;
constexpr int64_t kLanes = lanes::kWidth;
#endif

// ---------------------------------------------------------------------------------------------------------------
// Residual add + RMSNorm. transformers' LlamaRMSNorm: x.float(); x * rsqrt(mean(x^2) + eps); .to(dtype); w * x.

template <typename T>
void add_rms_norm_rows(T* residual, const T* delta, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* x = residual + r * n;
      if (delta != nullptr) {
        const T* d = delta + r * n;
        for (int64_t i = 0; i < n; ++i) x[i] = narrow<T>(widen(x[i]) + widen(d[i]));
      }
      double squares = 0;  // each square rounded to float, as x.pow(2) does, then summed exactly enough
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < n; ++i) {
        const float v = widen(x[i]);
        const float square = v * v;
        squares += static_cast<double>(square);
      }
      const float variance = static_cast<float>(squares) / static_cast<float>(n);
      const float inverse = 1.0f / std::sqrt(variance + eps);
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = narrow<T>(widen(weight[i]) * round_as<T>(widen(x[i]) * inverse));
    }
  });
}

}  // namespace

torch::Tensor add_rms_norm(torch::Tensor residual, const std::optional<torch::Tensor>& delta,
                           const torch::Tensor& weight, double eps) {
  TORCH_CHECK(residual.device().is_cpu() && float_or_bf16(residual) && residual.dim() == 2 &&
                  residual.is_contiguous(),
              "residual must be a contiguous [rows, hidden] float32 or bfloat16 CPU tensor");
  const int64_t rows = residual.size(0), n = residual.size(1);
  TORCH_CHECK(weight.scalar_type() == residual.scalar_type() && weight.dim() == 1 && weight.size(0) == n,
              "weight must be [hidden] in the residual's dtype");
  torch::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(d.scalar_type() == residual.scalar_type() && d.sizes() == residual.sizes(),
                "delta must match the residual's shape and dtype");
  }
  const auto w = weight.contiguous();
  auto out = torch::empty_like(residual);
  if (residual.scalar_type() == torch::kFloat) {
    add_rms_norm_rows<float>(residual.data_ptr<float>(), d.defined() ? d.data_ptr<float>() : nullptr,
                             w.data_ptr<float>(), out.data_ptr<float>(), rows, n, static_cast<float>(eps));
  } else {
    using B = c10::BFloat16;
    add_rms_norm_rows<B>(residual.data_ptr<B>(), d.defined() ? d.data_ptr<B>() : nullptr, w.data_ptr<B>(),
                         out.data_ptr<B>(), rows, n, static_cast<float>(eps));
  }
  return out;
}

namespace {

// ---------------------------------------------------------------------------------------------------------------
// SiLU(gate) * up. torch computes SiLU as x / (1 + exp(-x)) with its vectorised exp over whole vector chunks
// (two vectors a step: 32 float32 or 64 bfloat16 values with AVX-512, 16 or 32 with AVX2) and std::exp on the
// rest of each row; this does the same.

// The vector builds load, compute and store whole vectors (vector_lanes.h): widening bfloat16 into a float array
// lane by lane and reading it back as a vector stalled on every store (a [32, 6144] bfloat16 gate|up took 164 us,
// torch's own SiLU then multiply 44).
#if defined(__AVX512F__) || defined(__AVX2__)
inline lanes::Vec silu_lanes(lanes::Vec v) {
  return lanes::div(v, lanes::add(lanes::set1(1.0f), lanes::exp(lanes::sub(lanes::zero(), v))));
}
#endif

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
      int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
      // torch's vectorised loop step for this dtype: two vectors of T (a bf16 vector holds twice the floats).
      constexpr int64_t kChunk = 2 * kLanes * (sizeof(T) == 4 ? 1 : 2);
      for (const int64_t vectorised = n / kChunk * kChunk; i < vectorised; i += kLanes) {
        // narrow(round_as(SiLU(gate)) * up), as below, a vector at a time
        const lanes::Vec silu = lanes::round_as(silu_lanes(lanes::load(g + i)), T{});
        lanes::store(o + i, lanes::mul(silu, lanes::load(u + i)));
      }
#endif
      for (; i < n; ++i) {
        const float x = widen(g[i]);
        o[i] = narrow<T>(round_as<T>(x / (1.0f + std::exp(-x))) * widen(u[i]));
      }
    }
  });
}

}  // namespace

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && float_or_bf16(gate_up) && gate_up.dim() == 2 &&
                  gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 * n] float32 or bfloat16 on the CPU");
  const auto x = gate_up.contiguous();
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  auto out = torch::empty({rows, n}, x.options());
  if (x.scalar_type() == torch::kFloat) {
    silu_mul_rows<float>(x.data_ptr<float>(), out.data_ptr<float>(), rows, n);
  } else {
    silu_mul_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, n);
  }
  return out;
}

namespace {

// SiLU of a bfloat16 gate has 65,536 possible inputs, so torch's own results for all of them fit a table (256 KB of
// float32, in L2): one gather a vector instead of an exp and a division (a [1024, 3072] gate|up: 0.79 against 1.2 ms
// on one Zen 4 core, one-off). The table is torch's, so the bits are torch's whatever this build's instruction set.
void silu_mul_table_rows(const c10::BFloat16* gate_up, c10::BFloat16* out, const float* table, int64_t rows,
                         int64_t n, int64_t vector_step) {
  const int64_t vectorised = n / vector_step * vector_step;  // torch's vector loop; its scalar tail uses std::exp
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* g = gate_up + r * 2 * n;
      const c10::BFloat16* u = g + n;
      c10::BFloat16* o = out + r * n;
      int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
      for (; i + kLanes <= vectorised; i += kLanes)
        lanes::store(o + i, lanes::mul(lanes::lookup(table, g + i), lanes::load(u + i)));
#endif
      for (; i < vectorised; ++i) o[i] = narrow<c10::BFloat16>(table[g[i].x] * widen(u[i]));
      for (; i < n; ++i) {
        const float x = widen(g[i]);
        o[i] = narrow<c10::BFloat16>(round_as<c10::BFloat16>(x / (1.0f + std::exp(-x))) * widen(u[i]));
      }
    }
  });
}

}  // namespace

torch::Tensor silu_mul_table(const torch::Tensor& gate_up, const torch::Tensor& silu_table, int64_t vector_step) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == torch::kBFloat16 && gate_up.dim() == 2 &&
                  gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 * n] bfloat16 on the CPU");
  TORCH_CHECK(silu_table.scalar_type() == torch::kFloat && silu_table.dim() == 1 && silu_table.size(0) == 65536 &&
                  silu_table.is_contiguous(),
              "silu_table must be float32 [65536]: SiLU of every bfloat16 bit pattern");
  TORCH_CHECK(vector_step >= 1, "vector_step must be at least 1");
  const auto x = gate_up.contiguous();
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  auto out = torch::empty({rows, n}, x.options());
  silu_mul_table_rows(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), silu_table.data_ptr<float>(), rows,
                      n, vector_step);
  return out;
}

namespace {

// ---------------------------------------------------------------------------------------------------------------
// RoPE and the cache write. transformers: q * cos + rotate_half(q) * sin, each product and the sum rounded to
// the dtype, where rotate_half(q) = cat(-q[half:], q[:half]).

template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, T* out, int64_t dim) {
  const int64_t half = dim / 2;
#if defined(__AVX512F__) || defined(__AVX2__)
  if (half % kLanes == 0) {  // a vector of each half at a time (scalar: 225 us for 512 tokens of 12 heads)
    const lanes::Vec minus = lanes::set1(-1.0f);  // an exact negation, the sign of zero included
    for (int64_t i = 0; i < half; i += kLanes) {
      const lanes::Vec low = lanes::load(x + i), high = lanes::load(x + i + half);
      const lanes::Vec low_cos = lanes::round_as(lanes::mul(low, lanes::load(cos + i)), T{});
      const lanes::Vec high_sin = lanes::round_as(lanes::mul(lanes::mul(high, minus), lanes::load(sin + i)), T{});
      lanes::store(out + i, lanes::add(low_cos, high_sin));
      const lanes::Vec high_cos = lanes::round_as(lanes::mul(high, lanes::load(cos + i + half)), T{});
      const lanes::Vec low_sin = lanes::round_as(lanes::mul(low, lanes::load(sin + i + half)), T{});
      lanes::store(out + i + half, lanes::add(high_cos, low_sin));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < dim; ++i) {
    const float other = i < half ? -widen(x[i + half]) : widen(x[i - half]);
    out[i] = narrow<T>(round_as<T>(widen(x[i]) * widen(cos[i])) + round_as<T>(other * widen(sin[i])));
  }
}

template <typename T>
void rope_write_rows(const T* qkv, const T* cos, const T* sin, const int64_t* slots, T* query, T* key_cache,
                     T* value_cache, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                     int64_t cache_slots) {
  const int64_t width = (heads + 2 * kv_heads) * dim;
  at::parallel_for(0, tokens, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * width;
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) rotate(row + h * dim, c, s, query + (t * heads + h) * dim, dim);
      const T* keys = row + heads * dim;
      const T* values = keys + kv_heads * dim;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t at = (h * cache_slots + slots[t]) * dim;
        rotate(keys + h * dim, c, s, key_cache + at, dim);
        std::copy(values + h * dim, values + (h + 1) * dim, value_cache + at);
      }
    }
  });
}

}  // namespace

torch::Tensor rope_write_cache(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                               torch::Tensor key_cache, torch::Tensor value_cache, const torch::Tensor& slot_mapping,
                               int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && float_or_bf16(qkv) && qkv.dim() == 2, "qkv must be [tokens, width] on the CPU");
  TORCH_CHECK(heads >= 1 && kv_heads >= 1, "head counts must be positive");
  const auto type = qkv.scalar_type();
  TORCH_CHECK(key_cache.dim() == 3 && value_cache.sizes() == key_cache.sizes() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && key_cache.scalar_type() == type &&
                  value_cache.scalar_type() == type,
              "caches must be contiguous [kv_heads, slots, dim] in qkv's dtype");
  const int64_t tokens = qkv.size(0), dim = key_cache.size(2), cache_slots = key_cache.size(1);
  TORCH_CHECK(key_cache.size(0) == kv_heads && dim % 2 == 0, "the cache's kv_heads and an even head_dim expected");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim, "qkv width must be (heads + 2 kv_heads) * head_dim");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == tokens && cos.size(1) == dim &&
                  cos.scalar_type() == type && sin.scalar_type() == type,
              "cos and sin must be [tokens, head_dim] in qkv's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens,
              "slot_mapping must be [tokens] int64");
  const auto x = qkv.contiguous();
  const auto c = cos.contiguous();
  const auto s = sin.contiguous();
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {  // checked here so that the parallel loop throws nothing
    TORCH_CHECK(slot_ptr[t] >= 0 && slot_ptr[t] < cache_slots, "slot_mapping points outside the cache");
  }
  auto query = torch::empty({tokens, heads, dim}, x.options());
  if (type == torch::kFloat) {
    rope_write_rows<float>(x.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), slot_ptr,
                           query.data_ptr<float>(), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(), tokens,
                           heads, kv_heads, dim, cache_slots);
  } else {
    using B = c10::BFloat16;
    rope_write_rows<B>(x.data_ptr<B>(), c.data_ptr<B>(), s.data_ptr<B>(), slot_ptr, query.data_ptr<B>(),
                       key_cache.data_ptr<B>(), value_cache.data_ptr<B>(), tokens, heads, kv_heads, dim, cache_slots);
  }
  return query;
}

}  // namespace BATCHSERVE_OPS
