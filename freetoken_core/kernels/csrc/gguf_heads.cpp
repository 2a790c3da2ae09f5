// One linear per attention head in one call: out[t, i] = x[t, i] @ W_i^T for each head i,
// each W_i a GGUF linear's blocks (any of the kernels: ops.h linear). DeepSeek's latent
// attention read from a GGUF file has two such per layer (attn_k_b, attn_v_b: a head's query
// into the latent space and its mixed latents out), which models/deepseek.py ran as one
// Python linear call per head: 2 x 128 calls a layer for V3, ~10 us of dispatch each.
//
// Each head's product is its linear's, on the same kernel: the same floats as the calls one
// by one (the linears are batch-invariant, and which thread computes a feature or a head
// changes nothing in it). Under kSharedRows rows (decode steps): heads side by side, one
// thread a head; more: one head at a time, its features shared among the threads.
// A V3-like file of 64 heads (Q8_0, Zen 3, 2 threads), one layer's k_b (64 x 512x64) and v_b
// (64 x 64x512): one row 1,002 -> 226 us and 898 -> 202 against a Python call a head; 16 rows
// 3,764 -> 1,412 and 2,853 -> 850 (with 16 rows one head at a time: 2,000 and 1,210).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>

#include "ops.h"

namespace {

// From this many rows a head's linear shares its features among the threads.
constexpr int64_t kSharedRows = 64;

// x: float32 [T, H, K]; blocks / types: H linears of K inputs and N outputs; out: [T, H, N].
void gguf_linear_heads(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef types,
                       at::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 &&
                  x.is_contiguous(),
              "gguf_linear_heads: x must be a contiguous float32 [T, heads, K] CPU tensor");
  const int64_t rows = x.size(0), heads = x.size(1);
  TORCH_CHECK(static_cast<int64_t>(blocks.size()) == heads &&
                  static_cast<int64_t>(types.size()) == heads,
              "gguf_linear_heads: one linear (blocks and type) per head of x");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 3 && out.is_contiguous() &&
                  out.size(0) == rows && out.size(1) == heads,
              "gguf_linear_heads: out must be a contiguous float32 [T, heads, N] tensor");
  const int64_t n = out.size(2);
  for (int64_t i = 0; i < heads; ++i)
    TORCH_CHECK(freetoken::linear_out_features(blocks[i], types[i], "gguf_linear_heads") == n,
                "gguf_linear_heads: head ", i, "'s linear does not have N = ", n, " outputs");
  if (rows == 0) return;
  auto head = [&](int64_t i) {
    // (On the pool's threads too, where the caller's inference mode is not set.)
    c10::InferenceMode inference;
    const at::Tensor xi = x.select(1, i);
    at::Tensor oi = out.select(1, i);
    if (rows == 1) {  // ([1, K] and [1, N]: contiguous views)
      freetoken::linear(xi, blocks[i], types[i], oi);
      return;
    }
    at::Tensor o = at::empty({rows, n}, out.options());
    freetoken::linear(xi.contiguous(), blocks[i], types[i], o);
    oi.copy_(o);
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), heads);
  if (rows >= kSharedRows || threads <= 1) {
    for (int64_t i = 0; i < heads; ++i) head(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1)) < heads;) head(i);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(freetoken, m) {
  m.def("gguf_linear_heads(Tensor x, Tensor[] blocks, int[] types, Tensor(a!) out) -> ()",
        &gguf_linear_heads);
}
