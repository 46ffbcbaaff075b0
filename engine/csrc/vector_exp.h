// exp over float32 lanes with the routine torch itself calls at the build's instruction set: SLEEF's 1-ulp
// vectorised exp (libtorch_cpu exports the AVX-512 and AVX2 forms), std::exp in the builds that have neither.
// Each lane is computed on its own, so a value's exp does not depend on its neighbours or its position.

#pragma once

#include <cmath>
#include <cstdint>

#include "vector_lanes.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
extern "C" __m512 Sleef_expf16_u10(__m512);
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

namespace batchserve {

#if defined(__AVX512F__) || defined(__AVX2__)
namespace lanes {
// exp of each lane of a vector_lanes.h vector.
#if defined(__AVX512F__)
inline Vec exp(Vec v) { return Sleef_expf16_u10(v); }
#else
inline Vec exp(Vec v) { return Sleef_expf8_u10(v); }
#endif
}  // namespace lanes
#endif

// x[i] = exp(x[i]) for i < n.
inline void exp_in_place(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, Sleef_expf16_u10(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(x + i, tail, Sleef_expf16_u10(_mm512_maskz_loadu_ps(tail, x + i)));
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, Sleef_expf8_u10(_mm256_loadu_ps(x + i)));
  if (i < n) {
    float lanes[8] = {0};
    for (int64_t j = i; j < n; ++j) lanes[j - i] = x[j];
    _mm256_storeu_ps(lanes, Sleef_expf8_u10(_mm256_loadu_ps(lanes)));
    for (int64_t j = i; j < n; ++j) x[j] = lanes[j - i];
  }
#else
  for (; i < n; ++i) x[i] = std::exp(x[i]);
#endif
}

}  // namespace batchserve
