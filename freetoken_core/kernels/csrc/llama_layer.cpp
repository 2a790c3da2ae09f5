// One Llama block for a step of the native CPU path, in one call: the same kernels, in the
// same order, on the same tensors as DecoderLayer.__call__ runs them from Python (so the
// results are bit-identical), without the ~20 Python-level operator dispatches per layer
// that otherwise cost a step of one sequence about a fifth of its time. (Keys and values
// reach the cache by a plain copy, write_kv, where Python uses index_copy_: the same bytes.)
//
// For the common case only: float32, every linear from GGUF blocks (gguf_linear, or
// gguf_linear_q8 / gguf_linear_int where the type id carries kActivationsQ8 /
// kActivationsInt24), no
// q/k/v bias, no q/k norm, attention of every token through paged_decode_attention. The
// model checks this and uses the Python path otherwise.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"
#include "parallel.h"

namespace {

// A linear's output features (ops.h).
int64_t features(const at::Tensor& blocks, int64_t qtype) {
  return freetoken::linear_out_features(blocks, qtype, "llama_layer");
}

// Each token's key and value into its cache slot. A row of the fused projection is
// [q | k | v], and a slot is [key | value] with the same [KV heads, head_dim] layout, so
// each token is one copy of the row's tail: what index_copy_ of the concatenated keys and
// values stores, without the concatenation and two operator dispatches per layer. A float16
// or bfloat16 cache (--kv-cache-dtype) gets each value rounded to nearest even, as torch's
// conversion rounds it.
template <typename T>
void write_kv_rounded(const float* src, int64_t row, T* dst, int64_t slot_size,
                      const int64_t* slots, int64_t n) {
  freetoken::parallel_rows(n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* from = src + i * row;
      T* to = dst + slots[i] * slot_size;
      for (int64_t e = 0; e < slot_size; ++e) to[e] = T(from[e]);
    }
  });
}

void write_kv(const at::Tensor& qkv_out, int64_t k_offset, at::Tensor& kv_cache,
              const at::Tensor& slot_mapping) {
  const int64_t n = qkv_out.size(0), row = qkv_out.stride(0);
  const int64_t slot_size = kv_cache.stride(0), num_slots = kv_cache.size(0);
  TORCH_CHECK(kv_cache.is_contiguous() &&
              qkv_out.stride(1) == 1 && qkv_out.size(1) - k_offset == slot_size &&
              slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == n,
              "llama_layer: keys and values do not fit the cache");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t bytes = slot_size * kv_cache.element_size();
  const char* src = static_cast<const char*>(qkv_out.data_ptr()) +
                    k_offset * qkv_out.element_size();
  char* dst = static_cast<char*>(kv_cache.data_ptr());
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(0 <= slots[i] && slots[i] < num_slots, "llama_layer: slot out of range");
  if (kv_cache.scalar_type() != qkv_out.scalar_type()) {
    TORCH_CHECK(qkv_out.scalar_type() == at::kFloat, "llama_layer: float32 activations expected");
    const float* from = qkv_out.data_ptr<float>() + k_offset;
    if (kv_cache.scalar_type() == at::kHalf)
      return write_kv_rounded(from, row, kv_cache.data_ptr<c10::Half>(), slot_size, slots, n);
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16,
                "llama_layer: a float32, float16 or bfloat16 KV cache expected");
    return write_kv_rounded(from, row, kv_cache.data_ptr<c10::BFloat16>(), slot_size, slots, n);
  }
  freetoken::parallel_rows(n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      std::memcpy(dst + slots[i] * bytes, src + i * row * qkv_out.element_size(), bytes);
  });
}

// The activations of a step's blocks, allocated once and reused by every block.
struct Scratch {
  at::Tensor x, qkv, attn, y, gate_up, act;
};

Scratch scratch(const at::Tensor& x, int64_t qkv_features, int64_t gate_up_features,
                int64_t num_heads, int64_t head_dim) {
  const int64_t n = x.size(0);
  const auto options = x.options();
  return {at::empty_like(x), at::empty({n, qkv_features}, options),
          at::empty({n, num_heads, head_dim}, options), at::empty_like(x),
          at::empty({n, gate_up_features}, options),
          at::empty({n, gate_up_features / 2}, options)};
}

// One block on the scratch tensors: `residual` (updated in place) carries the hidden state
// and s.x the previous block's output (normed in place), or, with `first`, residual holds
// the embeddings and s.x receives their norm. Writes the block's output into `out` (s.x
// itself when the caller no longer needs it).
void block(bool first, at::Tensor& residual, Scratch& s, const at::Tensor& out,
           const at::Tensor& input_norm,
           const at::Tensor& post_norm, double eps, const at::Tensor& qkv, int64_t qkv_type,
           const at::Tensor& o, int64_t o_type, const at::Tensor& gate_up, int64_t gate_up_type,
           const at::Tensor& down, int64_t down_type, const at::Tensor& cos,
           const at::Tensor& sin, at::Tensor kv_cache, const at::Tensor& slot_mapping,
           const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
           double scale, int64_t h, int64_t kvh, int64_t d) {
  const int64_t n = residual.size(0);
  if (first) {
    freetoken::rms_norm(s.x, residual, input_norm, eps);
  } else {
    freetoken::fused_add_rms_norm(s.x, residual, input_norm, eps);
  }
  freetoken::linear(s.x, qkv, qkv_type, s.qkv);
  // Queries and keys rotated together, in place, then keys and values side by side into
  // their cache slots.
  const at::Tensor qk = s.qkv.narrow(1, 0, (h + kvh) * d).view({n, h + kvh, d});
  freetoken::rotary_embedding(qk, cos, sin);
  write_kv(s.qkv, h * d, kv_cache, slot_mapping);
  freetoken::paged_decode_attention(qk.narrow(1, 0, h), kv_cache, block_tables, context_lens,
                                    block_size, scale, s.attn);
  freetoken::linear(s.attn.view({n, h * d}), o, o_type, s.y);
  freetoken::fused_add_rms_norm(s.y, residual, post_norm, eps);
  freetoken::linear(s.y, gate_up, gate_up_type, s.gate_up);
  freetoken::silu_and_mul(s.act, s.gate_up);
  freetoken::linear(s.act, down, down_type, out);
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "llama_layer: x must be a contiguous float32 [T, hidden] tensor");
}

