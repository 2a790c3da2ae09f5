// GGUF rows to float32 with the decoders of gguf_types.h: gguf_dequantize (whole weights,
// e.g. to check a kernel against, or for a path that wants float32 weights) and
// gguf_embedding (the rows of a token embedding table the ids select, which is how a GGUF
// token_embd of any type is read without dequantizing the whole table).
//
// rows: uint8 [N, row_bytes], the FILE's layout (row n = the units of one row, back to back;
// row_bytes a multiple of the type's unit bytes). The results are gguf-py's
// gguf.quants.dequantize bit for bit, from either decoder (tests/test_gguf_types.py).
//
// FREETOKEN_OPS_NAMESPACE: the torch library namespace of the ops (freetoken); the tests
// build a second copy for AVX2 under another one, to load both into one process.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "gguf_types.h"

#ifndef FREETOKEN_OPS_NAMESPACE
#define FREETOKEN_OPS_NAMESPACE freetoken
#endif

namespace {

using namespace freetoken::gguf::types;

// One row of `units` units of type QT at src into out (units * kWeights floats).
template <int64_t QT, bool kVector>
inline void decode_row(const uint8_t* src, int64_t units, float* out) {
  using T = Type<QT>;
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* unit = src + u * T::kBytes;
    for (int s = 0; s < T::kSubs; ++s) {
      float* w = out + u * T::kWeights + 32 * s;
#ifdef FREETOKEN_AVX2
      if constexpr (kVector) {
        vf v[kVecs];
        T::vec(unit, s, v);
        for (int i = 0; i < kVecs; ++i)
#if defined(__AVX512F__) && defined(__AVX512BW__)
          _mm512_storeu_ps(w + kLanes * i, v[i]);
#else
          _mm256_storeu_ps(w + kLanes * i, v[i]);
#endif
        continue;
      }
#endif
      T::scalar(unit, s, w);
    }
  }
}

void check_rows(const at::Tensor& rows, int64_t qtype, const char* op) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kByte && rows.dim() == 2,
              op, ": rows must be a 2-D uint8 CPU tensor, got ", rows.scalar_type(), " ",
              rows.sizes());
  TORCH_CHECK(rows.stride(1) == 1, op, ": each row's bytes must be contiguous");
  const int64_t bytes = unit_bytes(qtype);
  TORCH_CHECK(rows.size(1) % bytes == 0, op, ": a row of ", rows.size(1), " bytes is not whole ",
              type_name(qtype), " units of ", bytes, " bytes");
}

// out[i] = the decoded row index(i) of rows, for i < n.
template <class Index>
void decode_rows(const at::Tensor& rows, int64_t qtype, bool vector, int64_t n,
                 const Index& index, float* out) {
  const uint8_t* base = rows.data_ptr<uint8_t>();
  const int64_t stride = rows.stride(0), row_bytes = rows.size(1);
  dispatch(qtype, [&](auto t) {
    constexpr int64_t QT = decltype(t)::value;
    using T = Type<QT>;
    const int64_t units = row_bytes / T::kBytes, k = units * T::kWeights;
    // ~16 KB of output per task at least: small rows (an embedding's few tokens) stay on one
    // thread where a fork would cost more than the decoding.
    const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(k, 1));
    at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* src = base + index(r) * stride;
        if (vector)
          decode_row<QT, true>(src, units, out + r * k);
        else
          decode_row<QT, false>(src, units, out + r * k);
      }
    });
  });
}

at::Tensor gguf_dequantize(const at::Tensor& rows, int64_t qtype, bool vector) {
  check_rows(rows, qtype, "gguf_dequantize");
  const int64_t n = rows.size(0), k = rows.size(1) / unit_bytes(qtype) * unit_weights(qtype);
  at::Tensor out = at::empty({n, k}, rows.options().dtype(at::kFloat));
  decode_rows(rows, qtype, vector, n, [](int64_t r) { return r; }, out.data_ptr<float>());
  return out;
}

at::Tensor gguf_embedding(const at::Tensor& ids, const at::Tensor& rows, int64_t qtype) {
  check_rows(rows, qtype, "gguf_embedding");
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1,
              "gguf_embedding: ids must be a 1-D int64 CPU tensor, got ", ids.scalar_type(), " ",
              ids.sizes());
  const at::Tensor idx = ids.contiguous();
  const int64_t* p = idx.data_ptr<int64_t>();
  const int64_t n = idx.size(0), vocab = rows.size(0);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < vocab, "gguf_embedding: id ", p[i], " at position ", i,
                " is out of range for a table of ", vocab, " rows");
  const int64_t k = rows.size(1) / unit_bytes(qtype) * unit_weights(qtype);
  at::Tensor out = at::empty({n, k}, rows.options().dtype(at::kFloat));
  decode_rows(rows, qtype, true, n, [p](int64_t r) { return p[r]; }, out.data_ptr<float>());
  return out;
}

// The float32 lanes of the vector decoders this library was built with: 16 (AVX-512), 8 (AVX2)
// or 0 (none: vector=True runs the scalar decoders).
int64_t gguf_vector_lanes() {
#ifdef FREETOKEN_AVX2
  return kLanes;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(FREETOKEN_OPS_NAMESPACE, m) {
  m.def("gguf_dequantize(Tensor rows, int qtype, bool vector) -> Tensor", &gguf_dequantize);
  m.def("gguf_embedding(Tensor ids, Tensor rows, int qtype) -> Tensor", &gguf_embedding);
  m.def("gguf_vector_lanes() -> int", &gguf_vector_lanes);
}
