// y[M, N] = x[M, K] @ W[N, K]^T from GGUF blocks with 8-bit activations, the arithmetic of
// llama.cpp's CPU backend: x is quantized once per call into the weight type's activation
// type (llama.cpp's vec_dot_type), and every product of a weight block and an activation
// block is an integer dot product, scaled once.
//
// Blocks of 32 (Q4_0, Q4_1, Q5_0, Q8_0; activations as llama.cpp's Q8_0 / Q8_1: each block
// of 32 rounded to int8 with one float32 scale dx = max|x| / 127):
//
//   Q4_0, Q5_0, Q8_0:  d * dx * sum_j q_j qx_j                 (q signed: nibble - 8, ...)
//   Q4_1:              d * dx * sum_j q_j qx_j + m * dx * sum_j qx_j      (w_j = d q_j + m)
//
// Super-blocks of 256 (Q4_K, Q6_K; activations as llama.cpp's Q8_K: each run of 256 rounded
// to int8 with one float32 scale, plus the sums of every 16 of them): the sub-block scales
// are integers, so a whole super-block is one integer sum and one float scaling,
//
//   Q4_K:  d * dx * sum_s sc_s sum_{j in s} q_j qx_j  -  dmin * dx * sum_s m_s sum_{j in s} qx_j
//   Q6_K:  d * dx * sum_s sc_s sum_{j in s} (q_j - 32) qx_j
//
// (Q4_K: 8 sub-blocks of 32, 6-bit scales and mins; Q6_K: 16 of 16, int8 scales.) These are
// llama.cpp's ggml_vec_dot_*_q8_* on AVX2 (ggml-cpu/arch/x86/quants.c), with float32 where
// it keeps Q8_0/Q8_1 scales in float16.
//
// Several times fewer instructions per weight than dequantizing to float32
// (gguf_linear.cpp), so one sequence's decode step is bound by reading the weights rather
// than by arithmetic, and many rows' steps go 2-4x faster. The price is the rounding of the
// activations to 8 bits (a relative error of up to 1/254 of each block's largest value): an
// opt-in numeric mode (`--activations q8`), measured against the exact path by
// bench/q8_quality.py.
//
// The weights are laid out anew at load, the features side by side in the vector lanes
// (the lanes layout, below: the same bytes per block as the file's, Q4_K's 148 a super-block
// with its scales and mins unpacked), and computed with vpdpbusd where the CPU has AVX-512
// VNNI (16 features a register, 64 products an instruction), else vpmaddubsw (8 features
// a register). Without AVX2 a scalar loop reads the kernels' interleaved layout
// (gguf_blocks.h) one output at a time. bench/gguf_types.py --activations q8, a 1B block's
// linears at 16 rows on Zen 5, against the interleaved AVX2 kernels these replaced: Q4_K 6.5
// -> 2.0 ms (VNNI), Q6_K 6.5 -> 2.4; an AVX2 build 9.3 -> 4.4 and 8.4 -> 6.3.
//
// Batch invariance: a row's outputs are computed alike whatever M is (per block or
// super-block the integer dot products, exact; then y = fma(d * dx, sum, y) in the row's own
// lanes, block after block, and Q4_1's m term and Q4_K's mins as a second multiply-add of
// the block), and a row's quantization depends on that row alone.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_types.h"
#include "ops.h"
#include "parallel.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(FREETOKEN_AVX2)
#define FREETOKEN_Q8_VNNI 1
#endif

namespace {

using namespace freetoken::gguf;

constexpr int64_t kQ4_0 = 2, kQ5_0 = 6, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;  // ggml type ids
constexpr int64_t kSuper = 256;  // weights per K-quant super-block

// Bytes of a block (or super-block) as this kernel reads it, as the file stores it but for
// Q4_K (q8_layout); 0 for a type without an 8-bit kernel.
constexpr int64_t q8_block_bytes(int64_t qt) {
  switch (qt) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ8_0: return 34;
    case kQ4_K: return 148;  // the file's 144, its scales and mins unpacked (q8_layout)
#ifdef FREETOKEN_AVX2
    case kQ5_K: return 180;  // the file's 176, its scales and mins unpacked (lanes layout)
#endif
    case kQ6_K: return 210;
    default: return 0;
  }
}
constexpr bool is_k_quant(int64_t qt) { return qt == kQ4_K || qt == kQ5_K || qt == kQ6_K; }
constexpr int64_t q8_block_weights(int64_t qt) { return is_k_quant(qt) ? kSuper : kBlock; }
// Bytes of a block as the kernel blocks hold it (gguf_q8_blocks' input, the file's; Q4_1's
// float16 scales narrowed back): Q4_K and Q5_K before their scales are unpacked.
constexpr int64_t kernel_block_bytes(int64_t qt) {
  return qt == kQ4_K ? 144 : qt == kQ5_K ? 176 : q8_block_bytes(qt);
}
// Bytes a feature of K inputs in the layout gguf_linear_q8 reads.
constexpr int64_t q8_row_bytes(int64_t qt, int64_t k) {
  return k / q8_block_weights(qt) * q8_block_bytes(qt);
}

// x quantized for blocks of 32: per row, K int8 values and, per block of 32, the scale and
// the scaled sum.
struct QuantRows {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> ds;   // [M, K / 32, 2]: the scale dx, then dx * sum of the block's q
                           // (the Q4_1 m term's factor)
  std::vector<int32_t> sums;  // [M, K / 32]: the sum of the block's q (the VNNI kernel's
                              // offsets of unsigned weights)
  int64_t k = 0, nb = 0;
};

// x quantized for super-blocks of 256 (llama.cpp's block_q8_K): per row, K int8 values and,
// per super-block, its scale and the sums of its q by 16 (Q6_K's offset) and by 32 (Q4_K's
// mins).
struct QuantRowsK {
  std::vector<int8_t> q;          // [M, K]
  std::vector<float> d;           // [M, K / 256]
  std::vector<int16_t> sums16;    // [M, K / 256, 16]
  std::vector<int16_t> sums32;    // [M, K / 256, 8]
  int64_t k = 0, nb = 0;
};

// 32 values rounded to int8 as q = round(x * id); returns their sum.
inline int quantize_32(const float* x, float id, int8_t* q) {
#ifdef FREETOKEN_AVX2
  const __m256 vid = _mm256_set1_ps(id);
  __m256i i[4];
  for (int j = 0; j < 4; ++j)
    i[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), vid),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_hadd_epi32(t, t);
  t = _mm_hadd_epi32(t, t);
  // Pack 32-bit to 8-bit: the packs interleave the 128-bit lanes; a permute restores order.
  const __m256i p16a = _mm256_packs_epi32(i[0], i[1]), p16b = _mm256_packs_epi32(i[2], i[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return _mm_cvtsi128_si32(t);
#else
  int sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(x[j] * id));
    sum += q[j];
  }
  return sum;
#endif
}

// The largest |x| of n values (n a multiple of 8).
inline float max_abs(const float* x, int64_t n) {
#ifdef FREETOKEN_AVX2
  __m256 amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t j = 0; j < n; j += 8)
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
#else
  float m = 0.f;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, std::fabs(x[j]));
  return m;
#endif
}

// One row's block of 32: its scale, its int8 values, the scale times their sum. Both kept in
// float32, where llama.cpp's block_q8_1 keeps them as float16: rounding them to float16 here
// measured worse against the exact path (bench/q8_quality.py: perplexity +0.52 % instead of
// +0.05 %, 11 greedy answers of 64 identical instead of 13) and no closer to llama-server's
// answers (which differ in more than this: its KV cache is float16).
inline void quantize_block(const float* x, int8_t* q, float* d, float* s, int32_t* sum_out) {
  const float m = max_abs(x, kBlock);
  const float dx = m / 127.f;
  const int sum = quantize_32(x, m != 0.f ? 127.f / m : 0.f, q);
  *d = dx;
  *s = dx * static_cast<float>(sum);
  *sum_out = sum;
}

// One row's super-block of 256: one scale over all of it (llama.cpp's quantize_row_q8_K,
// symmetric: dx = max|x| / 127), the int8 values and their sums by 16 and by 32.
inline void quantize_super(const float* x, int8_t* q, float* d, int16_t* sums16,
                           int16_t* sums32) {
  const float m = max_abs(x, kSuper);
  const float id = m != 0.f ? 127.f / m : 0.f;
  for (int c = 0; c < kSuper / kBlock; ++c) {
    sums32[c] = static_cast<int16_t>(quantize_32(x + c * kBlock, id, q + c * kBlock));
    for (int h = 0; h < 2; ++h) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += q[c * kBlock + 16 * h + j];
      sums16[2 * c + h] = static_cast<int16_t>(s);
    }
  }
  *d = m / 127.f;
}

void quantize_rows(const float* x, int64_t rows, int64_t k, QuantRows& out) {
  out.k = k;
  out.nb = k / kBlock;
  out.q.resize(rows * k);
  out.ds.resize(rows * out.nb * 2);
  out.sums.resize(rows * out.nb);
  auto quantize = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      quantize_block(x + b * kBlock, out.q.data() + b * kBlock, &out.ds[2 * b],
                     &out.ds[2 * b + 1], &out.sums[b]);
  };
  // In a team every member quantizes all rows into its own copy (`out` is thread-local):
  // rows x K values, a few microseconds, instead of a barrier and a shared buffer.
  if (freetoken::in_team()) {
    quantize(0, rows * out.nb);
  } else {
    at::parallel_for(0, rows * out.nb, 256, quantize);
  }
}

