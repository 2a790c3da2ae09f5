// y[M, N] = x[M, K] @ W[N, K]^T with W kept as the GGUF file's blocks (Q4_1 or Q8_0), on
// the CPU, for any number of rows: decoding is bound by reading the weights, and these blocks
// are 5 (Q4_1) or 8.5 (Q8_0) bits per weight instead of 32; prefill chunks and large decode
// batches reuse each dequantized weight across rows.
//
// Each weight is dequantized exactly as gguf-py does it (Q4_1: d * q + m, Q8_0: d * q, in
// float32, two roundings, no fused multiply-add), so the weights are the very values of the
// float32 checkpoint FreeToken converts the file into; only the order of the sums differs
// from a float32 GEMM.
//
// Batch invariance: every output y[m, n] is summed in one order whatever M is and whichever
// path computes it: eight float32 lanes accumulate x[m, 8i:8i+8] * W[n, 8i:8i+8] by FMA for
// i = 0, 1, ... in turn, then the lanes are added (hsum). So a row's result never depends
// on the other rows of its step (how many sequences decode together, how a prompt is cut
// into chunks, how much of it came from the prefix cache), and a seeded draw gives the same
// token in every batch.
//
// Two paths with that one order: up to kDirectRows rows, the blocks are dequantized into
// registers and used at once (one pass over the weights, the memory-bound decode case);
// above, each thread dequantizes a panel of kPanel output features into a float32 scratch
// once and runs a register-tiled kernel of kTileRows rows x kTileCols features over it.
//
// blocks: [N, K / 32 * block_bytes] uint8, each row the blocks of one output feature.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "vec.h"

#ifdef __F16C__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kQ4_1 = 3, kQ8_0 = 8;  // ggml type ids
constexpr int64_t kBlock = 32;

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction; the same IEEE value as the portable path
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
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

// Rows x[0:R] against F output features at a time from [n0, n1): R x F accumulators in
// registers, so that R x F independent FMA chains hide the FMA latency even for one row.
template <int64_t QT, int R, int F>
void rows_avx2(const float* x, int64_t x_stride, const uint8_t* blocks, int64_t row_bytes,
               int64_t num_blocks, float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + F <= n1; n += F) {
    const uint8_t* row = blocks + n * row_bytes;
    __m256 acc[R][F];
    for (int r = 0; r < R; ++r)
      for (int f = 0; f < F; ++f) acc[r][f] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
      for (int f = 0; f < F; ++f) {
        __m256 w[4];
        dequant8x4<QT>(row + f * row_bytes + b * block_bytes(QT), w);
        for (int r = 0; r < R; ++r) {
          const float* xb = x + r * x_stride + b * kBlock;
          acc[r][f] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc[r][f]);
          acc[r][f] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), acc[r][f]);
          acc[r][f] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), acc[r][f]);
          acc[r][f] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), acc[r][f]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int f = 0; f < F; ++f) out[r * out_stride + n + f] = freetoken::vec::hsum(acc[r][f]);
  }
  if constexpr (F > 1) {
    if (n < n1) rows_avx2<QT, R, 1>(x, x_stride, blocks, row_bytes, num_blocks, out, out_stride, n, n1);
  }
}

// R rows: features per pass so that R x F is about 8 chains.
template <int64_t QT, int R>
inline void rows_direct(const float* x, int64_t x_stride, const uint8_t* blocks,
                        int64_t row_bytes, int64_t num_blocks, float* out, int64_t out_stride,
                        int64_t n0, int64_t n1) {
  constexpr int F = R >= 8 ? 1 : 8 / R;
  rows_avx2<QT, R, F>(x, x_stride, blocks, row_bytes, num_blocks, out, out_stride, n0, n1);
}

// The float32 weights of features [n0, n0 + count) into panel [count, K], each block as
// dequant8x4 makes it (the same values the direct path uses).
template <int64_t QT>
void dequant_panel(const uint8_t* blocks, int64_t row_bytes, int64_t num_blocks, int64_t n0,
                   int64_t count, float* panel) {
  const int64_t k = num_blocks * kBlock;
  for (int64_t f = 0; f < count; ++f) {
    const uint8_t* row = blocks + (n0 + f) * row_bytes;
    float* dst = panel + f * k;
    for (int64_t b = 0; b < num_blocks; ++b) {
      __m256 w[4];
      dequant8x4<QT>(row + b * block_bytes(QT), w);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(dst + b * kBlock + 8 * j, w[j]);
    }
  }
}

