// int4_gemv's kernel in the scalar build: plain loops over the same layout (the compiler vectorises what SSE2
// allows). torch's own kernel is no fallback here: its int4 packing depends on torch's capability.
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "quant.h"
#include "scalar.h"

namespace BATCHSERVE_OPS {
namespace {

using batchserve::widen;

template <typename T, typename S>
void int4_rows(const float* x, const float* group_sums, const uint8_t* packed, const S* scales_and_zeros, T* y,
               int64_t rows, int64_t K, int64_t N, int64_t group) {
  const int64_t groups = K / group;
  at::parallel_for(0, N / kBlockN, 1, [&](int64_t begin, int64_t end) {
    float acc[kBlockN], total[kBlockN];
    for (int64_t block = begin; block < end; ++block) {
      for (int64_t r = 0; r < rows; ++r) {
        std::fill(total, total + kBlockN, 0.0f);
        for (int64_t g = 0; g < groups; ++g) {
          std::fill(acc, acc + kBlockN, 0.0f);
          const uint8_t* bytes = packed + (block * K + g * group) * (kBlockN / 2);
          for (int64_t k = 0; k < group; ++k, bytes += kBlockN / 2) {
            const float xk = x[r * K + g * group + k];
            for (int64_t j = 0; j < kBlockN / 2; ++j) {
              acc[j] += static_cast<float>((bytes[j] & 0x0F) - 8) * xk;
              acc[j + kBlockN / 2] += static_cast<float>((bytes[j] >> 4) - 8) * xk;
            }
          }
          const S* pairs = scales_and_zeros + (g * N + block * kBlockN) * 2;
          const float sum = group_sums[r * groups + g];
          for (int64_t j = 0; j < kBlockN; ++j) total[j] += widen(pairs[2 * j]) * acc[j] + widen(pairs[2 * j + 1]) * sum;
        }
        for (int64_t j = 0; j < kBlockN; ++j) y[r * N + block * kBlockN + j] = batchserve::narrow<T>(total[j]);
      }
    }
  });
}

}  // namespace
}  // namespace BATCHSERVE_OPS