void quantize_rows_k(const float* x, int64_t rows, int64_t k, QuantRowsK& out) {
  out.k = k;
  out.nb = k / kSuper;
  out.q.resize(rows * k);
  out.d.resize(rows * out.nb);
  out.sums16.resize(rows * out.nb * 16);
  out.sums32.resize(rows * out.nb * 8);
  auto quantize = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      quantize_super(x + b * kSuper, out.q.data() + b * kSuper, &out.d[b],
                     &out.sums16[16 * b], &out.sums32[8 * b]);
  };
  if (freetoken::in_team()) {
    quantize(0, rows * out.nb);
  } else {
    at::parallel_for(0, rows * out.nb, 32, quantize);
  }
}

#ifndef FREETOKEN_AVX2
// Without AVX2: the same formulas, one output at a time (invariant too).

// Block b's 32 integer quants (Q4_1 unsigned, the others signed).
template <int64_t QT>
inline void block_ints(const uint8_t* block, int q[32]) {
  if constexpr (QT == kQ8_0) {
    for (int j = 0; j < 32; ++j) q[j] = reinterpret_cast<const int8_t*>(block + 2)[j];
  } else {
    const uint8_t* qs = block + (QT == kQ4_0 ? 2 : QT == kQ4_1 ? 4 : 6);
    uint32_t bits = 0;
    if constexpr (QT == kQ5_0) std::memcpy(&bits, block + 2, 4);
    for (int j = 0; j < 16; ++j) {
      q[j] = qs[j] & 0x0F;
      q[j + 16] = qs[j] >> 4;
    }
    for (int j = 0; j < 32; ++j) {
      if constexpr (QT == kQ4_0) q[j] -= 8;
      if constexpr (QT == kQ5_0) q[j] += static_cast<int>((bits >> j) & 1) * 16 - 16;
    }
  }
}

template <int64_t QT>
void q8_impl(const QuantRows& x, int64_t rows, const uint8_t* bp, int64_t row_bytes, float* op,
             int64_t n, int64_t ostride) {
  const int64_t nb = x.nb;
  // Team-aware (guided_for), as gguf_linear's scalar path.
  freetoken::guided_for(n, 16, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t f = n0; f < n1; ++f) {
      const FeatureBlocks fb = feature_blocks(bp, n, row_bytes, q8_block_bytes(QT), f);
      for (int64_t r = 0; r < rows; ++r) {
        float y = 0.f, mt = 0.f;
        const int8_t* qx = x.q.data() + r * x.k;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* block = fb.first + b * fb.stride;
          int q[32];
          block_ints<QT>(block, q);
          int dot = 0;
          for (int j = 0; j < kBlock; ++j) dot += q[j] * qx[b * kBlock + j];
          if constexpr (QT == kQ4_1) mt += half_to_float(block + 2) * x.ds[(r * nb + b) * 2 + 1];
          y += half_to_float(block) * x.ds[(r * nb + b) * 2] * static_cast<float>(dot);
        }
        op[r * ostride + f] = y + mt;
      }
    }
  });
}

// A super-block's 256 unsigned quants and its scales (Q4_K: 8 of 32, with 8 mins; Q6_K: 16
// of 16).
template <int64_t QT>
inline void super_ints(const uint8_t* blk, int q[256], int sc[16], int mn[8], float& d,
                       float& dmin) {
  if constexpr (QT == kQ4_K) {
    d = half_to_float(blk);
    dmin = half_to_float(blk + 2);
    for (int j = 0; j < 8; ++j) {
      sc[j] = blk[4 + j];
      mn[j] = blk[12 + j];
    }
    for (int c = 0; c < 8; ++c)
      for (int i = 0; i < 32; ++i) {
        const uint8_t byte = blk[20 + 32 * (c / 2) + i];
        q[32 * c + i] = c % 2 == 0 ? byte & 0x0F : byte >> 4;
      }
  } else {
    d = half_to_float(blk + 208);
    dmin = 0.f;
    for (int j = 0; j < 16; ++j) sc[j] = reinterpret_cast<const int8_t*>(blk + 192)[j];
    for (int c = 0; c < 8; ++c) {
      const int j = c / 4, t = c % 4;
      for (int i = 0; i < 32; ++i) {
        const uint8_t l = blk[64 * j + 32 * (t % 2) + i], h = blk[128 + 32 * j + i];
        q[32 * c + i] = (t < 2 ? l & 0x0F : l >> 4) | (((h >> (2 * t)) & 3) << 4);
      }
    }
  }
}

template <int64_t QT>
void q8k_impl(const QuantRowsK& x, int64_t rows, const uint8_t* bp, int64_t row_bytes, float* op,
              int64_t n, int64_t ostride) {
  const int64_t nb = x.nb;
  freetoken::guided_for(n, 16, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t f = n0; f < n1; ++f) {
      const FeatureBlocks fb = feature_blocks(bp, n, row_bytes, q8_block_bytes(QT), f);
      for (int64_t r = 0; r < rows; ++r) {
        float y = 0.f, m = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          int q[256], sc[16], mn[8];
          float d, dmin;
          super_ints<QT>(fb.first + b * fb.stride, q, sc, mn, d, dmin);
          const int8_t* qx = x.q.data() + r * x.k + b * kSuper;
          const int64_t i = r * nb + b;
          int64_t sum = 0, msum = 0;
          for (int j = 0; j < 256; ++j) {
            const int s = QT == kQ4_K ? sc[j / 32] : sc[j / 16];
            sum += static_cast<int64_t>(s) * (QT == kQ6_K ? q[j] - 32 : q[j]) * qx[j];
          }
          if constexpr (QT == kQ4_K)
            for (int s = 0; s < 8; ++s) msum += mn[s] * x.sums32[8 * i + s];
          y += d * x.d[i] * static_cast<float>(sum);
          m += -dmin * x.d[i] * static_cast<float>(msum);
        }
        op[r * ostride + f] = y + m;
      }
    }
  });
}
#endif

#ifdef FREETOKEN_AVX2
// ---- The lanes layout: the features in the vector lanes.
//
// gguf_q8_blocks lays each weight out anew at load (the same bytes per block as the file's,
// Q4_K and Q5_K 4 more for their unpacked scales and mins: a weight keeps its size): the
// output features in groups of 16 (the last group what is left, s features), a group's
// blocks one after the other, and in each the group's features side by side, four
// consecutive weights of a feature in one 32-bit lane. One instruction then multiplies four weights
// of many features by the same four activations of a row (broadcast): vpdpbusd, 64 products of 16
// features into their int32 sums (AVX-512 VNNI), or vpmaddubsw, 32 of 8 features into 16-bit pair
// sums (AVX2), where a layout of one feature's weights side by side needs a horizontal sum per
// feature and block. The block's scales then apply to all the features at once, per row and block:
// the integer sums' scales (the K-quants' sub-blocks) by one multiply, the offsets of
// unsigned weights (Q4_0's 8, ...) and Q4_K's mins by the row's sums, the float scaling by
// one multiply-add of all the lanes. A block (super-block) of a group of s features:
//
//   Q4_K: d[s], dmin[s] (float16); sc[8][s] (bytes); m[4][s][2] (bytes: the mins of
//         sub-blocks 2t and 2t + 1 side by side); then for each sub-block j (32 weights) 4
//         vectors of 4s bytes: byte 4f + e of vector v holds weight 8v + e of the sub-block
//         of feature f in its low nibble and weight 8v + 4 + e in its high one.  (148s)
//   Q5_K: Q4_K's d, dmin, sc and m (20s); then for each sub-block j 4s bytes of its fifth
//         bits as Q5_0's below; then the nibbles as Q4_K's                       (180s)
//   Q6_K: d[s] (float16); sc[8][s][2] (int8: the scales of sub-blocks 2t and 2t + 1 side by
//         side); then for each chunk c of 32 weights (sub-blocks 2c, 2c + 1 of 16) 4 vectors of
//         4s bytes of the low four bits, as Q4_K's, and 2 vectors of 4s bytes of the high two:
//         byte 4f + e of vector h holds those of weight 4p + e at bits 2i, 2i + 1, for the
//         chunk's quads p = 4h + i (i < 4).                                       (210s)
//   Q4_0: d[s] (float16), then 4 vectors of 4s bytes of nibbles as Q4_K's         (18s)
//   Q4_1: d[s], m[s] (float16), then the nibbles                                  (20s)
//   Q5_0: d[s], then 4s bytes of the fifth bits: bit p of byte 4f + e is that of weight
//         4p + e of feature f; then the nibbles                                   (22s)
//   Q8_0: d[s], then 8 vectors of 4s bytes: byte 4f + e of vector p is weight 4p + e plus
//         128 (unsigned, as vpdpbusd takes its first operand)                     (34s)
//
// Each row's sums are integers until the block's float scaling, which every row count
// computes alike (a row has accumulators of its own; the rows share only the decoded
// weights), so a row gives the same bits alone as among others.
constexpr int64_t kLaneGroup = 16;
#endif

#ifdef FREETOKEN_Q8_VNNI
// With AVX-512 VNNI: a group's 16 features in the lanes of one register.
inline __mmask16 lane_mask(int64_t s) { return static_cast<__mmask16>((1u << s) - 1u); }
inline __mmask32 byte_pair_mask(int64_t s) {
  return s >= 16 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (2 * s)) - 1u);
}
inline __m512i broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Bits 2i, 2i + 1 of each byte of v moved to bits 4, 5, the rest of the byte cleared.
template <int I>
inline __m512i high_bits(__m512i v) {
  const __m512i mask = _mm512_set1_epi8(0x30);
  if constexpr (I == 0) return _mm512_and_si512(_mm512_slli_epi16(v, 4), mask);
  else if constexpr (I == 1) return _mm512_and_si512(_mm512_slli_epi16(v, 2), mask);
  else if constexpr (I == 2) return _mm512_and_si512(v, mask);
  else return _mm512_and_si512(_mm512_srli_epi16(v, 2), mask);
}

