// Prompt-chunk attention straight from the paged KV cache (bfloat16): each row's chunk of queries attends causally
// to its keys 0..start + i, read in place through the row's block table.
//
// torch's CPU flash attention (the SDPA the engine ran before) widens bf16 to float32 and computes whole 512-key
// blocks up to the diagonal; here the products are bf16 pairs into float32 (`vdpbf16ps`), the softmax is online
// in float32, and work stops at the diagonal a tile of 16 queries by a few keys at a time. Only the avx512_bf16
// build has the kernel (paged_prefill_attention_avx512_bf16.h); the others report it unavailable and the engine
// keeps SDPA there.
//
// Work: blocks of 16 query positions of one row, for a pass of up to 4 query heads sharing one KV head. Blocks
// cost their keys (the diagonal makes them unequal), and the threads take them from a shared counter, costliest
// first: a fixed split (at::parallel_for's) left one thread waiting whenever the other was descheduled, which on
// 2 cores shared with other work cost up to 4x a call (interleaved runs). Before them, each (row, KV head)'s values are laid out once as pairs of keys per
// dimension (the kernel's second operand), and each row's key slots are looked up once.

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "ops.h"
#include "scalar.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "paged_prefill_attention_avx512_bf16.h"
#define BATCHSERVE_PREFILL_KERNEL 1
#endif

namespace BATCHSERVE_OPS {

bool prefill_attention_available() {
#ifdef BATCHSERVE_PREFILL_KERNEL
  return true;
#else
  return false;
#endif
}

#ifdef BATCHSERVE_PREFILL_KERNEL
namespace {

namespace pf = batchserve::prefill;

struct Rows {
  const int64_t* token_start;
  const int64_t* counts;
  const int64_t* context;
  std::vector<int64_t> slot_offset;   // per row: where its key slots start in `slots`
  std::vector<int64_t> value_offset;  // per row: where its (KV head 0) value pairs start, in 32-bit units
  int64_t value_pairs_total = 0;      // 32-bit units a KV head's value pairs take, all rows
};

struct Block {
  int64_t row, kv_head, pass, first_query;  // first_query: the block's offset in the row's chunk
  int64_t keys;                             // keys its last query sees: its cost
};

// values[h][pair][d] = (value[2 pair][d], value[2 pair + 1][d]) as 32 bits, the odd key past the end 0.
void lay_out_values(const uint16_t* cache, int64_t slots_per_head, int64_t dim, const std::vector<int32_t>& slots,
                    const Rows& rows, int64_t num_rows, int64_t kv_heads, uint32_t* out) {
  at::parallel_for(0, num_rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t r = unit / kv_heads, h = unit % kv_heads, context = rows.context[r];
      const uint16_t* head = cache + h * slots_per_head * dim;
      const int32_t* slot = slots.data() + rows.slot_offset[r];
      uint32_t* dst = out + h * rows.value_pairs_total + rows.value_offset[r];
      for (int64_t pair = 0; pair < (context + 1) / 2; ++pair, dst += dim) {
        const uint16_t* a = head + int64_t{slot[2 * pair]} * dim;
        const uint16_t* b = 2 * pair + 1 < context ? head + int64_t{slot[2 * pair + 1]} * dim : nullptr;
        for (int64_t d = 0; d < dim; ++d) dst[d] = a[d] | (b ? uint32_t{b[d]} << 16 : 0u);
      }
    }
  });
}

