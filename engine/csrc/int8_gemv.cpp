// int8_gemv: x [rows, K] (float32 or bfloat16) times W [N, K] int8 with one scale per output row, as
// aten._weight_int8pack_mm; [rows, N] in x's dtype. The int8 LM head at small batch: each weight byte is read once
// for up to kMaxRows activation rows, converted to float32 in registers and accumulated in float32, in another
// order than torch's kernel (so results agree with it to rounding, not bit for bit).
//
// The vector builds run one kernel on the build's float lanes (vector_lanes.h: 16 with AVX-512, 8 with AVX2); the
// scalar build runs plain loops. torch's own kernel is no fallback there: it has crashed on widths that are not a
// multiple of 16 (torch 2.13).

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>

#include "ops.h"
#include "quant.h"
#include "scalar.h"
#include "vector_lanes.h"

namespace BATCHSERVE_OPS {
namespace {

using batchserve::widen;

#if defined(__AVX512F__) || defined(__AVX2__)
namespace lanes = batchserve::lanes;

constexpr int64_t kMaxRows = 8;  // activation rows per pass over the weights
constexpr int64_t kPrefetchRows = 8;  // weight rows requested ahead of use
constexpr int64_t kInt8Tile = 128;  // weight rows per tile (72 KB at K = 576: stays in L2 across passes)
// Independent FMA chains per activation row in int8_row: with one sum per row, each FMA waits for the previous
// one's latency (4-5 cycles), which at one or two rows left the int8 LM head latency-bound, not load-bound.
constexpr int kInt8Chains = 4;
constexpr int int8_chains(int rows) { return rows >= kInt8Chains ? 1 : kInt8Chains / rows; }

template <int R>
inline void int8_row(const int8_t* w, const float* x, int64_t K, float* dots /* [R] */) {
  constexpr int64_t kW = lanes::kWidth;
  // C independent sums per row (see kInt8Chains).
  constexpr int C = int8_chains(R);
  lanes::Vec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = lanes::zero();
  int64_t k = 0;
  for (; k + kW * C <= K; k += kW * C) {
    for (int c = 0; c < C; ++c) {
      const lanes::Vec wk = lanes::load_int8(w + k + kW * c);
      for (int r = 0; r < R; ++r) acc[r][c] = lanes::fma(wk, lanes::load(x + r * K + k + kW * c), acc[r][c]);
    }
  }
  for (; k + kW <= K; k += kW) {
    const lanes::Vec wk = lanes::load_int8(w + k);
    for (int r = 0; r < R; ++r) acc[r][0] = lanes::fma(wk, lanes::load(x + r * K + k), acc[r][0]);
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 1; c < C; ++c) acc[r][0] = lanes::add(acc[r][0], acc[r][c]);
    float sum = lanes::sum(acc[r][0]);
    for (int64_t t = k; t < K; ++t) sum += static_cast<float>(w[t]) * x[r * K + t];
    dots[r] = sum;
  }
}

template <typename S>
void int8_rows(const float* x, const int8_t* values, const S* scales, float* y, int64_t rows, int64_t K, int64_t N) {
  at::parallel_for(0, N, kInt8Tile, [&](int64_t begin, int64_t end) {
    float dots[kMaxRows];
    // Tiles of weight rows, each read from memory once and then from L2 by every pass of kMaxRows activation rows.
    // Passes outside the tile would re-read all activation rows (73 KB at 32 rows: past L1) for every weight row.
    for (int64_t tile = begin; tile < end; tile += kInt8Tile) {
      const int64_t tile_end = std::min(tile + kInt8Tile, end);
      for (int64_t first = 0; first < rows; first += kMaxRows) {
        const int64_t count = std::min(kMaxRows, rows - first);
        const float* xs = x + first * K;
        for (int64_t n = tile; n < tile_end; ++n) {
          if (first == 0) {
            // One core alone does not keep enough loads in flight to use its share of the memory bandwidth.
            const char* ahead = reinterpret_cast<const char*>(values + std::min(n + kPrefetchRows, N - 1) * K);
            for (int64_t line = 0; line < K; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
          }
          with_row_count<kMaxRows>(count, [&](auto R) { int8_row<decltype(R)::value>(values + n * K, xs, K, dots); });
          const float scale = widen(scales[n]);
          for (int64_t r = 0; r < count; ++r) y[(first + r) * N + n] = dots[r] * scale;
        }
      }
    }
  });
}

#else  // the scalar build

template <typename S>
void int8_rows(const float* x, const int8_t* values, const S* scales, float* y, int64_t rows, int64_t K, int64_t N) {
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* w = values + n * K;
      const float scale = widen(scales[n]);
      for (int64_t r = 0; r < rows; ++r) {
        float sum = 0;
        for (int64_t k = 0; k < K; ++k) sum += static_cast<float>(w[k]) * x[r * K + k];
        y[r * N + n] = sum * scale;
      }
    }
  });
}

#endif

}  // namespace

torch::Tensor int8_gemv(const torch::Tensor& x, const torch::Tensor& values, const torch::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && float_or_bf16(x), "x must be [rows, K] float32 or bfloat16");
  TORCH_CHECK(values.scalar_type() == torch::kChar && values.dim() == 2 && values.size(1) == x.size(1),
              "values must be [N, K] int8");
  TORCH_CHECK(scales.scalar_type() == x.scalar_type() && scales.dim() == 1 && scales.size(0) == values.size(0),
              "scales must be [N] in x's dtype");
  const int64_t rows = x.size(0), K = x.size(1), N = values.size(0);
  const auto xf = x.to(torch::kFloat).contiguous();
  const auto w = values.contiguous();
  const auto s = scales.contiguous();
  // The outputs are float32, rounded to bfloat16 once at the end where x is bfloat16: the bits of rounding each
  // output in the kernel, and faster than storing them one by one (a [32, 576] x [49152, 576] head: 10.6 against
  // 9.7 ms, AVX2).
  auto y = torch::empty({rows, N}, x.options().dtype(torch::kFloat));
  if (x.scalar_type() == torch::kBFloat16) {
    int8_rows(xf.data_ptr<float>(), w.data_ptr<int8_t>(), s.data_ptr<c10::BFloat16>(), y.data_ptr<float>(), rows, K, N);
    return y.to(torch::kBFloat16);
  }
  int8_rows(xf.data_ptr<float>(), w.data_ptr<int8_t>(), s.data_ptr<float>(), y.data_ptr<float>(), rows, K, N);
  return y;
}

}  // namespace BATCHSERVE_OPS