// Q5_0's and Q5_K's fifth bits into the decoded quads: bit p of each byte of `bits` is
// that of quad p's weight in the byte's place, moved to bit 4.
inline void fifth_bits(__m512i bits, __m512i w[8]) {
  const __m512i bit4 = _mm512_set1_epi8(0x10);
  w[0] = _mm512_or_si512(w[0], _mm512_and_si512(_mm512_slli_epi16(bits, 4), bit4));
  w[1] = _mm512_or_si512(w[1], _mm512_and_si512(_mm512_slli_epi16(bits, 3), bit4));
  w[2] = _mm512_or_si512(w[2], _mm512_and_si512(_mm512_slli_epi16(bits, 2), bit4));
  w[3] = _mm512_or_si512(w[3], _mm512_and_si512(_mm512_slli_epi16(bits, 1), bit4));
  w[4] = _mm512_or_si512(w[4], _mm512_and_si512(bits, bit4));
  w[5] = _mm512_or_si512(w[5], _mm512_and_si512(_mm512_srli_epi16(bits, 1), bit4));
  w[6] = _mm512_or_si512(w[6], _mm512_and_si512(_mm512_srli_epi16(bits, 2), bit4));
  w[7] = _mm512_or_si512(w[7], _mm512_and_si512(_mm512_srli_epi16(bits, 3), bit4));
}

// R rows (from r0) against one group of s features (a group's blocks at `group`), into
// out[(r0 + r) * out_stride + f].
template <int64_t QT, int R>
void group_rows_vnni(const QuantRowsK& x, int64_t r0, const uint8_t* group, int64_t s,
                     float* out, int64_t out_stride) {
  constexpr int64_t kBytes = q8_block_bytes(QT);
  const int64_t nb = x.nb;
  const __mmask16 lanes = lane_mask(s);
  const __mmask32 pairs = byte_pair_mask(s);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* sb = group + b * kBytes * s;
    prefetch_range(sb + kPrefetchBytes, kBytes * s);
    const int8_t* qx = x.q.data() + r0 * x.k + b * kSuper;
    __m512i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
    if constexpr (QT == kQ4_K || QT == kQ5_K) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes, sb + (4 + j) * s));
        const uint8_t* wj = sb + ((QT == kQ5_K ? 52 : 20) + 16 * j) * s;
        __m512i w[8];
        for (int v = 0; v < 4; ++v) {
          const __m512i raw = _mm512_maskz_loadu_epi32(lanes, wj + 4 * v * s);
          w[2 * v] = _mm512_and_si512(raw, low4);
          w[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        }
        if constexpr (QT == kQ5_K)
          fifth_bits(_mm512_maskz_loadu_epi32(lanes, sb + (20 + 4 * j) * s), w);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = qx + r * x.k + 32 * j;
          __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], broadcast4(xr));
          for (int p = 1; p < 8; ++p) a = _mm512_dpbusd_epi32(a, w[p], broadcast4(xr + 4 * p));
          sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(a, sc));
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, sb));
      const __m512 dmin = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, sb + 2 * s));
      __m512i m[4];
      for (int t = 0; t < 4; ++t)
        m[t] = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(pairs, sb + (12 + 2 * t) * s));
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * nb + b;
        const int16_t* s32 = &x.sums32[8 * i];
        __m512i mins = _mm512_dpwssd_epi32(_mm512_setzero_si512(), m[0], broadcast4(s32));
        for (int t = 1; t < 4; ++t) mins = _mm512_dpwssd_epi32(mins, m[t], broadcast4(s32 + 2 * t));
        const __m512 dx = _mm512_set1_ps(x.d[i]);
        y[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(sumi[r]), y[r]);
        y[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(mins), y[r]);
      }
    } else {
      __m512i sp[8];  // the scales of sub-blocks 2c, 2c + 1 as int16 pairs, chunk by chunk
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        // each scale of the pair sign-extended alone
        sp[c] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(pairs, sb + (2 + 2 * c) * s));
        const __m512i sc0 = _mm512_srai_epi32(_mm512_slli_epi32(sp[c], 16), 16);
        const __m512i sc1 = _mm512_srai_epi32(sp[c], 16);
        const uint8_t* wc = sb + (18 + 24 * c) * s;
        const __m512i h0 = _mm512_maskz_loadu_epi32(lanes, wc + 16 * s);
        const __m512i h1 = _mm512_maskz_loadu_epi32(lanes, wc + 20 * s);
        __m512i w[8];
        for (int v = 0; v < 4; ++v) {
          const __m512i raw = _mm512_maskz_loadu_epi32(lanes, wc + 4 * v * s);
          const __m512i lo = _mm512_and_si512(raw, low4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
          // quads 2v and 2v + 1: their high bits at i = 2v % 4 and 2v % 4 + 1 of vector v / 2
          const __m512i h = v < 2 ? h0 : h1;
          if (v % 2 == 0) {
            w[2 * v] = _mm512_or_si512(lo, high_bits<0>(h));
            w[2 * v + 1] = _mm512_or_si512(hi, high_bits<1>(h));
          } else {
            w[2 * v] = _mm512_or_si512(lo, high_bits<2>(h));
            w[2 * v + 1] = _mm512_or_si512(hi, high_bits<3>(h));
          }
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = qx + r * x.k + 32 * c;
          __m512i a0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], broadcast4(xr));
          __m512i a1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4], broadcast4(xr + 16));
          for (int p = 1; p < 4; ++p) {
            a0 = _mm512_dpbusd_epi32(a0, w[p], broadcast4(xr + 4 * p));
            a1 = _mm512_dpbusd_epi32(a1, w[4 + p], broadcast4(xr + 16 + 4 * p));
          }
          sumi[r] = _mm512_add_epi32(
              sumi[r], _mm512_add_epi32(_mm512_mullo_epi32(a0, sc0), _mm512_mullo_epi32(a1, sc1)));
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, sb));
      // the weights' offset of 32: 32 sum_j sc_j (sum of the row's q over sub-block j)
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * nb + b;
        const int16_t* s16 = &x.sums16[16 * i];
        __m512i offset = _mm512_dpwssd_epi32(_mm512_setzero_si512(), sp[0], broadcast4(s16));
        for (int t = 1; t < 8; ++t)
          offset = _mm512_dpwssd_epi32(offset, sp[t], broadcast4(s16 + 2 * t));
        const __m512i sum = _mm512_sub_epi32(sumi[r], _mm512_slli_epi32(offset, 5));
        y[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.d[i])),
                               _mm512_cvtepi32_ps(sum), y[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (r0 + r) * out_stride, lanes, y[r]);
}

// Blocks of 32 (Q4_0, Q4_1, Q5_0, Q8_0): vpdpbusd multiplies the unsigned weights (Q4_0 /
// Q4_1 nibbles 0..15, Q5_0 0..31, Q8_0 0..255) by the signed activations; the offsets of
// the signed types (8, 16, 128) come off once per block as the offset times the row's sum
// of the block's q. Then y += (d dx) * sum (and for Q4_1 m * (dx * sum of q)), block after
// block.
template <int64_t QT, int R>
void group_rows_vnni32(const QuantRows& x, int64_t r0, const uint8_t* group, int64_t s,
                       float* out, int64_t out_stride) {
  constexpr int64_t kBytes = q8_block_bytes(QT);
  constexpr int32_t kOffset = QT == kQ4_0 ? 8 : QT == kQ5_0 ? 16 : QT == kQ8_0 ? 128 : 0;
  constexpr int64_t kWeights = QT == kQ4_1 ? 4 : 2;  // the scales' bytes per feature
  const int64_t nb = x.nb;
  const __mmask16 lanes = lane_mask(s);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* gb = group + b * kBytes * s;
    prefetch_range(gb + kPrefetchBytes, kBytes * s);
    __m512i w[8];
    const uint8_t* wq = gb + kWeights * s;
    if constexpr (QT == kQ8_0) {
      for (int p = 0; p < 8; ++p) w[p] = _mm512_maskz_loadu_epi32(lanes, wq + 4 * p * s);
    } else {
      const uint8_t* nib = QT == kQ5_0 ? wq + 4 * s : wq;
      for (int v = 0; v < 4; ++v) {
        const __m512i raw = _mm512_maskz_loadu_epi32(lanes, nib + 4 * v * s);
        w[2 * v] = _mm512_and_si512(raw, low4);
        w[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      }
      if constexpr (QT == kQ5_0) fifth_bits(_mm512_maskz_loadu_epi32(lanes, wq), w);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, gb));
    __m512 m = _mm512_setzero_ps();
    if constexpr (QT == kQ4_1) m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, gb + 2 * s));
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      const int8_t* xr = x.q.data() + (r0 + r) * x.k + b * kBlock;
      __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], broadcast4(xr));
      for (int p = 1; p < 8; ++p) sum = _mm512_dpbusd_epi32(sum, w[p], broadcast4(xr + 4 * p));
      if constexpr (kOffset != 0)
        sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(kOffset * x.sums[i]));
      y[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x.ds[2 * i])), _mm512_cvtepi32_ps(sum),
                             y[r]);
      if constexpr (QT == kQ4_1) y[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.ds[2 * i + 1]), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (r0 + r) * out_stride, lanes, y[r]);
}