template <int D, int HP>
void run_blocks(const std::vector<Block>& blocks, const uint16_t* query, const uint16_t* key_cache,
                const std::vector<int32_t>& slots, const uint32_t* values, const Rows& rows, int64_t heads,
                int64_t kv_heads, int64_t slots_per_head, float c, uint16_t* out) {
  const int64_t group = heads / kv_heads, count = static_cast<int64_t>(blocks.size());
  const int64_t threads = std::min<int64_t>(std::max(1, at::get_num_threads()), count);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto scratch = std::make_unique<pf::Scratch<D, HP>>();
    alignas(64) uint32_t qp[HP * (D / 2) * pf::kLanes];
    for (int64_t b = next.fetch_add(1, std::memory_order_relaxed); b < count;
         b = next.fetch_add(1, std::memory_order_relaxed)) {
      const Block& blk = blocks[b];
      const int64_t count = rows.counts[blk.row], start = rows.context[blk.row] - count;
      const int64_t n = std::min<int64_t>(pf::kLanes, count - blk.first_query);
      const int64_t first_head = blk.kv_head * group + blk.pass * HP;
      alignas(64) int32_t position[pf::kLanes];
      for (int i = 0; i < pf::kLanes; ++i) {
        const int64_t q = blk.first_query + std::min<int64_t>(i, n - 1);  // padding lanes repeat the last query
        position[i] = static_cast<int32_t>(start + q);
        const uint32_t* src =
            reinterpret_cast<const uint32_t*>(query + ((rows.token_start[blk.row] + q) * heads + first_head) * D);
        for (int h = 0; h < HP; ++h)
          for (int p = 0; p < D / 2; ++p) qp[(h * (D / 2) + p) * pf::kLanes + i] = src[h * (D / 2) + p];
      }
      pf::attend_block<D, HP>(qp, _mm512_load_si512(position), start + blk.first_query, start + blk.first_query + n,
                              reinterpret_cast<const uint32_t*>(key_cache + blk.kv_head * slots_per_head * D),
                              slots.data() + rows.slot_offset[blk.row],
                              values + blk.kv_head * rows.value_pairs_total + rows.value_offset[blk.row], c, *scratch);
      for (int64_t i = 0; i < n; ++i) {
        uint16_t* dst = out + ((rows.token_start[blk.row] + blk.first_query + i) * heads + first_head) * D;
        for (int h = 0; h < HP; ++h)
          for (int d = 0; d < D; ++d)
            dst[h * D + d] = batchserve::narrow<c10::BFloat16>(scratch->out[h][d][i]).x;
      }
    }
  });
}

template <int D>
void dispatch_heads(int64_t per_pass, const std::vector<Block>& blocks, const uint16_t* query, const uint16_t* key_cache, const std::vector<int32_t>& slots,
                    const uint32_t* values, const Rows& rows, int64_t heads, int64_t kv_heads, int64_t slots_per_head,
                    float c, uint16_t* out) {
#define BATCHSERVE_RUN(HP) \
  run_blocks<D, HP>(blocks, query, key_cache, slots, values, rows, heads, kv_heads, slots_per_head, c, out)
  switch (per_pass) {
    case 4: BATCHSERVE_RUN(4); break;
    case 3: BATCHSERVE_RUN(3); break;
    case 2: BATCHSERVE_RUN(2); break;
    default: BATCHSERVE_RUN(1); break;
  }
#undef BATCHSERVE_RUN
}

}  // namespace
#endif