std::tuple<at::Tensor, at::Tensor> llama_layer(
    at::Tensor x, const std::optional<at::Tensor>& residual_in, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv, int64_t qkv_type,
    const at::Tensor& o, int64_t o_type, const at::Tensor& gate_up, int64_t gate_up_type,
    const at::Tensor& down, int64_t down_type, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens, int64_t block_size, double scale, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim) {
  check_x(x);
  // The first block: its input is the embeddings, and the residual stream.
  at::Tensor residual = residual_in.has_value() ? *residual_in : x;
  Scratch s = scratch(x, features(qkv, qkv_type), features(gate_up, gate_up_type),
                      num_heads, head_dim);
  if (residual_in.has_value()) s.x = x;  // normed in place, as the Python path does
  at::Tensor out = at::empty_like(residual);
  block(!residual_in.has_value(), residual, s, out, input_norm, post_norm, eps, qkv, qkv_type,
        o, o_type, gate_up, gate_up_type, down, down_type, cos, sin, kv_cache, slot_mapping,
        block_tables, context_lens, block_size, scale, num_heads, num_kv_heads, head_dim);
  return {out, residual};
}

// Every block of a decode step in one call: llama_layer for each, the cache of layer l being
// kv_caches[l], the linears' blocks and type ids flat, four per layer (qkv, o, gate_up,
// down). The same kernels on the same tensors as the Python loop over the blocks, run by one
// team of threads (parallel.h) from the first block to the last: each kernel ends at a
// barrier instead of opening and closing a parallel region of its own (~270 of them a step).
std::tuple<at::Tensor, at::Tensor> llama_layers(
    at::Tensor x, at::TensorList input_norms, at::TensorList post_norms, double eps,
    at::TensorList linears, at::IntArrayRef linear_types, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& kv_caches, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
    double scale, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t layers = static_cast<int64_t>(input_norms.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(post_norms.size()) == layers &&
              static_cast<int64_t>(linears.size()) == 4 * layers &&
              static_cast<int64_t>(linear_types.size()) == 4 * layers &&
              kv_caches.size(0) == layers,
              "llama_layers: one input norm, post norm, cache and four linears per layer");
  check_x(x);
  for (int64_t i = 4; i < 4 * layers; ++i)
    TORCH_CHECK(features(linears[i], linear_types[i]) ==
                    features(linears[i % 4], linear_types[i % 4]),
                "llama_layers: every layer's linears must have the first layer's outputs");
  at::Tensor residual = x;
  Scratch s = scratch(x, features(linears[0], linear_types[0]),
                      features(linears[2], linear_types[2]), num_heads, head_dim);
  std::vector<at::Tensor> caches;
  for (int64_t l = 0; l < layers; ++l) caches.push_back(kv_caches.select(0, l));
  freetoken::run_team([&] {
    for (int64_t l = 0; l < layers; ++l) {
      const int64_t i = 4 * l;
      block(l == 0, residual, s, s.x, input_norms[l], post_norms[l], eps, linears[i],
            linear_types[i], linears[i + 1], linear_types[i + 1], linears[i + 2],
            linear_types[i + 2], linears[i + 3], linear_types[i + 3], cos, sin, caches[l],
            slot_mapping, block_tables, context_lens, block_size, scale, num_heads,
            num_kv_heads, head_dim);
    }
  });
  return {s.x, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(freetoken, m) {
  m.def("llama_layer(Tensor(a!) x, Tensor(b!)? residual, Tensor input_norm, Tensor post_norm, "
        "float eps, Tensor qkv, int qkv_type, Tensor o, int o_type, Tensor gate_up, "
        "int gate_up_type, Tensor down, int down_type, Tensor cos, Tensor sin, "
        "Tensor(c!) kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, "
        "int block_size, float scale, int num_heads, int num_kv_heads, int head_dim) "
        "-> (Tensor, Tensor)", &llama_layer);
  // x (the embeddings) becomes the residual stream, which the blocks update in place.
  m.def("llama_layers(Tensor(a!) x, Tensor[] input_norms, Tensor[] post_norms, float eps, "
        "Tensor[] linears, int[] linear_types, Tensor cos, Tensor sin, Tensor(b!) kv_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int block_size, "
        "float scale, int num_heads, int num_kv_heads, int head_dim) -> (Tensor, Tensor)",
        &llama_layers);
}