// A kernel of this layout as a type: Kernel::run<R>(x, r0, group, s, out, stride).
template <int64_t QT>
struct Vnni32 {
  template <int R>
  static void run(const QuantRows& x, int64_t r0, const uint8_t* group, int64_t s, float* out,
                  int64_t stride) {
    group_rows_vnni32<QT, R>(x, r0, group, s, out, stride);
  }
};
template <int64_t QT>
struct VnniK {
  template <int R>
  static void run(const QuantRowsK& x, int64_t r0, const uint8_t* group, int64_t s, float* out,
                  int64_t stride) {
    group_rows_vnni<QT, R>(x, r0, group, s, out, stride);
  }
};

// The groups shared among the threads; in each, the rows 16 at a time, then 8, 4, 2, 1.
template <class Kernel, class Rows>
void vnni_impl(const Rows& x, int64_t rows, const uint8_t* bp, int64_t row_bytes, float* op,
               int64_t n, int64_t ostride) {
  const int64_t groups = (n + kLaneGroup - 1) / kLaneGroup;
  freetoken::guided_for(groups, 1, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t s = std::min(kLaneGroup, n - g * kLaneGroup);
      const uint8_t* group = bp + g * kLaneGroup * row_bytes;
      float* o = op + g * kLaneGroup;
      int64_t r = 0;
      for (; r + 16 <= rows; r += 16) Kernel::template run<16>(x, r, group, s, o, ostride);
      if (rows - r >= 8) Kernel::template run<8>(x, r, group, s, o, ostride), r += 8;
      if (rows - r >= 4) Kernel::template run<4>(x, r, group, s, o, ostride), r += 4;
      if (rows - r >= 2) Kernel::template run<2>(x, r, group, s, o, ostride), r += 2;
      if (rows - r >= 1) Kernel::template run<1>(x, r, group, s, o, ostride);
    }
  });
}
#endif

#if defined(FREETOKEN_AVX2) && !defined(FREETOKEN_Q8_VNNI)
// ---- The same layout with AVX2 alone (no VNNI): a group's features eight at a time (a
// half of the group), each quad of weights through vpmaddubsw (32 products of 8 features by
// 4 broadcast activations into 16-bit pair sums), the pair sums of several quads added as
// 16-bit integers while they cannot overflow (a nibble times an activation: 2 x 15 x 127 a
// pair, 8 quads 30,480; Q5_0 4 quads, Q6_K 2), then one vpmaddwd into the 8 features' int32
// sums: with ones, or with the sub-block scales of the K-quants in both 16-bit halves of a
// feature's lane, which applies them in the same instruction. Q8_0's signed weights take
// llama.cpp's sign trick (|w| times x with w's sign) and no offset. Then, per row and block,
// the same float steps as the VNNI kernel for 8 lanes.

// Up to 32 (16) bytes at p, zeros past `bytes`: a partial group's half is shorter.
inline __m256i load_upto32(const uint8_t* p, int64_t bytes) {
  if (bytes >= 32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) uint8_t buf[32] = {};
  std::memcpy(buf, p, bytes);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
}
inline __m128i load_upto16(const uint8_t* p, int64_t bytes) {
  if (bytes >= 16) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  alignas(16) uint8_t buf[16] = {};
  std::memcpy(buf, p, bytes);
  return _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
}
inline __m128i load_upto8(const uint8_t* p, int64_t bytes) {  // into the low 8 bytes
  if (bytes >= 8) return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return load_upto16(p, bytes);
}
inline __m256i broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline void store_lanes(float* out, int64_t lanes, __m256 v) {
  if (lanes >= 8) return _mm256_storeu_ps(out, v);
  alignas(32) float buf[8];
  _mm256_store_ps(buf, v);
  std::memcpy(out, buf, lanes * sizeof(float));
}
template <int I>
inline __m256i high_bits(__m256i v) {  // bits 2i, 2i + 1 of each byte to bits 4, 5
  const __m256i mask = _mm256_set1_epi8(0x30);
  if constexpr (I == 0) return _mm256_and_si256(_mm256_slli_epi16(v, 4), mask);
  else if constexpr (I == 1) return _mm256_and_si256(_mm256_slli_epi16(v, 2), mask);
  else if constexpr (I == 2) return _mm256_and_si256(v, mask);
  else return _mm256_and_si256(_mm256_srli_epi16(v, 2), mask);
}
inline void fifth_bits(__m256i bits, __m256i w[8]) {  // as the AVX-512 one
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(bits, 4), bit4));
  w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(bits, 3), bit4));
  w[2] = _mm256_or_si256(w[2], _mm256_and_si256(_mm256_slli_epi16(bits, 2), bit4));
  w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_slli_epi16(bits, 1), bit4));
  w[4] = _mm256_or_si256(w[4], _mm256_and_si256(bits, bit4));
  w[5] = _mm256_or_si256(w[5], _mm256_and_si256(_mm256_srli_epi16(bits, 1), bit4));
  w[6] = _mm256_or_si256(w[6], _mm256_and_si256(_mm256_srli_epi16(bits, 2), bit4));
  w[7] = _mm256_or_si256(w[7], _mm256_and_si256(_mm256_srli_epi16(bits, 3), bit4));
}

// Rows that a pass takes together: their accumulators, the 8 decoded quads and the
// temporaries fit AVX2's 16 registers.
constexpr int kLaneRows = 4;

// R rows against half `half` of a group of s features (blocks of 32).
template <int64_t QT, int R, int H = 1>
void half_rows_32(const QuantRows& x, int64_t r0, const uint8_t* group, int64_t s, int64_t half0,
                  float* out, int64_t out_stride) {
  constexpr int64_t kBytes = q8_block_bytes(QT);
  constexpr int32_t kOffset = QT == kQ4_0 ? 8 : QT == kQ5_0 ? 16 : 0;
  constexpr int64_t kScales = QT == kQ4_1 ? 4 : 2;
  const int64_t nb = x.nb;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 y[H][R];
  for (int hh = 0; hh < H; ++hh)
    for (int r = 0; r < R; ++r) y[hh][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* gb = group + b * kBytes * s;
    prefetch_range(gb + kPrefetchBytes, kBytes * s);
    const uint8_t* wq = gb + kScales * s;
    for (int hh = 0; hh < H; ++hh) {  // the halves this pass takes
      const int64_t half = half0 + hh, sh = std::min<int64_t>(8, s - 8 * half);
      __m256i w[8], wabs[8];
      if constexpr (QT == kQ8_0) {
        for (int p = 0; p < 8; ++p) {
          w[p] = _mm256_xor_si256(load_upto32(wq + 4 * p * s + 32 * half, 4 * sh),
                                  _mm256_set1_epi8(static_cast<char>(0x80)));  // signed again
          wabs[p] = _mm256_sign_epi8(w[p], w[p]);
        }
      } else {
        const uint8_t* nib = QT == kQ5_0 ? wq + 4 * s : wq;
        for (int v = 0; v < 4; ++v) {
          const __m256i raw = load_upto32(nib + 4 * v * s + 32 * half, 4 * sh);
          w[2 * v] = _mm256_and_si256(raw, low4);
          w[2 * v + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        }
        if constexpr (QT == kQ5_0) fifth_bits(load_upto32(wq + 32 * half, 4 * sh), w);
      }
      const __m256 d = _mm256_cvtph_ps(load_upto16(gb + 16 * half, 2 * sh));
      __m256 m = _mm256_setzero_ps();
      if constexpr (QT == kQ4_1) m = _mm256_cvtph_ps(load_upto16(gb + 2 * s + 16 * half, 2 * sh));
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * nb + b;
        const int8_t* xr = x.q.data() + (r0 + r) * x.k + b * kBlock;
        __m256i sum;
        if constexpr (QT == kQ8_0) {
          sum = _mm256_setzero_si256();
          for (int p = 0; p < 8; ++p)
            sum = _mm256_add_epi32(
                sum, _mm256_madd_epi16(_mm256_maddubs_epi16(
                                           wabs[p], _mm256_sign_epi8(broadcast4(xr + 4 * p), w[p])),
                                       ones));
        } else if constexpr (QT == kQ5_0) {
          __m256i a = _mm256_maddubs_epi16(w[0], broadcast4(xr));
          __m256i c = _mm256_maddubs_epi16(w[4], broadcast4(xr + 16));
          for (int p = 1; p < 4; ++p) {
            a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w[p], broadcast4(xr + 4 * p)));
            c = _mm256_add_epi16(c, _mm256_maddubs_epi16(w[4 + p], broadcast4(xr + 16 + 4 * p)));
          }
          sum = _mm256_add_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(c, ones));
        } else {
          __m256i a = _mm256_maddubs_epi16(w[0], broadcast4(xr));
          for (int p = 1; p < 8; ++p)
            a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w[p], broadcast4(xr + 4 * p)));
          sum = _mm256_madd_epi16(a, ones);
        }
        if constexpr (kOffset != 0)
          sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(kOffset * x.sums[i]));
        y[hh][r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.ds[2 * i])),
                                   _mm256_cvtepi32_ps(sum), y[hh][r]);
        if constexpr (QT == kQ4_1)
          y[hh][r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.ds[2 * i + 1]), y[hh][r]);
      }
    }
  }
  for (int hh = 0; hh < H; ++hh)
    for (int r = 0; r < R; ++r)
      store_lanes(out + (r0 + r) * out_stride + 8 * (half0 + hh),
                  std::min<int64_t>(8, s - 8 * (half0 + hh)), y[hh][r]);
}

