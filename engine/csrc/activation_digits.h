// Activations as two int8 digits per value, per group of inputs: what the integer-dot kernels (int4_dot.cpp,
// int8_dot.cpp) multiply their weights with. The leading digit is the value in 127ths of its group's largest, the
// second the leading digit's rounding error in 127ths of a unit, so the pair is good to about 1/32000 of the group's
// largest value (one digit cost +1.6 % perplexity on the default model through int4_dot).
//
// Everything here has internal linkage (an unnamed namespace inside the build's own namespace), as in quant.h.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops.h"  // BATCHSERVE_OPS

namespace BATCHSERVE_OPS {
namespace {

// Per row and group: two int8 digits per value, the scale that maps them back, and the exact float sum (for
// int4_dot's zero term); int4_dot_block and int8_dot_block read this layout. x is read in its own dtype (bfloat16
// widens exactly), so a decode step makes no float32 copy of each projection's input.
template <typename T>
[[maybe_unused]] void quantise_activations(const T* x, int64_t rows, int64_t K, int64_t group, int8_t* xq,
                                           float* x_scales, float* x_sums) {
  const int64_t groups = K / group;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const T* v = x + r * K + g * group;
      float top = 0, sum = 0;
      for (int64_t i = 0; i < group; ++i) {
        const float value = static_cast<float>(v[i]);
        top = std::max(top, std::fabs(value));
        sum += value;
      }
      const float scale = top / 127.0f;
      const float inverse = scale > 0 ? 1.0f / scale : 0.0f;
      int8_t* digits = xq + 2 * (r * K + g * group);
      for (int64_t i = 0; i < group; i += 8) {
        for (int64_t j = 0; j < 8; ++j) {
          const float units = static_cast<float>(v[i + j]) * inverse;  // in [-127, 127]
          const float leading = std::nearbyint(units);
          digits[2 * i + j] = static_cast<int8_t>(leading);
          // The rounding error, |units - leading| <= 0.5, in 127ths: within [-64, 64].
          digits[2 * i + 8 + j] = static_cast<int8_t>(std::nearbyint((units - leading) * 127.0f));
        }
      }
      x_scales[r * groups + g] = scale / 127.0f;  // per unit of the combined 127 * leading + residual
      x_sums[r * groups + g] = sum;
    }
  }
}

}  // namespace
}  // namespace BATCHSERVE_OPS
