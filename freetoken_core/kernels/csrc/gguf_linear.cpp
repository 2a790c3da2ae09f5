// y[M, N] = x[M, K] @ W[N, K]^T with W kept as the GGUF file's blocks (Q4_1 or Q8_0), on
// the CPU, for a few rows of x: decoding one or a handful of sequences is bound by reading
// the weights, and these blocks are 5 (Q4_1) or 8.5 (Q8_0) bits per weight instead of 32.
//
// Each weight is dequantized exactly as gguf-py does it (Q4_1: d * q + m, Q8_0: d * q, in
// float32, two roundings, no fused multiply-add), so the weights are the very values of the
// float32 checkpoint FreeToken converts the file into; only the order of the sums differs
// from a float32 GEMM.
//
// blocks: [N, K / 32 * block_bytes] uint8, each row the blocks of one output feature.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstring>

#include "vec.h"

namespace {

constexpr int64_t kQ4_1 = 3, kQ8_0 = 8;  // ggml type ids
constexpr int64_t kBlock = 32;

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// The 32 weights of one block, as float32, into w.
template <int64_t QT>
inline void dequant_scalar(const uint8_t* block, float* w) {
  const float d = half_to_float(block);
  if constexpr (QT == kQ4_1) {
    const float m = half_to_float(block + 2);
    const uint8_t* qs = block + 4;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(qs[j] & 0x0F) + m;
      w[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  } else {
    const int8_t* qs = reinterpret_cast<const int8_t*>(block + 2);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(qs[j]);
  }
}

constexpr int64_t block_bytes(int64_t qt) { return qt == kQ4_1 ? 20 : 34; }

#ifdef FREETOKEN_AVX2
template <int64_t QT>
inline void dequant8x4(const uint8_t* block, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half_to_float(block));
  if constexpr (QT == kQ4_1) {
    const __m256 m = _mm256_set1_ps(half_to_float(block + 2));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int k = 0; k < 4; ++k) {
      const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[k]));
      w[k] = _mm256_add_ps(_mm256_mul_ps(d, qf), m);
    }
  } else {
    const uint8_t* qs = block + 2;
    for (int k = 0; k < 4; ++k) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * k));
      w[k] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
    }
  }
}

// Rows x[0:R] against output features [n0, n1): R accumulators in registers per feature.
template <int64_t QT, int R>
void rows_avx2(const float* x, int64_t x_stride, const uint8_t* blocks, int64_t row_bytes,
               int64_t num_blocks, float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = blocks + n * row_bytes;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
      __m256 w[4];
      dequant8x4<QT>(row + b * block_bytes(QT), w);
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * x_stride + b * kBlock;
        acc[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc[r]);
        acc[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), acc[r]);
        acc[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), acc[r]);
        acc[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride + n] = freetoken::vec::hsum(acc[r]);
  }
}
#endif

template <int64_t QT>
void rows_scalar(const float* x, int64_t x_stride, int64_t rows, const uint8_t* blocks,
                 int64_t row_bytes, int64_t num_blocks, float* out, int64_t out_stride,
                 int64_t n0, int64_t n1) {
  float w[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < rows; ++r) out[r * out_stride + n] = 0.f;
    for (int64_t b = 0; b < num_blocks; ++b) {
      dequant_scalar<QT>(blocks + n * row_bytes + b * block_bytes(QT), w);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xb = x + r * x_stride + b * kBlock;
        float s = 0.f;
        for (int j = 0; j < kBlock; ++j) s += w[j] * xb[j];
        out[r * out_stride + n] += s;
      }
    }
  }
}

template <int64_t QT>
void gguf_linear_impl(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), n = blocks.size(0);
  const int64_t num_blocks = k / kBlock, row_bytes = blocks.size(1);
  const float* xp = x.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
#ifdef FREETOKEN_AVX2
    // Up to 8 rows at a time: 8 accumulators + 4 weight vectors stay in registers.
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      const float* xr = xp + r0 * k;
      float* o = op + r0 * n;
      switch (std::min<int64_t>(8, rows - r0)) {
        case 1: rows_avx2<QT, 1>(xr, k, bp, row_bytes, num_blocks, o, n, n0, n1); break;
        case 2: rows_avx2<QT, 2>(xr, k, bp, row_bytes, num_blocks, o, n, n0, n1); break;
        case 3: rows_avx2<QT, 3>(xr, k, bp, row_bytes, num_blocks, o, n, n0, n1); break;
        case 4: rows_avx2<QT, 4>(xr, k, bp, row_bytes, num_blocks, o, n, n0, n1); break;
        case 5: rows_avx2<QT, 5>(xr, k, bp, row_bytes, num_blocks, o, n, n0, n1); break;
        case 6: rows_avx2<QT, 6>(xr, k, bp, row_bytes, num_blocks, o, n, n0, n1); break;
        case 7: rows_avx2<QT, 7>(xr, k, bp, row_bytes, num_blocks, o, n, n0, n1); break;
        default: rows_avx2<QT, 8>(xr, k, bp, row_bytes, num_blocks, o, n, n0, n1); break;
      }
    }
#else
    rows_scalar<QT>(xp, k, rows, bp, row_bytes, num_blocks, op, n, n0, n1);
#endif
  });
}

void gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, at::Tensor out) {
  TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "gguf_linear: Q4_1 (3) or Q8_0 (8) blocks only");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
              x.is_contiguous(), "gguf_linear: x must be a contiguous float32 [M, K] CPU tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "gguf_linear: K must be a multiple of 32");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              blocks.size(1) == x.size(1) / kBlock * block_bytes(qtype),
              "gguf_linear: blocks must be uint8 [N, K / 32 * block bytes]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == x.size(0) &&
              out.size(1) == blocks.size(0), "gguf_linear: out must be float32 [M, N]");
  if (qtype == kQ4_1) {
    gguf_linear_impl<kQ4_1>(x, blocks, out);
  } else {
    gguf_linear_impl<kQ8_0>(x, blocks, out);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(freetoken, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int qtype, Tensor(a!) out) -> ()", &gguf_linear);
}