// R rows against half `half` of a group of s features (Q4_K, Q6_K).
template <int64_t QT, int R, int H = 1>
void half_rows_k(const QuantRowsK& x, int64_t r0, const uint8_t* group, int64_t s, int64_t half0,
                 float* out, int64_t out_stride) {
  constexpr int64_t kBytes = q8_block_bytes(QT);
  const int64_t nb = x.nb;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 y[H][R];
  for (int hh = 0; hh < H; ++hh)
    for (int r = 0; r < R; ++r) y[hh][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* sb = group + b * kBytes * s;
    prefetch_range(sb + kPrefetchBytes, kBytes * s);
    const int8_t* qx = x.q.data() + r0 * x.k + b * kSuper;
    for (int hh = 0; hh < H; ++hh) {  // the halves this pass takes
      const int64_t half = half0 + hh, sh = std::min<int64_t>(8, s - 8 * half);
      __m256i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
      if constexpr (QT == kQ4_K || QT == kQ5_K) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          // each feature's sub-block scale in both 16-bit halves of its lane
          const __m256i sc32 = _mm256_cvtepu8_epi32(load_upto8(sb + (4 + j) * s + 8 * half, sh));
          const __m256i sc = _mm256_or_si256(sc32, _mm256_slli_epi32(sc32, 16));
          const uint8_t* wj = sb + ((QT == kQ5_K ? 52 : 20) + 16 * j) * s;
          __m256i w[8];
          for (int v = 0; v < 4; ++v) {
            const __m256i raw = load_upto32(wj + 4 * v * s + 32 * half, 4 * sh);
            w[2 * v] = _mm256_and_si256(raw, low4);
            w[2 * v + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
          }
          if constexpr (QT == kQ5_K)
            fifth_bits(load_upto32(sb + (20 + 4 * j) * s + 32 * half, 4 * sh), w);
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = qx + r * x.k + 32 * j;
            // 16-bit pair sums of 8 quads of nibbles (30,480 at most), of 4 of Q5_K's 0..31
            __m256i a = _mm256_maddubs_epi16(w[0], broadcast4(xr));
            __m256i c = _mm256_maddubs_epi16(w[4], broadcast4(xr + 16));
            for (int p = 1; p < 4; ++p) {
              a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w[p], broadcast4(xr + 4 * p)));
              c = _mm256_add_epi16(c, _mm256_maddubs_epi16(w[4 + p], broadcast4(xr + 16 + 4 * p)));
            }
            if constexpr (QT == kQ4_K) {
              sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_add_epi16(a, c), sc));
            } else {
              sumi[r] = _mm256_add_epi32(
                  sumi[r], _mm256_add_epi32(_mm256_madd_epi16(a, sc), _mm256_madd_epi16(c, sc)));
            }
          }
        }
        const __m256 d = _mm256_cvtph_ps(load_upto16(sb + 16 * half, 2 * sh));
        const __m256 dmin = _mm256_cvtph_ps(load_upto16(sb + 2 * s + 16 * half, 2 * sh));
        __m256i m[4];
        for (int t = 0; t < 4; ++t)
          m[t] = _mm256_cvtepu8_epi16(load_upto16(sb + (12 + 2 * t) * s + 16 * half, 2 * sh));
        for (int r = 0; r < R; ++r) {
          const int64_t i = (r0 + r) * nb + b;
          const int16_t* s32 = &x.sums32[8 * i];
          __m256i mins = _mm256_madd_epi16(m[0], broadcast4(s32));
          for (int t = 1; t < 4; ++t)
            mins = _mm256_add_epi32(mins, _mm256_madd_epi16(m[t], broadcast4(s32 + 2 * t)));
          const __m256 dx = _mm256_set1_ps(x.d[i]);
          y[hh][r] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(sumi[r]), y[hh][r]);
          y[hh][r] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(mins), y[hh][r]);
        }
      } else {
        // scale pairs (sub-blocks 2c, 2c + 1) duplicated: each in both halves of the lane
        const __m256i dup0 = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                              0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
        const __m256i dup1 = _mm256_add_epi8(dup0, _mm256_set1_epi8(2));
        __m256i sp[8];
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
          sp[c] = _mm256_cvtepi8_epi16(load_upto16(sb + (2 + 2 * c) * s + 16 * half, 2 * sh));
          const __m256i sc0 = _mm256_shuffle_epi8(sp[c], dup0),
                        sc1 = _mm256_shuffle_epi8(sp[c], dup1);
          const uint8_t* wc = sb + (18 + 24 * c) * s;
          const __m256i h0 = load_upto32(wc + 16 * s + 32 * half, 4 * sh);
          const __m256i h1 = load_upto32(wc + 20 * s + 32 * half, 4 * sh);
          __m256i w[8];
          for (int v = 0; v < 4; ++v) {
            const __m256i raw = load_upto32(wc + 4 * v * s + 32 * half, 4 * sh);
            const __m256i lo = _mm256_and_si256(raw, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            const __m256i hb = v < 2 ? h0 : h1;
            if (v % 2 == 0) {
              w[2 * v] = _mm256_or_si256(lo, high_bits<0>(hb));
              w[2 * v + 1] = _mm256_or_si256(hi, high_bits<1>(hb));
            } else {
              w[2 * v] = _mm256_or_si256(lo, high_bits<2>(hb));
              w[2 * v + 1] = _mm256_or_si256(hi, high_bits<3>(hb));
            }
          }
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = qx + r * x.k + 32 * c;
            __m256i t[4];  // quads 0-1, 2-3 (sub-block 2c), 4-5, 6-7 (2c + 1): 2 x 16,002 at most
            for (int q = 0; q < 4; ++q)
              t[q] =
                  _mm256_add_epi16(_mm256_maddubs_epi16(w[2 * q], broadcast4(xr + 8 * q)),
                                   _mm256_maddubs_epi16(w[2 * q + 1], broadcast4(xr + 8 * q + 4)));
            sumi[r] = _mm256_add_epi32(
                sumi[r],
                _mm256_add_epi32(
                    _mm256_add_epi32(_mm256_madd_epi16(t[0], sc0), _mm256_madd_epi16(t[1], sc0)),
                    _mm256_add_epi32(_mm256_madd_epi16(t[2], sc1), _mm256_madd_epi16(t[3], sc1))));
          }
        }
        const __m256 d = _mm256_cvtph_ps(load_upto16(sb + 16 * half, 2 * sh));
        for (int r = 0; r < R; ++r) {
          const int64_t i = (r0 + r) * nb + b;
          const int16_t* s16 = &x.sums16[16 * i];
          __m256i offset = _mm256_madd_epi16(sp[0], broadcast4(s16));
          for (int t = 1; t < 8; ++t)
            offset = _mm256_add_epi32(offset, _mm256_madd_epi16(sp[t], broadcast4(s16 + 2 * t)));
          const __m256i sum = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(offset, 5));
          y[hh][r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.d[i])),
                                     _mm256_cvtepi32_ps(sum), y[hh][r]);
        }
      }
    }
  }
  for (int hh = 0; hh < H; ++hh)
    for (int r = 0; r < R; ++r)
      store_lanes(out + (r0 + r) * out_stride + 8 * (half0 + hh),
                  std::min<int64_t>(8, s - 8 * (half0 + hh)), y[hh][r]);
}

// A kernel of this layout as a type: Kernel::run<R, H>(x, r0, group, s, half, out, stride).
template <int64_t QT>
struct Lanes32 {
  template <int R, int H = 1>
  static void run(const QuantRows& x, int64_t r0, const uint8_t* group, int64_t s, int64_t half,
                  float* out, int64_t stride) {
    half_rows_32<QT, R, H>(x, r0, group, s, half, out, stride);
  }
};
template <int64_t QT>
struct LanesK {
  template <int R, int H = 1>
  static void run(const QuantRowsK& x, int64_t r0, const uint8_t* group, int64_t s,
                  int64_t half, float* out, int64_t stride) {
    half_rows_k<QT, R, H>(x, r0, group, s, half, out, stride);
  }
};

// The groups shared among the threads. In each, pairs of rows take a half of the group at a
// time (kLaneRows, then 2: their accumulators and the decoded quads fill the 16
// registers); a row left over takes both halves in one pass over the group's blocks.
template <class Kernel, class Rows>
void lanes_impl(const Rows& x, int64_t rows, const uint8_t* bp, int64_t row_bytes, float* op,
                int64_t n, int64_t ostride) {
  const int64_t groups = (n + kLaneGroup - 1) / kLaneGroup;
  freetoken::guided_for(groups, 1, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t s = std::min(kLaneGroup, n - g * kLaneGroup);
      const uint8_t* group = bp + g * kLaneGroup * row_bytes;
      float* o = op + g * kLaneGroup;
      const int64_t paired = rows - rows % 2;
      for (int64_t half = 0; paired > 0 && 8 * half < s; ++half) {
        int64_t r = 0;
        for (; r + kLaneRows <= paired; r += kLaneRows)
          Kernel::template run<kLaneRows>(x, r, group, s, half, o, ostride);
        if (r < paired) Kernel::template run<2>(x, r, group, s, half, o, ostride);
      }
      if (rows % 2 != 0) {
        if (s > 8) Kernel::template run<1, 2>(x, paired, group, s, 0, o, ostride);
        else Kernel::template run<1>(x, paired, group, s, 0, o, ostride);
      }
    }
  });
}
#endif

