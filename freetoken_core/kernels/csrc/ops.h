// The kernels' entry points, as registered in TORCH_LIBRARY(freetoken) and as other kernels
// of this library call them directly (llama_layer.cpp), without the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstring>
#include <vector>

namespace freetoken {

void gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, at::Tensor out);
// The same product with 8-bit activations (q8_linear.cpp; opt-in, not exact).
void gguf_linear_q8(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, at::Tensor out);
// llama_layer's linears take a ggml type id, plus this bit for gguf_linear_q8.
constexpr int64_t kActivationsQ8 = 1 << 8;
// ... and this one for gguf_linear_int (the blocks in its layout).
constexpr int64_t kActivationsInt24 = 1 << 9;
// gguf_linear's type id of a linear made of parts of different types (block_layout.parts_blocks).
constexpr int64_t kParts = 1 << 10;

// One part of such a linear: its ggml type, output features, bytes a feature, and where its
// blocks start in the buffer.
struct LinearPart {
  int64_t type, n, row_bytes, offset;
};

// The parts of a kParts buffer (`blocks` [1, bytes]: a header of int64 values, kParts, the
// part count, then per part its type, features, row bytes and byte offset; each part's blocks
// in its kernel's layout), each checked to lie inside the buffer; `op` names the caller in
// the errors.
inline std::vector<LinearPart> linear_parts(const at::Tensor& blocks, const char* op) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(0) == 1 && blocks.size(1) >= 16, op,
              ": bad parts blocks");
  const uint8_t* base = blocks.data_ptr<uint8_t>();
  int64_t head[2];
  std::memcpy(head, base, sizeof head);
  TORCH_CHECK(head[0] == kParts && head[1] >= 1 && blocks.size(1) >= 16 + 32 * head[1], op,
              ": bad parts header");
  std::vector<LinearPart> parts;
  for (int64_t p = 0; p < head[1]; ++p) {
    int64_t v[4];
    std::memcpy(v, base + 16 + 32 * p, sizeof v);
    TORCH_CHECK(v[1] >= 0 && v[2] >= 0 && v[3] >= 0 && v[3] + v[1] * v[2] <= blocks.size(1), op,
                ": a part's blocks do not fit the buffer");
    parts.push_back({v[0], v[1], v[2], v[3]});
  }
  return parts;
}
// The output features of a linear: its blocks' rows, or for a linear of parts (kParts) the
// sum of the parts' in its header; `op` names the caller in the errors.
inline int64_t linear_out_features(const at::Tensor& blocks, int64_t qtype, const char* op) {
  if ((qtype & ~(kActivationsQ8 | kActivationsInt24)) != kParts) return blocks.size(0);
  int64_t n = 0;
  for (const LinearPart& p : linear_parts(blocks, op)) n += p.n;
  return n;
}
// An embedding's token ids (`ids`: a contiguous int64 [T] tensor), each checked to be one of
// its n rows; `op` names the caller in the errors.
inline const int64_t* embedding_ids(const at::Tensor& ids, int64_t n, const char* op) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), op,
              ": ids must be a contiguous int64 [T] tensor");
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.size(0); ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < n, op, ": token id ", ip[t],
                " is outside the embedding's ", n, " rows");
  return ip;
}

// The integer-arithmetic exact kernel of CPUs with AVX-512 VNNI (int_linear.cpp): its weight
// layout, made from the kernel blocks, and the product (mode 1: the scalar reference).
bool int_linear_available();
at::Tensor gguf_int_blocks(const at::Tensor& blocks, int64_t qtype);
// Bytes a feature of a weight of K inputs in that layout (gguf_int_blocks' columns).
int64_t gguf_int_row_bytes(int64_t qtype, int64_t k);
void gguf_linear_int(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, at::Tensor out,
                     int64_t mode = 0);
// The product of a linear's blocks whatever its kernel: gguf_linear_int or gguf_linear_q8
// where the type id carries their bit, else gguf_linear.
inline void linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                   const at::Tensor& out) {
  if (qtype & kActivationsInt24) {
    gguf_linear_int(x, blocks, qtype & ~kActivationsInt24, out);
  } else if (qtype & kActivationsQ8) {
    gguf_linear_q8(x, blocks, qtype & ~kActivationsQ8, out);
  } else {
    gguf_linear(x, blocks, qtype, out);
  }
}
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& w, double eps);
void silu_and_mul(at::Tensor out, const at::Tensor& x);
void rotary_embedding(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
void paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            int64_t block_size, double scale, at::Tensor out);

}  // namespace freetoken
