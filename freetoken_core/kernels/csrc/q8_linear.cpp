// y[M, N] = x[M, K] @ W[N, K]^T from GGUF blocks (Q4_1 or Q8_0) with 8-bit activations, the
// arithmetic of llama.cpp's CPU backend: each row of x is cut into blocks of 32, each block
// quantized to int8 with one float32 scale (dx = max|x| / 127, q = round(x / dx)), and every
// product of a weight block and an activation block is one integer dot product, scaled once:
//
//   Q8_0:  d * dx * sum_j q_j qx_j
//   Q4_1:  d * dx * sum_j q_j qx_j + m * dx * sum_j qx_j      (w_j = d q_j + m)
//
// Three to four times fewer instructions per weight than dequantizing to float32
// (gguf_linear.cpp), so one sequence's decode step is bound by reading the weights rather
// than by arithmetic. The price is the rounding of the activations to 8 bits (a relative
// error of up to 1/254 of each block's largest value): an opt-in numeric mode
// (`--activations q8`), measured against the exact path by bench/q8_quality.py.
//
// Batch invariance holds as in gguf_linear: each output y[m, n] is summed in one order
// whatever M is (per block: the integer dot product, exact; then acc = fma(d * dx, sum, acc)
// in 8 float lanes, block after block; the m terms, one product a block, added block after
// block; the two added last),
// and a row's quantization depends on that row alone.
//
// The blocks are the file's (20-byte Q4_1, file_block_bytes) in the kernels' interleaved
// layout (gguf_blocks.h): groups of four features, their blocks interleaved.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace {

using namespace freetoken::gguf;

// x quantized: per row, K int8 values and, per block of 32, the scale and the scaled sum.
struct QuantRows {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> ds;   // [M, K / 32, 2]: the scale dx, then dx * sum of the block's q
                           // (the Q4_1 m term's factor)
  int64_t k = 0, nb = 0;
};

// One row's block of 32: its scale, its int8 values, the scale times their sum. Both kept in
// float32, where llama.cpp's block_q8_1 keeps them as float16: rounding them to float16 here
// measured worse against the exact path (bench/q8_quality.py: perplexity +0.52 % instead of
// +0.05 %, 11 greedy answers of 64 identical instead of 13) and no closer to llama-server's
// answers (which differ in more than this: its KV cache is float16).
inline void quantize_block(const float* x, int8_t* q, float* d, float* s) {
#ifdef FREETOKEN_AVX2
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float max_abs = _mm_cvtss_f32(m4);
  const float dx = max_abs / 127.f;
  const __m256 id = _mm256_set1_ps(max_abs != 0.f ? 127.f / max_abs : 0.f);
  __m256i i[4];
  for (int j = 0; j < 4; ++j)
    i[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id),
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
  *d = dx;
  *s = dx * static_cast<float>(_mm_cvtsi128_si32(t));
#else
  float max_abs = 0.f;
  for (int j = 0; j < kBlock; ++j) max_abs = std::max(max_abs, std::fabs(x[j]));
  const float dx = max_abs / 127.f, id = max_abs != 0.f ? 127.f / max_abs : 0.f;
  int sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(x[j] * id));
    sum += q[j];
  }
  *d = dx;
  *s = dx * static_cast<float>(sum);
#endif
}

void quantize_rows(const float* x, int64_t rows, int64_t k, QuantRows& out) {
  out.k = k;
  out.nb = k / kBlock;
  out.q.resize(rows * k);
  out.ds.resize(rows * out.nb * 2);
  auto quantize = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      quantize_block(x + b * kBlock, out.q.data() + b * kBlock, &out.ds[2 * b],
                     &out.ds[2 * b + 1]);
  };
  // In a team every member quantizes all rows into its own copy (`out` is thread-local):
  // rows x K values, a few microseconds, instead of a barrier and a shared buffer.
  if (freetoken::in_team()) {
    quantize(0, rows * out.nb);
  } else {
    at::parallel_for(0, rows * out.nb, 256, quantize);
  }
}