// One part (or the whole) of a product: n features of type qt, their blocks at bp, into out
// columns starting at op (row stride ostride). The rows are quantized at most once per call
// into each activation type the parts need.
struct Activations {
  const float* x;
  int64_t rows, k;
  QuantRows* q = nullptr;
  QuantRowsK* qk = nullptr;
  bool have_q = false, have_qk = false;
};

void q8_part(Activations& a, const uint8_t* bp, int64_t n, int64_t row_bytes, int64_t qt,
             float* op, int64_t ostride) {
  if (is_k_quant(qt)) {
    if (!a.have_qk) quantize_rows_k(a.x, a.rows, a.k, *a.qk);
    a.have_qk = true;
  } else {
    if (!a.have_q) quantize_rows(a.x, a.rows, a.k, *a.q);
    a.have_q = true;
  }
  switch (qt) {
#if defined(FREETOKEN_Q8_VNNI)
    case kQ4_0: vnni_impl<Vnni32<kQ4_0>>(*a.q, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ4_1: vnni_impl<Vnni32<kQ4_1>>(*a.q, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ5_0: vnni_impl<Vnni32<kQ5_0>>(*a.q, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ8_0: vnni_impl<Vnni32<kQ8_0>>(*a.q, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ4_K: vnni_impl<VnniK<kQ4_K>>(*a.qk, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ5_K: vnni_impl<VnniK<kQ5_K>>(*a.qk, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ6_K: vnni_impl<VnniK<kQ6_K>>(*a.qk, a.rows, bp, row_bytes, op, n, ostride); break;
#elif defined(FREETOKEN_AVX2)
    case kQ4_0: lanes_impl<Lanes32<kQ4_0>>(*a.q, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ4_1: lanes_impl<Lanes32<kQ4_1>>(*a.q, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ5_0: lanes_impl<Lanes32<kQ5_0>>(*a.q, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ8_0: lanes_impl<Lanes32<kQ8_0>>(*a.q, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ4_K: lanes_impl<LanesK<kQ4_K>>(*a.qk, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ5_K: lanes_impl<LanesK<kQ5_K>>(*a.qk, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ6_K: lanes_impl<LanesK<kQ6_K>>(*a.qk, a.rows, bp, row_bytes, op, n, ostride); break;
#else
    case kQ4_0: q8_impl<kQ4_0>(*a.q, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ4_1: q8_impl<kQ4_1>(*a.q, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ5_0: q8_impl<kQ5_0>(*a.q, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ8_0: q8_impl<kQ8_0>(*a.q, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ4_K: q8k_impl<kQ4_K>(*a.qk, a.rows, bp, row_bytes, op, n, ostride); break;
    case kQ6_K: q8k_impl<kQ6_K>(*a.qk, a.rows, bp, row_bytes, op, n, ostride); break;
#endif
    default: TORCH_CHECK(false, "gguf_linear_q8: no 8-bit kernel for ggml type ", qt);
  }
}

void check_part(int64_t qt, int64_t k, int64_t row_bytes) {
  TORCH_CHECK(q8_block_bytes(qt) != 0, "gguf_linear_q8: no 8-bit kernel for ggml type ", qt,
              " (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K have one; Q5_K too with AVX2)");
  TORCH_CHECK(k % q8_block_weights(qt) == 0, "gguf_linear_q8: K must be a multiple of ",
              q8_block_weights(qt), " for ggml type ", qt);
  TORCH_CHECK(row_bytes == q8_row_bytes(qt, k),
              "gguf_linear_q8: blocks must be uint8 [N, K / block weights * block bytes]");
}

// The file's Q4_K super-block (d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
// nibbles) with its scales and mins unpacked to a byte each (llama.cpp's get_scale_min_k4),
// 8 scales then 8 mins: 148 bytes. Unpacking took ~25 of the ~90 instructions of a
// super-block at one row, for 3 % more bytes.
void unpack_q4_k(const uint8_t* in, uint8_t* out) {
  std::memcpy(out, in, 4);
  const uint8_t* s = in + 4;
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      out[4 + j] = s[j] & 63;
      out[12 + j] = s[j + 4] & 63;
    } else {
      out[4 + j] = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
      out[12 + j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }

  }
  std::memcpy(out + 20, in + 16, 128);
}

// unpack_q4_k undone: 148 bytes back to the file's 144 (llama.cpp's packing of the 6-bit
// scales and mins: the low six bits of scales and mins 0-3 in bytes 0-7, the high two bits
// of scales and mins 4-7 above them, their low four bits in bytes 8-11).
void pack_q4_k(const uint8_t* in, uint8_t* out) {
  std::memcpy(out, in, 4);
  const uint8_t* sc = in + 4;
  const uint8_t* m = in + 12;
  uint8_t* s = out + 4;
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>((sc[j] & 63) | (sc[j + 4] >> 4) << 6);
    s[j + 4] = static_cast<uint8_t>((m[j] & 63) | (m[j + 4] >> 4) << 6);
    s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0x0F) | (m[j + 4] & 0x0F) << 4);
  }
  std::memcpy(out + 16, in + 20, 128);
}

#ifdef FREETOKEN_AVX2
// One feature's super-block of the file (q8_layout's input: kernel blocks, the file's
// bytes) into its place in a group of s features of the VNNI layout.
template <int64_t QT>
void vnni_layout_one(const uint8_t* blk, int64_t f, int64_t s, uint8_t* sb) {
  if constexpr (QT == kQ4_K || QT == kQ5_K) {
    uint8_t u[148];
    if constexpr (QT == kQ4_K) {
      unpack_q4_k(blk, u);  // d, dmin, 8 scales, 8 mins, the 128 bytes of nibbles
    } else {
      // Q5_K: Q4_K's head and nibbles, 32 bytes of fifth bits (qh) between them
      uint8_t q4k[144];
      std::memcpy(q4k, blk, 16);
      std::memcpy(q4k + 16, blk + 48, 128);
      unpack_q4_k(q4k, u);
      const uint8_t* qh = blk + 16;  // bit j of qh[l]: weight l of sub-block j
      for (int j = 0; j < 8; ++j)
        for (int e = 0; e < 4; ++e) {
          uint8_t byte = 0;
          for (int p = 0; p < 8; ++p) byte |= static_cast<uint8_t>(((qh[4 * p + e] >> j) & 1) << p);
          sb[(20 + 4 * j) * s + 4 * f + e] = byte;
        }
    }
    std::memcpy(sb + 2 * f, u, 2);
    std::memcpy(sb + 2 * s + 2 * f, u + 2, 2);
    for (int j = 0; j < 8; ++j) {
      sb[(4 + j) * s + f] = u[4 + j];
      sb[(12 + 2 * (j / 2)) * s + 2 * f + j % 2] = u[12 + j];
    }
    for (int j = 0; j < 8; ++j)
      for (int v = 0; v < 4; ++v)
        for (int e = 0; e < 4; ++e) {
          auto q = [&](int l) {  // weight l of sub-block j
            const uint8_t byte = u[20 + 32 * (j / 2) + l];
            return j % 2 == 0 ? byte & 0x0F : byte >> 4;
          };
          sb[((QT == kQ5_K ? 52 : 20) + 16 * j) * s + 4 * v * s + 4 * f + e] =
              static_cast<uint8_t>(q(8 * v + e) | q(8 * v + 4 + e) << 4);
        }
  } else {
    std::memcpy(sb + 2 * f, blk + 208, 2);
    for (int j = 0; j < 16; ++j) sb[(2 + 2 * (j / 2)) * s + 2 * f + j % 2] = blk[192 + j];
    for (int c = 0; c < 8; ++c) {
      const int jj = c / 4, t = c % 4;
      uint8_t q[32];
      for (int l = 0; l < 32; ++l) {
        const uint8_t lo = blk[64 * jj + 32 * (t % 2) + l], hi = blk[128 + 32 * jj + l];
        q[l] = static_cast<uint8_t>((t < 2 ? lo & 0x0F : lo >> 4) | ((hi >> (2 * t)) & 3) << 4);
      }
      uint8_t* wc = sb + (18 + 24 * c) * s;
      for (int v = 0; v < 4; ++v)
        for (int e = 0; e < 4; ++e)
          wc[4 * v * s + 4 * f + e] =
              static_cast<uint8_t>((q[8 * v + e] & 0x0F) | (q[8 * v + 4 + e] & 0x0F) << 4);
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 4; ++e) {
          uint8_t byte = 0;
          for (int i = 0; i < 4; ++i)
            byte |= static_cast<uint8_t>((q[4 * (4 * h + i) + e] >> 4) << (2 * i));
          wc[(16 + 4 * h) * s + 4 * f + e] = byte;
        }
    }
  }
}

// Kernel-layout blocks (interleaved by four, the file's super-blocks) of n features in the
// VNNI layout above.
template <int64_t QT>
void vnni_layout(const at::Tensor& blocks, at::Tensor& out) {
  constexpr int64_t kFileBytes = kernel_block_bytes(QT);
  const int64_t n = blocks.size(0), nb = blocks.size(1) / kFileBytes;
  const int64_t row_bytes = nb * q8_block_bytes(QT);
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const int64_t groups = (n + kLaneGroup - 1) / kLaneGroup;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t s = std::min(kLaneGroup, n - g * kLaneGroup);
      uint8_t* group = op + g * kLaneGroup * row_bytes;
      for (int64_t f = 0; f < s; ++f) {
        const FeatureBlocks fb =
            feature_blocks(in, n, blocks.size(1), kFileBytes, g * kLaneGroup + f);
        for (int64_t b = 0; b < nb; ++b)
          vnni_layout_one<QT>(fb.first + b * fb.stride, f, s, group + b * q8_block_bytes(QT) * s);
      }
    }
  });
}
// One feature's block of 32 of the file (Q4_1 with its float16 scales) into its place in a
// group of s features of the VNNI layout (group_rows_vnni32).
template <int64_t QT>
void vnni_layout32_one(const uint8_t* blk, int64_t f, int64_t s, uint8_t* gb) {
  int q[32];  // the unsigned quants
  std::memcpy(gb + 2 * f, blk, 2);
  if constexpr (QT == kQ8_0) {
    for (int j = 0; j < 32; ++j) q[j] = blk[2 + j] ^ 0x80;
    for (int p = 0; p < 8; ++p)
      for (int e = 0; e < 4; ++e)
        gb[(2 + 4 * p) * s + 4 * f + e] = static_cast<uint8_t>(q[4 * p + e]);
    return;
  }
  const uint8_t* qs = blk + (QT == kQ4_0 ? 2 : QT == kQ4_1 ? 4 : 6);
  for (int j = 0; j < 16; ++j) {
    q[j] = qs[j] & 0x0F;
    q[j + 16] = qs[j] >> 4;
  }
  int64_t nibbles = 2;
  if constexpr (QT == kQ4_1) {
    std::memcpy(gb + 2 * s + 2 * f, blk + 2, 2);
    nibbles = 4;
  } else if constexpr (QT == kQ5_0) {
    uint32_t bits;
    std::memcpy(&bits, blk + 2, 4);
    for (int e = 0; e < 4; ++e) {
      uint8_t byte = 0;
      for (int p = 0; p < 8; ++p) byte |= static_cast<uint8_t>(((bits >> (4 * p + e)) & 1) << p);
      gb[2 * s + 4 * f + e] = byte;
    }
    nibbles = 6;
  }
  for (int v = 0; v < 4; ++v)
    for (int e = 0; e < 4; ++e)
      gb[(nibbles + 4 * v) * s + 4 * f + e] =
          static_cast<uint8_t>(q[8 * v + e] | q[8 * v + 4 + e] << 4);
}

template <int64_t QT>
void vnni_layout32(const at::Tensor& blocks, at::Tensor& out) {
  constexpr int64_t kBytes = q8_block_bytes(QT);
  const int64_t n = blocks.size(0), nb = blocks.size(1) / kBytes, row_bytes = blocks.size(1);
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const int64_t groups = (n + kLaneGroup - 1) / kLaneGroup;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t s = std::min(kLaneGroup, n - g * kLaneGroup);
      uint8_t* group = op + g * kLaneGroup * row_bytes;
      for (int64_t f = 0; f < s; ++f) {
        const FeatureBlocks fb = feature_blocks(in, n, row_bytes, kBytes, g * kLaneGroup + f);
        for (int64_t b = 0; b < nb; ++b)
          vnni_layout32_one<QT>(fb.first + b * fb.stride, f, s, group + b * kBytes * s);
      }
    }
  });
}

// The lanes layout undone for one feature: feature f's block (super-block) of a group of s
// features at `gb` (what vnni_layout_one / vnni_layout32_one wrote there) as the file
// stores it, into `unit` (file_block below: a tied embedding decodes its rows from the
// output head's blocks).
template <int64_t QT>
void lanes_file_block(const uint8_t* gb, int64_t f, int64_t s, uint8_t* unit) {
  if constexpr (QT == kQ4_K || QT == kQ5_K) {
    // Q4_K: d@0, dmin@2, scales[12]@4, qs[128]@16; Q5_K: qh[32]@16, then qs[128]@48
    uint8_t u[148];  // unpack_q4_k's: d, dmin, 8 scales, 8 mins, the nibbles
    std::memcpy(u, gb + 2 * f, 2);
    std::memcpy(u + 2, gb + 2 * s + 2 * f, 2);
    for (int j = 0; j < 8; ++j) {
      u[4 + j] = gb[(4 + j) * s + f];
      u[12 + j] = gb[(12 + 2 * (j / 2)) * s + 2 * f + j % 2];
    }
    std::memset(u + 20, 0, 128);
    for (int j = 0; j < 8; ++j)
      for (int v = 0; v < 4; ++v)
        for (int e = 0; e < 4; ++e) {
          const uint8_t byte = gb[((QT == kQ5_K ? 52 : 20) + 16 * j + 4 * v) * s + 4 * f + e];
          const int shift = j % 2 == 0 ? 0 : 4;  // weight l of sub-block j: a nibble of qs
          u[20 + 32 * (j / 2) + 8 * v + e] |= static_cast<uint8_t>((byte & 0x0F) << shift);
          u[20 + 32 * (j / 2) + 8 * v + 4 + e] |= static_cast<uint8_t>((byte >> 4) << shift);
        }
    if constexpr (QT == kQ4_K) {
      pack_q4_k(u, unit);
    } else {
      uint8_t q4k[144];
      pack_q4_k(u, q4k);
      std::memcpy(unit, q4k, 16);
      std::memcpy(unit + 48, q4k + 16, 128);
      uint8_t* qh = unit + 16;  // bit j of qh[l]: weight l of sub-block j
      std::memset(qh, 0, 32);
      for (int j = 0; j < 8; ++j)
        for (int e = 0; e < 4; ++e) {
          const uint8_t byte = gb[(20 + 4 * j) * s + 4 * f + e];
          for (int p = 0; p < 8; ++p) qh[4 * p + e] |= static_cast<uint8_t>(((byte >> p) & 1) << j);
        }
    }
  } else if constexpr (QT == kQ6_K) {  // ql[128]@0, qh[64]@128, scales[16]@192, d@208
    std::memset(unit, 0, 192);
    std::memcpy(unit + 208, gb + 2 * f, 2);
    for (int j = 0; j < 16; ++j) unit[192 + j] = gb[(2 + 2 * (j / 2)) * s + 2 * f + j % 2];
    for (int c = 0; c < 8; ++c) {
      const int jj = c / 4, t = c % 4;
      const uint8_t* wc = gb + (18 + 24 * c) * s;
      uint8_t q[32];  // the chunk's 6-bit weights
      for (int v = 0; v < 4; ++v)
        for (int e = 0; e < 4; ++e) {
          const uint8_t byte = wc[4 * v * s + 4 * f + e];
          q[8 * v + e] = byte & 0x0F;
          q[8 * v + 4 + e] = byte >> 4;
        }
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 4; ++e) {
          const uint8_t byte = wc[(16 + 4 * h) * s + 4 * f + e];
          for (int i = 0; i < 4; ++i)
            q[4 * (4 * h + i) + e] |= static_cast<uint8_t>(((byte >> (2 * i)) & 3) << 4);
        }
      for (int l = 0; l < 32; ++l) {
        unit[64 * jj + 32 * (t % 2) + l] |= static_cast<uint8_t>((q[l] & 0x0F) << (t < 2 ? 0 : 4));
        unit[128 + 32 * jj + l] |= static_cast<uint8_t>((q[l] >> 4) << (2 * t));
      }
    }
  } else {
    std::memcpy(unit, gb + 2 * f, 2);  // d@0
    if constexpr (QT == kQ8_0) {  // qs[32]@2, stored plus 128
      for (int p = 0; p < 8; ++p)
        for (int e = 0; e < 4; ++e) unit[2 + 4 * p + e] = gb[(2 + 4 * p) * s + 4 * f + e] ^ 0x80;
      return;
    }
    int64_t nibbles = 2;  // Q4_0: qs[16]@2; Q4_1: m@2, qs@4; Q5_0: qh[4]@2, qs@6
    if constexpr (QT == kQ4_1) {
      std::memcpy(unit + 2, gb + 2 * s + 2 * f, 2);
      nibbles = 4;
    } else if constexpr (QT == kQ5_0) {
      uint32_t bits = 0;
      for (int e = 0; e < 4; ++e)
        for (int p = 0; p < 8; ++p)
          bits |= static_cast<uint32_t>((gb[2 * s + 4 * f + e] >> p) & 1) << (4 * p + e);
      std::memcpy(unit + 2, &bits, 4);
      nibbles = 6;
    }
    uint8_t q[32];
    for (int v = 0; v < 4; ++v)
      for (int e = 0; e < 4; ++e) {
        const uint8_t byte = gb[(nibbles + 4 * v) * s + 4 * f + e];
        q[8 * v + e] = byte & 0x0F;
        q[8 * v + 4 + e] = byte >> 4;
      }
    uint8_t* qs = unit + nibbles;  // weight j < 16 the low nibble of qs[j], j + 16 the high
    for (int j = 0; j < 16; ++j) qs[j] = static_cast<uint8_t>(q[j] | q[j + 16] << 4);
  }
}
#endif

// Block (super-block) b of feature `feature`, in gguf_q8_blocks' layout of n features of
// row_bytes each, as the file stores it.
template <int64_t QT>
void file_block(const uint8_t* blocks, int64_t n, int64_t row_bytes, int64_t feature, int64_t b,
                uint8_t* unit) {
  constexpr int64_t kBytes = q8_block_bytes(QT);
#ifdef FREETOKEN_AVX2
  const int64_t g = feature / kLaneGroup, s = std::min(kLaneGroup, n - g * kLaneGroup);
  lanes_file_block<QT>(blocks + g * kLaneGroup * row_bytes + b * kBytes * s, feature % kLaneGroup,
                       s, unit);
#else
  const FeatureBlocks fb = feature_blocks(blocks, n, row_bytes, kBytes, feature);
  if constexpr (QT == kQ4_K) pack_q4_k(fb.first + b * fb.stride, unit);
  else std::memcpy(unit, fb.first + b * fb.stride, kBytes);
#endif
}

// gguf_q8_embedding's rows of one type.
template <int64_t QT>
void q8_embedding_impl(const int64_t* ids, int64_t count, const uint8_t* blocks, int64_t n,
                       int64_t row_bytes, int64_t k, float* out) {
  using T = types::Type<QT>;
  const int64_t num_blocks = k / T::kWeights;
  at::parallel_for(0, count, 16, [&](int64_t t0, int64_t t1) {
    uint8_t unit[T::kBytes];
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = 0; b < num_blocks; ++b) {
        file_block<QT>(blocks, n, row_bytes, ids[t], b, unit);
        for (int sub = 0; sub < T::kSubs; ++sub)
          T::scalar(unit, sub, out + t * k + b * T::kWeights + sub * kBlock);
      }
  });
}

}  // namespace

namespace freetoken {

// Rows `ids` of the weight whose blocks are in gguf_q8_blocks' layout (n features, K
// inputs), decoded as the file's blocks are (gguf_types.h: gguf-py's values bit for bit):
// a tied embedding reads the output head's blocks instead of keeping the file's a second
// time.
at::Tensor gguf_q8_embedding(const at::Tensor& ids, const at::Tensor& blocks, int64_t qtype,
                             int64_t k) {
  TORCH_CHECK(q8_block_bytes(qtype) != 0, "gguf_q8_embedding: no 8-bit kernel for ggml type ",
              qtype);
  TORCH_CHECK(k > 0 && k % q8_block_weights(qtype) == 0, "gguf_q8_embedding: K must be a "
              "positive multiple of ", q8_block_weights(qtype), " for ggml type ", qtype);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) == q8_row_bytes(qtype, k),
              "gguf_q8_embedding: blocks must be gguf_q8_blocks [N, ", q8_row_bytes(qtype, k),
              "]");
  const int64_t n = blocks.size(0), count = ids.size(0);
  const int64_t* ip = embedding_ids(ids, n, "gguf_q8_embedding");
  at::Tensor out = at::empty({count, k}, ids.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  switch (qtype) {
    case kQ4_0: q8_embedding_impl<kQ4_0>(ip, count, bp, n, blocks.size(1), k, op); break;
    case kQ4_1: q8_embedding_impl<kQ4_1>(ip, count, bp, n, blocks.size(1), k, op); break;
    case kQ5_0: q8_embedding_impl<kQ5_0>(ip, count, bp, n, blocks.size(1), k, op); break;
    case kQ8_0: q8_embedding_impl<kQ8_0>(ip, count, bp, n, blocks.size(1), k, op); break;
    case kQ4_K: q8_embedding_impl<kQ4_K>(ip, count, bp, n, blocks.size(1), k, op); break;
#ifdef FREETOKEN_AVX2
    case kQ5_K: q8_embedding_impl<kQ5_K>(ip, count, bp, n, blocks.size(1), k, op); break;
#endif
    default: q8_embedding_impl<kQ6_K>(ip, count, bp, n, blocks.size(1), k, op); break;
  }
  return out;
}

// Bytes a feature of a weight of K inputs of this type in the layout gguf_linear_q8 reads
// (gguf_q8_blocks' columns); 0 where the type has no 8-bit kernel or K is not whole blocks.
int64_t gguf_q8_row_bytes(int64_t qtype, int64_t k) {
  if (q8_block_bytes(qtype) == 0 || k % q8_block_weights(qtype) != 0) return 0;
  return q8_row_bytes(qtype, k);
}

// Kernel-layout blocks (interleaved, the file's bytes; Q4_1 with the file's float16 scales)
// in the layout gguf_linear_q8 reads, written into `out` (gguf_q8_row_bytes' shape: a
// model's load writes each linear's blocks into their place in its arena): with AVX2 the
// lanes layout above; without, the same blocks but Q4_K's, whose super-blocks grow from
// 144 to 148 bytes (unpack_q4_k) in place of each, so the groups' interleaving holds.
void gguf_q8_blocks_into(const at::Tensor& blocks, int64_t qtype, at::Tensor out) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "gguf_q8_blocks: blocks must be a contiguous uint8 [N, row bytes] tensor");
  const int64_t file_bytes = kernel_block_bytes(qtype);
  TORCH_CHECK(file_bytes != 0, "gguf_q8_blocks: no 8-bit kernel for ggml type ", qtype);
  TORCH_CHECK(blocks.size(1) % file_bytes == 0, "gguf_q8_blocks: rows must be whole ",
              is_k_quant(qtype) ? "super-blocks" : "blocks");
  const int64_t row_bytes = blocks.size(1) / file_bytes * q8_block_bytes(qtype);
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == blocks.size(0) && out.size(1) == row_bytes,
              "gguf_q8_blocks: out must be a contiguous uint8 [", blocks.size(0), ", ", row_bytes,
              "] tensor");
