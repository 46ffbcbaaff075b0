// Reductions over rows of logits, one pass each while the row sits in the core's cache: greedy sampling's argmax,
// and prompt scoring (also the sampler's chosen-token and top-k logprobs, engine/fused.py).
//
//   argmax_rows:   [rows, vocab] -> [rows] the first index of each row's maximum, as torch.argmax
//   prompt_scores: each row reduced to one target token's logprob and rank and the k best alternatives.
//                  In torch this is log_softmax (which writes a second [rows, vocab] tensor), a comparison that
//                  writes a bool tensor, its sum and a top-k: five passes over 49k-float rows plus two large
//                  allocations per slice. Here each row is read in vectorised passes: max and count of higher
//                  logits, the sum of exponentials, and (when alternatives are asked for) a top-k scan that looks
//                  closely only at blocks that can hold a winner.

// The exponential's clamp below is a compare and select; GCC vectorises it with AVX2 only when it may assume that
// floating-point exceptions are not observed (AVX-512 masks the lanes instead): without this the AVX2 build summed
// the exponentials one at a time, 5x the AVX-512 build's time for a row. No operation rounds differently, but
// those builds now sum a block in vector lanes as the AVX-512 one did, so a logprob may move by an ulp or so.
#if defined(__clang__)
#pragma clang fp exceptions(ignore)
#elif defined(__GNUC__)
#pragma GCC optimize("no-trapping-math")
#endif

#include <ATen/Parallel.h>
#include <torch/types.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

namespace BATCHSERVE_OPS {
namespace {

constexpr int64_t kSumBlock = 512;  // terms summed in float before the running total (double) takes them
constexpr int64_t kScanBlock = 256;  // elements per block of the top-k scan

// e^x for x <= 0 in plain arithmetic the compiler vectorises (std::exp, std::floor and float-to-int casts left
// this loop scalar, 7x slower): x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error < 1e-7), 2^n through the exponent bits. Adding 1.5 * 2^23 rounds x log2(e) to the integer n and
// leaves n in the sum's low mantissa bits. Below -87 the result would leave float's normal range; e^-87 is
// 1.6e-38, nothing next to the row's largest term, which is 1.
inline float exp_nonpositive(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  constexpr int32_t kRoundBits = 0x4B400000;
  x = x < -87.0f ? -87.0f : x;
  const float shifted = x * 1.44269504088896341f + kRound;
  const float n = shifted - kRound;
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  // ln 2 in two parts
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  bits = (bits - kRoundBits + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Inserts (value, id) into the descending list of the k best so far if it beats the last; ties keep the earlier id.
inline void offer(float value, int64_t id, float* best, int64_t* best_ids, int64_t k) {
  if (!(value > best[k - 1]) && best_ids[k - 1] >= 0) return;
  int64_t at = k - 1;
  while (at > 0 && (value > best[at - 1] || best_ids[at - 1] < 0)) {
    best[at] = best[at - 1];
    best_ids[at] = best_ids[at - 1];
    --at;
  }
  best[at] = value;
  best_ids[at] = id;
}

void score_row(const float* x, int64_t vocab, int64_t target, int64_t k, float* logprob, int64_t* rank,
               float* top_values, int64_t* top_ids) {
  const float chosen = x[target];
  float row_max = -std::numeric_limits<float>::infinity();
  int32_t higher = 0;  // int32: an int64 count kept this loop 7x slower, and no vocabulary has 2^31 entries
#pragma omp simd reduction(max : row_max) reduction(+ : higher)
  for (int64_t i = 0; i < vocab; ++i) {
    row_max = row_max > x[i] ? row_max : x[i];
    higher += x[i] > chosen;
  }
  // Float sums over short blocks, added up in double: one float sum over 49k terms drifts by ~1e-4 relative.
  double total = 0;
  for (int64_t start = 0; start < vocab; start += kSumBlock) {
    const int64_t stop = std::min(start + kSumBlock, vocab);
    float block = 0;
#pragma omp simd reduction(+ : block)
    for (int64_t i = start; i < stop; ++i) block += exp_nonpositive(x[i] - row_max);
    total += block;
  }
  // Shift by the maximum first: next to logits near float32's maximum, row_max + log(total) would round log(total)
  // away.
  const float log_total = static_cast<float>(std::log(total));
  *logprob = (chosen - row_max) - log_total;
  *rank = higher + 1;
  if (k == 0) return;

  // Top k: once the list is full, a block is looked at element by element only if one of its elements beats the
  // current k-th best (a vectorised count); in a row of 49k logits that is a handful of blocks.
  std::fill(top_values, top_values + k, -std::numeric_limits<float>::infinity());
  std::fill(top_ids, top_ids + k, int64_t{-1});
  for (int64_t start = 0; start < vocab; start += kScanBlock) {
    const int64_t stop = std::min(start + kScanBlock, vocab);
    if (top_ids[k - 1] >= 0) {
      const float bar = top_values[k - 1];
      int32_t above = 0;
#pragma omp simd reduction(+ : above)
      for (int64_t i = start; i < stop; ++i) above += x[i] > bar;
      if (above == 0) continue;
    }
    for (int64_t i = start; i < stop; ++i) offer(x[i], i, top_values, top_ids, k);
  }
  for (int64_t j = 0; j < k; ++j) top_values[j] = (top_values[j] - row_max) - log_total;
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> prompt_scores(
    const torch::Tensor& logits,  // [rows, vocab] float32
    const torch::Tensor& target,  // [rows] int64: the token each row scores
    int64_t k) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat && logits.dim() == 2,
              "logits must be [rows, vocab] float32 on the CPU");
  TORCH_CHECK(target.scalar_type() == torch::kLong && target.dim() == 1 && target.size(0) == logits.size(0),
              "target must be [rows] int64");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(k >= 0 && k <= vocab, "k must be between 0 and the vocabulary size");
  const auto x = logits.contiguous();
  const auto t = target.contiguous();
  const int64_t* t_ptr = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {  // checked here so that the parallel loop throws nothing
    TORCH_CHECK(t_ptr[r] >= 0 && t_ptr[r] < vocab, "target token id outside the vocabulary");
  }
  auto logprobs = torch::empty({rows}, x.options());
  auto ranks = torch::empty({rows}, t.options());
  auto top_values = torch::empty({rows, k}, x.options());
  auto top_ids = torch::empty({rows, k}, t.options());
  const float* x_ptr = x.data_ptr<float>();
  float* lp_ptr = logprobs.data_ptr<float>();
  int64_t* rank_ptr = ranks.data_ptr<int64_t>();
  float* tv_ptr = top_values.data_ptr<float>();
  int64_t* ti_ptr = top_ids.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      score_row(x_ptr + r * vocab, vocab, t_ptr[r], k, lp_ptr + r, rank_ptr + r, tv_ptr + r * k, ti_ptr + r * k);
    }
  });
  return {logprobs, ranks, top_ids, top_values};
}