torch::Tensor paged_prefill_attention(
    const torch::Tensor& query,         // [tokens, heads, dim] bf16: each row's chunk, packed
    const torch::Tensor& key_cache,     // [kv_heads, slots, dim] bf16
    const torch::Tensor& value_cache,   // [kv_heads, slots, dim] bf16
    const torch::Tensor& block_table,   // [rows, max_blocks] int64
    const torch::Tensor& token_start,   // [rows] int64: each row's first query in `query`
    const torch::Tensor& counts,        // [rows] int64: each row's queries
    const torch::Tensor& context_lens,  // [rows] int64: keys each row has once its chunk is written
    int64_t block_size, double scale) {
#ifndef BATCHSERVE_PREFILL_KERNEL
  TORCH_CHECK(false, "paged_prefill_attention is only in the avx512_bf16 build");
#else
  const auto bf16 = torch::kBFloat16;
  TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == bf16 && key_cache.scalar_type() == bf16 &&
                  value_cache.scalar_type() == bf16,
              "paged_prefill_attention: query and caches must be bfloat16 on the CPU");
  for (const auto* t : {&block_table, &token_start, &counts, &context_lens})
    TORCH_CHECK(t->scalar_type() == torch::kLong, "paged_prefill_attention: block_table and row facts must be int64");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 3 && value_cache.sizes() == key_cache.sizes(),
              "paged_prefill_attention: query [tokens, heads, dim] and caches [kv_heads, slots, dim] expected");
  const auto q = query.contiguous(), k = key_cache.contiguous(), v = value_cache.contiguous();
  const auto table = block_table.contiguous(), starts = token_start.contiguous(), count_t = counts.contiguous(),
             lens = context_lens.contiguous();
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(0), slots = k.size(1);
  TORCH_CHECK(dim == 64 || dim == 128, "paged_prefill_attention: head size must be 64 or 128");
  TORCH_CHECK(kv_heads >= 1 && k.size(2) == dim && heads % kv_heads == 0, "paged_prefill_attention: head sizes");
  TORCH_CHECK(block_size >= 1 && slots % block_size == 0, "paged_prefill_attention: the cache must hold whole blocks");
  const int64_t num_rows = table.size(0), max_blocks = table.size(1), num_blocks = slots / block_size;
  TORCH_CHECK(starts.size(0) == num_rows && count_t.size(0) == num_rows && lens.size(0) == num_rows,
              "paged_prefill_attention: one token start, count and context length per row");
  TORCH_CHECK(slots < (int64_t{1} << 31), "paged_prefill_attention: too many cache slots");
  Rows rows{starts.data_ptr<int64_t>(), count_t.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), {}, {}, 0};
  const int64_t* table_ptr = table.data_ptr<int64_t>();
  // Validate all the parallel loops read, and look each key's slot up once.
  std::vector<int32_t> key_slots;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t count = rows.counts[r], context = rows.context[r];
    TORCH_CHECK(count >= 1 && context >= count && context <= max_blocks * block_size,
                "paged_prefill_attention: a row's query count or context length is out of range");
    TORCH_CHECK(rows.token_start[r] >= 0 && rows.token_start[r] + count <= tokens,
                "paged_prefill_attention: a row's queries lie outside the query tensor");
    rows.slot_offset.push_back(static_cast<int64_t>(key_slots.size()));
    rows.value_offset.push_back(rows.value_pairs_total);
    rows.value_pairs_total += (context + 1) / 2 * dim;
    for (int64_t b = 0; b < (context + block_size - 1) / block_size; ++b) {
      const int64_t block = table_ptr[r * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_prefill_attention: block table points outside the cache");
      for (int64_t i = 0; i < block_size && b * block_size + i < context; ++i)
        key_slots.push_back(static_cast<int32_t>(block * block_size + i));
    }
  }
  const int64_t group = heads / kv_heads;
  const int64_t per_pass = group % 4 == 0 ? 4 : group % 3 == 0 ? 3 : group % 2 == 0 ? 2 : 1;
  std::vector<Block> blocks;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t start = rows.context[r] - rows.counts[r];
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t pass = 0; pass < group / per_pass; ++pass)
        for (int64_t first = 0; first < rows.counts[r]; first += batchserve::prefill::kLanes) {
          blocks.push_back({r, h, pass, first, start + std::min(rows.counts[r], first + batchserve::prefill::kLanes)});
        }
  }
  std::stable_sort(blocks.begin(), blocks.end(), [](const Block& a, const Block& b) { return a.keys > b.keys; });
  auto value_pairs = torch::empty({kv_heads * rows.value_pairs_total}, torch::dtype(torch::kInt));
  auto* values = reinterpret_cast<uint32_t*>(value_pairs.data_ptr<int32_t>());
  const auto* v_ptr = reinterpret_cast<const uint16_t*>(v.data_ptr<c10::BFloat16>());
  lay_out_values(v_ptr, slots, dim, key_slots, rows, num_rows, kv_heads, values);
  auto out = torch::empty_like(q);
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  const auto* k_ptr = reinterpret_cast<const uint16_t*>(k.data_ptr<c10::BFloat16>());
  auto* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const float c = static_cast<float>(scale * M_LOG2E);
  if (dim == 64) {
    dispatch_heads<64>(per_pass, blocks, q_ptr, k_ptr, key_slots, values, rows, heads, kv_heads, slots, c,
                       out_ptr);
  } else {
    dispatch_heads<128>(per_pass, blocks, q_ptr, k_ptr, key_slots, values, rows, heads, kv_heads, slots, c,
                        out_ptr);
  }
  return out;
#endif
}

}  // namespace BATCHSERVE_OPS