#ifdef FREETOKEN_AVX2
  switch (qtype) {
    case kQ4_K: return vnni_layout<kQ4_K>(blocks, out);
    case kQ5_K: return vnni_layout<kQ5_K>(blocks, out);
    case kQ6_K: return vnni_layout<kQ6_K>(blocks, out);
    case kQ4_0: return vnni_layout32<kQ4_0>(blocks, out);
    case kQ4_1: return vnni_layout32<kQ4_1>(blocks, out);
    case kQ5_0: return vnni_layout32<kQ5_0>(blocks, out);
    default: return vnni_layout32<kQ8_0>(blocks, out);
  }
#else
  if (qtype != kQ4_K) {
    out.copy_(blocks);
    return;
  }
  const int64_t units = blocks.size(0) * (blocks.size(1) / 144);
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, units, 4096, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) unpack_q4_k(in + u * 144, op + u * 148);
  });
#endif
}

at::Tensor gguf_q8_blocks(const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(blocks.dim() == 2, "gguf_q8_blocks: blocks must be a contiguous uint8 [N, row "
              "bytes] tensor");
  const int64_t file_bytes = kernel_block_bytes(qtype);
  TORCH_CHECK(file_bytes != 0, "gguf_q8_blocks: no 8-bit kernel for ggml type ", qtype);
  at::Tensor out = at::zeros({blocks.size(0), blocks.size(1) / file_bytes * q8_block_bytes(qtype)},
                             blocks.options());
  gguf_q8_blocks_into(blocks, qtype, out);
  return out;
}