#ifdef FREETOKEN_AVX2
// The weight block's 32 quants in one register: Q4_1 as unsigned bytes 0..15 in weight order
// (low nibbles are weights 0..15, high nibbles 16..31), Q8_0 as signed bytes.
template <int64_t QT>
inline __m256i block_quants(const uint8_t* block) {
  if constexpr (QT == kQ4_1) {
    // The 16 bytes in both halves (a load), the high half shifted (a blend keeps each half's
    // own): ~8 % fewer cycles a block than an insert of the shifted copy into the high half.
    const __m256i q = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4)));
    const __m256i both = _mm256_blend_epi32(q, _mm256_srli_epi16(q, 4), 0xF0);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  }
}

// sum_j w_j qx_j of one block as 8 int32 lanes (their total is the dot product). maddubs
// multiplies unsigned by signed bytes: Q4_1 quants are unsigned already; for Q8_0 the signs
// move onto the activations (|w| * sign(w) qx). No pair sum overflows int16: 2 * 128 * 127.
template <int64_t QT>
inline __m256i block_dot(__m256i w, __m256i wabs, __m256i qx) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (QT == kQ4_1) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, qx), ones);
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(qx, w)), ones);
  }
}

// The float16 scales of F (1 to 4) consecutive blocks (block b of F features of one group)
// as float32, in one conversion: d of feature 0, its m (Q4_1; the first quants for Q8_0), d
// of feature 1, ...
template <int64_t QT, int F>
inline __m256 block_scales_of(const uint8_t* first) {
  static_assert(F >= 1 && F <= 4, "one conversion holds four blocks' scales");
  int32_t head[F];
  for (int f = 0; f < F; ++f) std::memcpy(&head[f], first + f * file_block_bytes(QT), 4);
  __m128i h = _mm_cvtsi32_si128(head[0]);
  if constexpr (F > 1) h = _mm_insert_epi32(h, head[1], 1);
  if constexpr (F > 2) h = _mm_insert_epi32(h, head[2], 2);
  if constexpr (F > 3) h = _mm_insert_epi32(h, head[3], 3);
  return _mm256_cvtph_ps(h);
}

// out[f] = lane 2f of v in all 8 lanes, for f < F <= 4, by in-register shuffles.
template <int F>
inline void broadcast_even_lanes(__m256 v, __m256 out[F]) {
  const __m256 even0 = _mm256_permute_ps(v, 0x00);  // lane 0 of each half: features 0, 2
  out[0] = _mm256_permute2f128_ps(even0, even0, 0x00);
  if constexpr (F > 1) {
    const __m256 even2 = _mm256_permute_ps(v, 0xAA);  // lane 2 of each half: features 1, 3
    out[1] = _mm256_permute2f128_ps(even2, even2, 0x00);
    if constexpr (F > 2) out[2] = _mm256_permute2f128_ps(even0, even0, 0x11);
    if constexpr (F > 3) out[3] = _mm256_permute2f128_ps(even2, even2, 0x11);
  }
}