namespace {

// Rows per task so that a task has at least ~16k elements: smaller batches run on the calling thread.
int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elements)); }

// ---------------------------------------------------------------------------------------------------------------
// Greedy argmax: blocks of the row are reduced to their maximum in vector lanes, and only a block that beats the
// best so far is searched for its first maximal index, so the row is read once. Ties go to the lowest index, as
// torch.argmax's do. Rows must hold no NaN (the sampler's callers guarantee it). It only compares, so the pragma
// above (for prompt_scores' exponentials) changes none of its results.

constexpr int64_t kArgmaxBlock = 64;

int64_t argmax_row(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_index = 0;
  for (int64_t start = 0; start < n; start += kArgmaxBlock) {
    const int64_t stop = std::min(start + kArgmaxBlock, n);
    float block = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : block)
    for (int64_t i = start; i < stop; ++i) block = block > x[i] ? block : x[i];
    if (block > best) {
      best = block;
      for (int64_t i = start; i < stop; ++i) {
        if (x[i] == block) {
          best_index = i;
          break;
        }
      }
    }
  }
  return best_index;
}

}  // namespace

torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat && logits.dim() == 2 &&
                  logits.size(1) >= 1,
              "logits must be [rows, vocab] float32 on the CPU");
  const auto x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  const float* x_ptr = x.data_ptr<float>();
  int64_t* out_ptr = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out_ptr[r] = argmax_row(x_ptr + r * n, n);
  });
  return out;
}

}  // namespace BATCHSERVE_OPS