bool q8_linear_supports(int64_t qtype) { return q8_block_bytes(qtype) != 0; }

void gguf_linear_q8(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, at::Tensor out) {
  TORCH_CHECK(
      x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
      "gguf_linear_q8: x must be a contiguous float32 [M, K] CPU tensor");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "gguf_linear_q8: blocks must be a contiguous uint8 [N, row bytes] tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == x.size(0),
              "gguf_linear_q8: out must be float32 [M, N]");
  const int64_t rows = x.size(0), k = x.size(1);
  // Reused across calls (120 linears a decode step); one per thread, as a team's members each
  // quantize the rows for themselves.
  thread_local QuantRows q;
  thread_local QuantRowsK qk;
  Activations a{x.data_ptr<float>(), rows, k, &q, &qk};
  float* op = out.data_ptr<float>();
  const uint8_t* base = blocks.data_ptr<uint8_t>();
  if (qtype == kParts) {
    // A linear of parts of different types side by side in the output (gguf_linear's
    // header: ops.h linear_parts).
    const std::vector<LinearPart> parts = linear_parts(blocks, "gguf_linear_q8");
    int64_t col = 0;
    for (const LinearPart& p : parts) {
      check_part(p.type, k, p.row_bytes);
      col += p.n;
    }
    TORCH_CHECK(col == out.size(1), "gguf_linear_q8: the parts' features do not fill out");
    if (rows == 0) return;
    col = 0;
    for (const LinearPart& p : parts) {
      q8_part(a, base + p.offset, p.n, p.row_bytes, p.type, op + col, out.size(1));
      col += p.n;
    }
    return;
  }
  check_part(qtype, k, blocks.size(1));
  TORCH_CHECK(out.size(1) == blocks.size(0), "gguf_linear_q8: out must be float32 [M, N]");
  if (rows == 0) return;
  q8_part(a, base, blocks.size(0), blocks.size(1), qtype, op, out.size(1));
}

}  // namespace freetoken

TORCH_LIBRARY_FRAGMENT(freetoken, m) {
  m.def("gguf_linear_q8(Tensor x, Tensor blocks, int qtype, Tensor(a!) out) -> ()",
        &freetoken::gguf_linear_q8);
  m.def("gguf_q8_blocks(Tensor blocks, int qtype) -> Tensor", &freetoken::gguf_q8_blocks);
  m.def("gguf_q8_blocks_into(Tensor blocks, int qtype, Tensor(a!) out) -> ()",
        &freetoken::gguf_q8_blocks_into);
  m.def("gguf_q8_row_bytes(int qtype, int k) -> int", &freetoken::gguf_q8_row_bytes);
  m.def("gguf_q8_embedding(Tensor ids, Tensor blocks, int qtype, int k) -> Tensor",
        &freetoken::gguf_q8_embedding);
  m.def("q8_linear_supports(int qtype) -> bool",
        [](int64_t qtype) { return freetoken::q8_linear_supports(qtype); });
}
