// The kernels' entry points, as registered in TORCH_LIBRARY(freetoken) and as other kernels
// of this library call them directly (llama_layer.cpp), without the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>

namespace freetoken {

void gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, at::Tensor out);
// The same product with 8-bit activations (q8_linear.cpp; opt-in, not exact).
void gguf_linear_q8(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, at::Tensor out);
// llama_layer's linears take a ggml type id, plus this bit for gguf_linear_q8.
constexpr int64_t kActivationsQ8 = 1 << 8;
// ... and this one for gguf_linear_int (the blocks in its layout).
constexpr int64_t kActivationsInt24 = 1 << 9;
// gguf_linear's type id of a linear made of parts of different types (linear.parts_blocks).
constexpr int64_t kParts = 1 << 10;
// The integer-arithmetic exact kernel of CPUs with AVX-512 VNNI (int_linear.cpp): its weight
// layout, made from the kernel blocks, and the product (mode 1: the scalar reference).
bool int_linear_available();
at::Tensor gguf_int_blocks(const at::Tensor& blocks, int64_t qtype);
void gguf_linear_int(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, at::Tensor out,
                     int64_t mode = 0);
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& w, double eps);
void silu_and_mul(at::Tensor out, const at::Tensor& x);
void rotary_embedding(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
void paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            int64_t block_size, double scale, at::Tensor out);

}  // namespace freetoken