// out[r, f] = hsum over i of fma(x[r, 8i:], w[f, 8i:]) for RT rows and FT features: RT * FT
// accumulators in registers, each weight vector loaded once for RT rows.
template <int RT, int FT>
inline void tile(const float* x, int64_t x_stride, const float* w, int64_t k, float* out,
                 int64_t out_stride) {
  __m256 acc[RT][FT];
  for (int r = 0; r < RT; ++r)
    for (int f = 0; f < FT; ++f) acc[r][f] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    __m256 wv[FT];
    for (int f = 0; f < FT; ++f) wv[f] = _mm256_loadu_ps(w + f * k + i);
    for (int r = 0; r < RT; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * x_stride + i);
      for (int f = 0; f < FT; ++f) acc[r][f] = _mm256_fmadd_ps(wv[f], xv, acc[r][f]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int f = 0; f < FT; ++f) out[r * out_stride + f] = freetoken::vec::hsum(acc[r][f]);
}

constexpr int kTileRows = 4, kTileCols = 3;
constexpr int64_t kPanel = 24;  // features per panel: 24 x 1536 floats = 144 KiB, in L2

template <int RT>
inline void tile_cols(const float* x, int64_t x_stride, const float* w, int64_t k, float* out,
                      int64_t out_stride, int64_t cols) {
  switch (cols) {
    case 1: tile<RT, 1>(x, x_stride, w, k, out, out_stride); break;
    case 2: tile<RT, 2>(x, x_stride, w, k, out, out_stride); break;
    default: tile<RT, kTileCols>(x, x_stride, w, k, out, out_stride); break;
  }
}

// Rows [0, rows) against features [n0, n1), kPanel features at a time through `panel`.
template <int64_t QT>
void panels_avx2(const float* x, int64_t rows, const uint8_t* blocks, int64_t row_bytes,
                 int64_t num_blocks, float* out, int64_t out_stride, int64_t n0, int64_t n1,
                 float* panel) {
  const int64_t k = num_blocks * kBlock;
  for (int64_t p0 = n0; p0 < n1; p0 += kPanel) {
    const int64_t count = std::min(kPanel, n1 - p0);
    dequant_panel<QT>(blocks, row_bytes, num_blocks, p0, count, panel);
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      const float* xr = x + r0 * k;
      const int64_t rt = std::min<int64_t>(kTileRows, rows - r0);
      for (int64_t f0 = 0; f0 < count; f0 += kTileCols) {
        const int64_t ft = std::min<int64_t>(kTileCols, count - f0);
        float* o = out + r0 * out_stride + p0 + f0;
        const float* w = panel + f0 * k;
        switch (rt) {
          case 1: tile_cols<1>(xr, k, w, k, o, out_stride, ft); break;
          case 2: tile_cols<2>(xr, k, w, k, o, out_stride, ft); break;
          case 3: tile_cols<3>(xr, k, w, k, o, out_stride, ft); break;
          default: tile_cols<kTileRows>(xr, k, w, k, o, out_stride, ft); break;
        }
      }
    }
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

// Up to this many rows the direct path (one pass over the blocks, dequantized in registers);
// above, the panels (bench/gguf_linear.py measures both).
constexpr int64_t kDirectRows = 4;

template <int64_t QT>
void gguf_linear_impl(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), n = blocks.size(0);
  const int64_t num_blocks = k / kBlock, row_bytes = blocks.size(1);
  const float* xp = x.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (rows == 0) return;
#ifdef FREETOKEN_AVX2
  if (rows > kDirectRows) {
    at::parallel_for(0, (n + kPanel - 1) / kPanel, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> panel(kPanel * k);
      panels_avx2<QT>(xp, rows, bp, row_bytes, num_blocks, op, n, b0 * kPanel,
                      std::min(n, b1 * kPanel), panel.data());
    });
    return;
  }
#endif
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
#ifdef FREETOKEN_AVX2
    const float* xr = xp;
    switch (rows) {
      case 1: rows_direct<QT, 1>(xr, k, bp, row_bytes, num_blocks, op, n, n0, n1); break;
      case 2: rows_direct<QT, 2>(xr, k, bp, row_bytes, num_blocks, op, n, n0, n1); break;
      case 3: rows_direct<QT, 3>(xr, k, bp, row_bytes, num_blocks, op, n, n0, n1); break;
      case 4: rows_direct<QT, 4>(xr, k, bp, row_bytes, num_blocks, op, n, n0, n1); break;
      case 5: rows_direct<QT, 5>(xr, k, bp, row_bytes, num_blocks, op, n, n0, n1); break;
      case 6: rows_direct<QT, 6>(xr, k, bp, row_bytes, num_blocks, op, n, n0, n1); break;
      case 7: rows_direct<QT, 7>(xr, k, bp, row_bytes, num_blocks, op, n, n0, n1); break;
      default: rows_direct<QT, kDirectRows>(xr, k, bp, row_bytes, num_blocks, op, n, n0, n1); break;
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
