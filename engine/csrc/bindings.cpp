// Every op of a build, registered with torch in one place: its schema (the types Python sees) in TORCH_LIBRARY,
// and its CPU kernel (declared in ops.h, which names the file that defines it) in TORCH_LIBRARY_IMPL, so that the
// dispatcher routes only CPU tensors to it. The library's name is the build's namespace, BATCHSERVE_OPS.

#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(BATCHSERVE_OPS, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
      "Tensor context_lens, int block_size, float scale) -> Tensor");
  m.def(
      "paged_prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
      "Tensor token_start, Tensor counts, Tensor context_lens, int block_size, float scale) -> Tensor");
  m.def("prefill_attention_available() -> bool", &BATCHSERVE_OPS::prefill_attention_available);
  m.def("add_rms_norm(Tensor(a!) residual, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("silu_mul_table(Tensor gate_up, Tensor silu_table, int vector_step) -> Tensor");
  m.def(
      "rope_write_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, int heads, int kv_heads) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("prompt_scores(Tensor logits, Tensor target, int k) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("int4_gemv(Tensor x, Tensor packed, int group, Tensor scales_and_zeros) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor values, Tensor scales) -> Tensor");
  m.def("int4_dot(Tensor x, Tensor packed, int group, Tensor scales, Tensor zeros) -> Tensor");
  m.def("int8_dot(Tensor x, Tensor packed, int group, Tensor scales, bool one_digit=False) -> Tensor");
  m.def("int6_dot(Tensor x, Tensor packed, Tensor sub_scales, Tensor super_scales, bool one_digit=False) -> Tensor");
  m.def("int4_gemm(Tensor x, Tensor packed, int group, Tensor scales, Tensor zeros) -> Tensor");
  // No tensor arguments, so no dispatch key: registered with its function (a CPU kernel would never be chosen).
  m.def("int4_dot_available() -> bool", &BATCHSERVE_OPS::int4_dot_available);
  m.def("int8_dot_available() -> bool", &BATCHSERVE_OPS::int8_dot_available);
  m.def("int6_dot_available() -> bool", &BATCHSERVE_OPS::int6_dot_available);
  m.def(
      "decode_layers(Tensor(a!) x, Tensor(b!) cache, Tensor[] layers, Tensor cos, Tensor sin, Tensor slot_mapping, "
      "Tensor block_table, Tensor context_lens, int heads, int kv_heads, int block_size, float scale, "
      "float eps, bool fused_silu, bool one_digit) -> ()");
}

TORCH_LIBRARY_IMPL(BATCHSERVE_OPS, CPU, m) {
  m.impl("paged_decode_attention", &BATCHSERVE_OPS::paged_decode_attention);
  m.impl("paged_prefill_attention", &BATCHSERVE_OPS::paged_prefill_attention);
  m.impl("add_rms_norm", &BATCHSERVE_OPS::add_rms_norm);
  m.impl("silu_mul", &BATCHSERVE_OPS::silu_mul);
  m.impl("silu_mul_table", &BATCHSERVE_OPS::silu_mul_table);
  m.impl("rope_write_cache", &BATCHSERVE_OPS::rope_write_cache);
  m.impl("argmax_rows", &BATCHSERVE_OPS::argmax_rows);
  m.impl("prompt_scores", &BATCHSERVE_OPS::prompt_scores);
  m.impl("int4_gemv", &BATCHSERVE_OPS::int4_gemv);
  m.impl("int8_gemv", &BATCHSERVE_OPS::int8_gemv);
  m.impl("int4_dot", &BATCHSERVE_OPS::int4_dot);
  m.impl("int8_dot", &BATCHSERVE_OPS::int8_dot);
  m.impl("int6_dot", &BATCHSERVE_OPS::int6_dot);
  m.impl("int4_gemm", &BATCHSERVE_OPS::int4_gemm);
  m.impl("decode_layers", &BATCHSERVE_OPS::decode_layers);
}