// Rows r0..r0+R of the quantized x against features [n0, n1), F at a time: R x F float
// accumulators, block after block: acc[r][f] = fma(d_f,b * dx_r,b, dot, acc[r][f]) in 8
// lanes; for Q4_1 the m term of each output summed block after block, mt += m_f,b * xs_r,b;
// y = hsum(acc) + mt. The F blocks' scales are converted together as the blocks are read and
// multiplied by the row's (dx, xs) pairs in one vector (d * dx and m * xs for every feature
// at once), instead of gathered ahead into arrays for 32 blocks and multiplied there. On the
// Zen 3 reference, one thread, one row, 1024 x 576 Q4_1 blocks in L2: ~7 cycles a block
// instead of ~10-13 (the exact kernel: ~10-12); the 30 layers' linears of one row from
// memory on two threads: 5.9 ms instead of 7.2 (exact: 7.0), paired in one process; the Q4_1
// unpacking of block_quants then took ~8 % off (5.6 against 6.1 cycles a block in L2).
template <int64_t QT, int R, int F>
void rows_q8(const QuantRows& x, int64_t r0, const uint8_t* blocks, int64_t features,
             int64_t row_bytes, float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  static_assert(kGroup % F == 0, "a pass's features must lie in one group");
  const int64_t nb = x.nb;
  const int64_t ahead = std::max<int64_t>(kPrefetchBytes, F * row_bytes);
  int64_t n = n0;
  if constexpr (F > 1) prefetch_range(blocks + n0 * row_bytes, kPrefetchBytes);
  const int8_t* qx_rows = x.q.data() + r0 * x.k;
  const float* dxs_rows = x.ds.data() + r0 * nb * 2;
  for (; n + F <= n1; n += F) {
    const FeatureBlocks fb = feature_blocks(blocks, features, row_bytes, file_block_bytes(QT), n);
    __m256 acc[R][F];
    __m256 mt[R];  // lane 2f + 1: feature f's m term (the even lanes are not used)
    for (int r = 0; r < R; ++r) {
      mt[r] = _mm256_setzero_ps();
      for (int f = 0; f < F; ++f) acc[r][f] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; ++b) {
      __m256i w[F], wabs[F];
      const uint8_t* first = fb.first + b * fb.stride;
      for (int f = 0; f < F; ++f) {
        const uint8_t* block = first + f * file_block_bytes(QT);
        _mm_prefetch(reinterpret_cast<const char*>(block + ahead), _MM_HINT_T0);
        w[f] = block_quants<QT>(block);
        if constexpr (QT == kQ8_0) wabs[f] = _mm256_sign_epi8(w[f], w[f]);
      }
      const __m256 dm = block_scales_of<QT, F>(first);
      for (int r = 0; r < R; ++r) {
        const __m256i qx = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(qx_rows + r * x.k + b * kBlock));
        // (d_f * dx, m_f * xs) for every feature f: the row's (dx, xs) pair in every two lanes
        double pair;
        std::memcpy(&pair, dxs_rows + (r * nb + b) * 2, sizeof pair);
        const __m256 scaled = _mm256_mul_ps(dm, _mm256_castpd_ps(_mm256_set1_pd(pair)));
        if constexpr (QT == kQ4_1) mt[r] = _mm256_add_ps(mt[r], scaled);
        __m256 ds[F];
        broadcast_even_lanes<F>(scaled, ds);
        for (int f = 0; f < F; ++f) {
          const __m256 dot = _mm256_cvtepi32_ps(block_dot<QT>(w[f], wabs[f], qx));
          acc[r][f] = _mm256_fmadd_ps(ds[f], dot, acc[r][f]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      alignas(32) float m_terms[8];
      _mm256_store_ps(m_terms, mt[r]);
      for (int f = 0; f < F; ++f) {
        float y = freetoken::vec::hsum(acc[r][f]);
        if constexpr (QT == kQ4_1) y += m_terms[2 * f + 1];
        out[(r0 + r) * out_stride + n + f] = y;
      }
    }
  }
  if constexpr (F > 1) {
    if (n < n1) rows_q8<QT, R, 1>(x, r0, blocks, features, row_bytes, out, out_stride, n, n1);
  }
}

// Features read side by side for one or two rows: four, a whole group of the blocks' layout,
// so that the blocks stream from memory in address order. Before the layout interleaved
// them, Q8_0 read one feature at a time for that reason (the tied head, 49,152 x 576, 30 MB,
// at one row: 1.5 ms against 2.2 with four rows a row apart); interleaved, four side by side
// take the same time for the head and the Q4_1 layers' linears ~15 % less (6.5 against 7.8
// ms, 30 layers at one row, paired in one process).
constexpr int kFewRowFeatures = 4;

// Features per chunk of work: their blocks (chunk x K / 32 x 20-34 bytes) stay in L1/L2
// while every group of rows passes over them.
constexpr int64_t kChunk = 32;

template <int64_t QT>
void q8_impl(const QuantRows& x, int64_t rows, const uint8_t* bp, int64_t row_bytes, float* op,
             int64_t n) {
  // Chunks handed out in shrinking pieces (parallel.h), as gguf_linear's: a thread that is
  // slowed does less of the product instead of holding up the step.
  freetoken::guided_for((n + kChunk - 1) / kChunk, 1, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * kChunk, n1 = std::min(n, n0 + kChunk);
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) rows_q8<QT, 4, 2>(x, r, bp, n, row_bytes, op, n, n0, n1);
      switch (rows - r) {
        case 1: rows_q8<QT, 1, kFewRowFeatures>(x, r, bp, n, row_bytes, op, n, n0, n1); break;
        case 2: rows_q8<QT, 2, kFewRowFeatures>(x, r, bp, n, row_bytes, op, n, n0, n1); break;
        case 3: rows_q8<QT, 3, 2>(x, r, bp, n, row_bytes, op, n, n0, n1); break;
        default: break;
      }
    }
  });
}
#else
// Without AVX2: the same formula, one output at a time (invariant too).
template <int64_t QT>
void q8_impl(const QuantRows& x, int64_t rows, const uint8_t* bp, int64_t row_bytes, float* op,
             int64_t n) {
  const int64_t nb = x.nb;
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t f = n0; f < n1; ++f) {
      const FeatureBlocks fb = feature_blocks(bp, n, row_bytes, file_block_bytes(QT), f);
      for (int64_t r = 0; r < rows; ++r) {
        float y = 0.f, mt = 0.f;
        const int8_t* qx = x.q.data() + r * x.k;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* block = fb.first + b * fb.stride;
          const float d = half_to_float(block);
          int dot = 0;
          if constexpr (QT == kQ4_1) {
            for (int j = 0; j < 16; ++j)
              dot += (block[4 + j] & 0x0F) * qx[b * kBlock + j] +
                     (block[4 + j] >> 4) * qx[b * kBlock + 16 + j];
            mt += half_to_float(block + 2) * x.ds[(r * nb + b) * 2 + 1];
          } else {
            const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
            for (int j = 0; j < kBlock; ++j) dot += q[j] * qx[b * kBlock + j];
          }
          y += d * x.ds[(r * nb + b) * 2] * static_cast<float>(dot);
        }
        op[r * n + f] = y + mt;
      }
    }
  });
}
#endif

}  // namespace

namespace freetoken {

void gguf_linear_q8(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, at::Tensor out) {
  TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "gguf_linear_q8: Q4_1 (3) or Q8_0 (8) blocks only");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
              x.is_contiguous(), "gguf_linear_q8: x must be a contiguous float32 [M, K] CPU tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "gguf_linear_q8: K must be a multiple of 32");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              blocks.size(1) == x.size(1) / kBlock * file_block_bytes(qtype),
              "gguf_linear_q8: blocks must be uint8 [N, K / 32 * block bytes]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == x.size(0) &&
              out.size(1) == blocks.size(0), "gguf_linear_q8: out must be float32 [M, N]");
  const int64_t rows = x.size(0), n = blocks.size(0);
  if (rows == 0) return;
  // Reused across calls (120 linears a decode step); one per thread, as a team's members each
  // quantize the rows for themselves.
  thread_local QuantRows q;
  quantize_rows(x.data_ptr<float>(), rows, x.size(1), q);
  if (qtype == kQ4_1) {
    q8_impl<kQ4_1>(q, rows, blocks.data_ptr<uint8_t>(), blocks.size(1), out.data_ptr<float>(), n);
  } else {
    q8_impl<kQ8_0>(q, rows, blocks.data_ptr<uint8_t>(), blocks.size(1), out.data_ptr<float>(), n);
  }
}

}  // namespace freetoken

TORCH_LIBRARY_FRAGMENT(freetoken, m) {
  m.def("gguf_linear_q8(Tensor x, Tensor blocks, int qtype, Tensor(a!) out) -> ()",
        &freetoken::gguf_linear_q8);
}
