// y[M, N] = x[M, K] @ W[N, K]^T with W kept as the GGUF file's blocks (Q4_1 or Q8_0), on
// the CPU, for any number of rows: decoding is bound by reading the weights, and these blocks
// are 5 (Q4_1) or 8.5 (Q8_0) bits per weight instead of 32; prefill chunks and large decode
// batches reuse each dequantized weight across rows.
//
// Each weight is dequantized exactly as gguf-py does it (Q4_1: d * q + m, Q8_0: d * q, in
// float32, two roundings), so the weights are the very values of the float32 checkpoint
// FreeToken converts the file into; only the order of the sums differs from a float32 GEMM.
// The vector paths compute Q4_1's d * q + m with one fused multiply-add, which gives the same
// float: d is a float16 value (11 significant bits; the kernels' Q4_1 blocks hold it as a
// float32) and q an integer of 4 bits, so d * q has at
// most 15 significant bits and is exact in float32; the first rounding of the two never
// rounds anything.
//
// Batch invariance: every output y[m, n] is summed in one order whatever M is and whichever
// path computes it: L float32 lanes accumulate x[m, Li:Li+L] * W[n, Li:Li+L] by FMA for
// i = 0, 1, ... in turn, then the lanes are added (hsum). L is the vector width the kernel
// is built for (16 with AVX-512, 8 with AVX2), fixed for a machine. So a row's result never depends
// on the other rows of its step (how many sequences decode together, how a prompt is cut
// into chunks, how much of it came from the prefix cache), and a seeded draw gives the same
// token in every batch.
//
// Two paths with that one order: up to kDirectRows rows, the blocks are dequantized into
// registers and used at once (one pass over the weights, the memory-bound decode case);
// above, each thread dequantizes a panel of kPanel output features into a float32 scratch
// once and runs a register-tiled kernel of kTileRows rows x kTileCols features over it.
// Without AVX2 a scalar loop computes each row on its own (invariant too).
//
// blocks: [N, K / 32 * block_bytes] uint8, the blocks of N output features (K / 32 each) in the
// kernels' layout: groups of four features with their blocks interleaved (gguf_blocks.h).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_types.h"
#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace {

using namespace freetoken::gguf;

// The 32 weights of one block, as float32, into w.
template <int64_t QT>
inline void dequant_scalar(const uint8_t* block, float* w) {
  if constexpr (QT == kQ4_1) {
    const float d = load_float(block), m = load_float(block + 4);
    const uint8_t* qs = block + 8;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(qs[j] & 0x0F) + m;
      w[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  } else {
    const float d = half_to_float(block);
    const int8_t* qs = reinterpret_cast<const int8_t*>(block + 2);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(qs[j]);
  }
}

#ifdef FREETOKEN_AVX2
// A Q8_0 block's scale as float32 in lane 0: one conversion of the block's first bytes, the
// same IEEE value as half_to_float; read with the block rather than gathered ahead for many
// blocks (the gathers and their stores cost more than the conversion: a step's linears at
// one row ran ~10 % faster without them). (Q4_1 blocks carry float32 scales: gguf_blocks.h.)
inline __m128 block_dm(const uint8_t* block) {
  int32_t head;
  std::memcpy(&head, block, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(head));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(FREETOKEN_AVX2)
// 16 lanes: a block is two vectors.
using vf = __m512;
constexpr int kLanes = 16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf v) {
  // Fixed order: halves, then the 8-lane reduction of vec.h.
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return freetoken::vec::hsum(_mm256_add_ps(lo, hi));
}

// vsum of four vectors at once, each with vsum's pairings (the same floats): the halves, the
// quarters, then lanes 0 + 2 and 1 + 3, then those two, each step for the four together
// (9 shuffles and 5 adds where four vsums take 16 of each). The tiles' epilogue: at 16-32
// rows 3-5 % of the 30 layers' linears and the head (paired, the Xeon).
inline __m128 vsum4(vf a, vf b, vf c, vf d) {
  const vf ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const vf cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // ab, cd: the halves' sums, [A0-3 | A4-7 | B0-3 | B4-7]; s: the quarters', a 128-bit lane each
  const vf s =
      _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  const vf t = _mm512_add_ps(s, _mm512_permute_ps(s, 0xEE));
  const vf u = _mm512_add_ps(t, _mm512_permute_ps(t, 0x55));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), u));
}

template <int64_t QT, bool kBroadcastLoads = false>  // (as below; here a set1 either way)
inline void dequant(const uint8_t* block, vf w[2]) {
  if constexpr (QT == kQ4_1) {
    // The block's 16 possible weights d * i + m (one FMA, as for each weight before), then
    // each weight looked up by its nibble: a permute reads only the low 4 bits of each index
    // lane, so the bytes need no mask, and no integer-to-float conversion is left.
    const vf d = _mm512_set1_ps(load_float(block)), m = _mm512_set1_ps(load_float(block + 4));
    const vf values = _mm512_fmadd_ps(
        d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), m);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 8));
    w[0] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(q), values);
    w[1] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(q, 4)), values);
  } else {
    const vf d = _mm512_broadcastss_ps(block_dm(block));
    for (int k = 0; k < 2; ++k) {
      const __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * k));
      w[k] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)));
    }
  }
}
#elif defined(FREETOKEN_AVX2)
// 8 lanes: a block is four vectors.
using vf = __m256;
constexpr int kLanes = 8;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf v) { return freetoken::vec::hsum(v); }

// kBroadcastLoads: Q4_1's d and m as one broadcast load each (the float32 scales of the
// kernels' blocks), which spares the vector pipes two shuffles; one row is bound by those
// pipes. Several rows load four x vectors a row for each block and are bound by the loads
// instead: they read both scales with one load and broadcast them in registers (one row of
// the 30 layers' linears 8 % faster with broadcast loads, four rows 5 % slower).
template <int64_t QT, bool kBroadcastLoads = false>
inline void dequant(const uint8_t* block, vf w[4]) {
  if constexpr (QT == kQ4_1) {
    vf d, m;
    if constexpr (kBroadcastLoads) {
      d = _mm256_broadcast_ss(reinterpret_cast<const float*>(block));
      m = _mm256_broadcast_ss(reinterpret_cast<const float*>(block + 4));
    } else {
      const __m128 dm = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(block)));
      d = _mm256_broadcastss_ps(dm);
      m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    }
    // Bytes 0-7 and 8-15 zero-extended to dwords, each q_j | q_{j+16} << 4: a mask gives
    // weights 0-15, a shift 16-31. Two zero-extensions a block instead of a broadcast and four
    // in-lane byte shuffles (fewer shuffle-port operations): one row of the 30 layers'
    // linears 6.84 -> 6.48 ms, four rows 11.4 -> 10.7 (paired, Zen 3 reference).
    const __m256i b0 =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 8)));
    const __m256i b1 =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 16)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const __m256i parts[4] = {_mm256_and_si256(b0, mask), _mm256_and_si256(b1, mask),
                              _mm256_srli_epi32(b0, 4), _mm256_srli_epi32(b1, 4)};
    for (int k = 0; k < 4; ++k) w[k] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(parts[k]), m);
  } else {
    const vf d = _mm256_broadcastss_ps(block_dm(block));
    for (int k = 0; k < 4; ++k) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * k));
      w[k] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
    }
  }
}
#endif

// A unit's head: what a type's decoder works out once per unit for all its sub-blocks
// (Q4_K: its eight scales and mins as floats), where the type has one; nothing elsewhere.
struct NoHead {};
#ifdef FREETOKEN_AVX2
template <class T, class = void>
struct HeadOf {
  using type = NoHead;
  static constexpr bool kHas = false;
};
template <class T>
struct HeadOf<T, std::void_t<typename T::Head>> {
  using type = typename T::Head;
  static constexpr bool kHas = true;
};
#endif

// A feature's weights come in units: a unit is one block of the file for Q4_1 (its scales
// widened, gguf_blocks.h) and Q8_0, decoded by dequant / dequant_scalar above; for every other
// type (gguf_types.h) a unit is one block of the file (32 or 256 weights: kSubs sub-blocks of
// 32), decoded 32 weights at a time, bit for bit as gguf-py decodes it. The kernels' layout
// interleaves units (gguf_blocks.h), and every path reads sub-block s of unit u as the
// weights [32 (u kSubs + s), +32) of the feature, so the one summation order holds for all.
template <int64_t QT, bool kLegacy = (QT == kQ4_1 || QT == kQ8_0)>
struct Unit {
  static constexpr int64_t kBytes = block_bytes(QT);
  static constexpr int kSubs = 1;
  static void scalar(const uint8_t* unit, int, float* w) { dequant_scalar<QT>(unit, w); }
#ifdef FREETOKEN_AVX2
  using Head = NoHead;
  static void head(const uint8_t*, Head&) {}
  template <bool kBroadcastLoads = false>
  static void vec(const uint8_t* unit, int, const Head&, vf* w) {
    dequant<QT, kBroadcastLoads>(unit, w);
  }
#endif
};

template <int64_t QT>
struct Unit<QT, false> {
  using T = freetoken::gguf::types::Type<QT>;
  static constexpr int64_t kBytes = T::kBytes;
  static constexpr int kSubs = T::kSubs;
  static void scalar(const uint8_t* unit, int sub, float* w) { T::scalar(unit, sub, w); }
#ifdef FREETOKEN_AVX2
  using Head = typename HeadOf<T>::type;
  static void head(const uint8_t* unit, Head& h) {
    if constexpr (HeadOf<T>::kHas) T::head(unit, h);
  }
  template <bool = false>
  static void vec(const uint8_t* unit, int sub, const Head& h, vf* w) {
    if constexpr (HeadOf<T>::kHas) T::vec(unit, sub, h, w);
    else T::vec(unit, sub, w);
  }
#endif
};

#ifdef FREETOKEN_AVX2
constexpr int kVecs = kBlock / kLanes;  // vectors per block

// out[r * out_stride + f] = vsum(acc[r][f]) for R rows x F features, four sums at a time
// through vsum4 where the CPU has AVX-512 (the same floats).
template <int R, int F>
inline void store_sums(const vf (&acc)[R][F], float* out, int64_t out_stride) {
  int r = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (F == 4) {
    for (; r < R; ++r)
      _mm_storeu_ps(out + r * out_stride, vsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
  } else if constexpr (F == 2) {
    for (; r + 2 <= R; r += 2) {
      const __m128 s = vsum4(acc[r][0], acc[r][1], acc[r + 1][0], acc[r + 1][1]);
      _mm_storel_pi(reinterpret_cast<__m64*>(out + r * out_stride), s);
      _mm_storeh_pi(reinterpret_cast<__m64*>(out + (r + 1) * out_stride), s);
    }
  }
#endif
  for (; r < R; ++r)
    for (int f = 0; f < F; ++f) out[r * out_stride + f] = vsum(acc[r][f]);
}

// Features a pass of one or two rows reads side by side: 4, except Q4_K on AVX2, whose
// eight unrolled sub-blocks with four features' accumulators, scales and x vectors spill
// registers to the stack with AVX2's 16 (AVX-512 has 32). Paired on Zen 3, one row of a 1B
// block's four linears: Q4_K 5.6 -> 4.8 ms with 2 (two rows 6.3 -> 5.0); Q6_K 6.8 -> 8.7,
// Q5_K 6.7 -> 7.2 and IQ4_XS the same, so they keep 4.
template <int64_t QT>
constexpr int kOneRowFeatures =
#if defined(__AVX512F__) && defined(__AVX512BW__)
    4;
#else
    QT == freetoken::gguf::types::Q4_K ? 2 : 4;
#endif

// Rows x[0:R] against F output features at a time from [n0, n1): R x F accumulators in
// registers, so that R x F independent FMA chains hide the FMA latency even for one row.
// A pass's F features lie in one group of the blocks' layout (n is a multiple of F, which
// divides kGroup), so their blocks are read in address order; each is prefetched
// kPrefetchBytes or F rows ahead, whichever is further.
template <int64_t QT, int R, int F>
void rows_direct(const float* x, int64_t x_stride, const uint8_t* blocks, int64_t features,
                 int64_t row_bytes, int64_t num_blocks, float* out, int64_t out_stride,
                 int64_t n0, int64_t n1) {
  static_assert(kGroup % F == 0, "a pass's features must lie in one group");
  int64_t n = n0;
  // At least the next pass's features: with long rows (down_proj's 960 bytes) a fixed
  // distance would reach only part of them (one row, the 30 layers' down_proj on two
  // threads: 2.2-2.5 -> 1.5-1.9 ms a step).
  const int64_t ahead = std::max<int64_t>(kPrefetchBytes, F * row_bytes);
  if constexpr (F > 1) prefetch_range(blocks + n0 * row_bytes, kPrefetchBytes);
  using U = Unit<QT>;
  const int64_t num_units = num_blocks / U::kSubs;
  for (; n + F <= n1; n += F) {
    const FeatureBlocks fb = feature_blocks(blocks, features, row_bytes, U::kBytes, n);
    vf acc[R][F];
    for (int r = 0; r < R; ++r)
      for (int f = 0; f < F; ++f) acc[r][f] = vzero();
    for (int64_t u = 0; u < num_units; ++u) {
      typename U::Head heads[F];
      for (int f = 0; f < F; ++f) U::head(fb.first + u * fb.stride + f * U::kBytes, heads[f]);
// The sub-blocks unrolled: a K-quant's shifts and scales become constants (one row of a 1B
// block's four Q4_K linears 3.71 -> 2.92 ms, Q6_K 5.13 -> 4.39; bench/gguf_types.py, Xeon).
#pragma GCC unroll 8
      for (int s = 0; s < U::kSubs; ++s) {
        const int64_t b = u * U::kSubs + s;
        for (int f = 0; f < F; ++f) {
          const uint8_t* block = fb.first + u * fb.stride + f * U::kBytes;
          // Every cache line of the unit: a K-quant super-block spans 3-4 (144-210 bytes), and
          // with only its first prefetched one row of a 1B block's Q4_K linears took 1.72
          // ms instead of 1.13 (Q6_K 2.47 -> 1.35; Zen 5, bench/gguf_types.py).
          if (s * 64 < U::kBytes)
            _mm_prefetch(reinterpret_cast<const char*>(block + ahead + 64 * s), _MM_HINT_T0);
          vf w[kVecs];
          U::template vec<R == 1>(block, s, heads[f], w);
          for (int r = 0; r < R; ++r) {
            const float* xb = x + r * x_stride + b * kBlock;
            for (int j = 0; j < kVecs; ++j)
              acc[r][f] = vfma(w[j], vload(xb + j * kLanes), acc[r][f]);
          }
        }
      }
    }
    store_sums<R, F>(acc, out + n, out_stride);
  }
  if constexpr (F > 1) {
    if (n < n1)
      rows_direct<QT, R, 1>(x, x_stride, blocks, features, row_bytes, num_blocks, out,
                            out_stride, n, n1);
  }
}

// The float32 weights of features [n0, n0 + count) into panel [count, K], each block as
// dequant makes it (the same values the direct path uses).
template <int64_t QT>
void dequant_panel(const uint8_t* blocks, int64_t features, int64_t row_bytes,
                   int64_t num_blocks, int64_t n0, int64_t count, float* panel) {
  using U = Unit<QT>;
  const int64_t k = num_blocks * kBlock;
  for (int64_t f = 0; f < count; ++f) {
    const FeatureBlocks fb = feature_blocks(blocks, features, row_bytes, U::kBytes, n0 + f);
    float* dst = panel + f * k;
    // The sub-blocks of a unit unrolled, as in rows_direct: a K-quant's shifts and scales
    // become constants.
#pragma GCC unroll 2
    for (int64_t u = 0; u < num_blocks / U::kSubs; ++u) {
      typename U::Head head;
      U::head(fb.first + u * fb.stride, head);
#pragma GCC unroll 8
      for (int sub = 0; sub < U::kSubs; ++sub) {
        const int64_t b = u * U::kSubs + sub;
        vf w[kVecs];
        U::vec(fb.first + u * fb.stride, sub, head, w);
        for (int j = 0; j < kVecs; ++j) vstore(dst + b * kBlock + j * kLanes, w[j]);
      }
    }
  }
}

// Keeps v in a register: GCC otherwise folds each use's load into its FMA (a memory operand),
// so the tile loads every x vector FT times and the loads, not the FMAs, bound the loop.
inline void in_register(vf& v) { asm("" : "+x"(v)); }

// out[r, f] = vsum over i of fma(w[f, Li:], x[r, Li:]) for RT rows and FT features: RT x FT
// accumulators in registers, each weight vector loaded once for RT rows. Over i in [k0, k1)
// of the k = w_stride weights: from zero where k0 = 0, else from the lanes `carry` holds
// (the accumulators a call on [.., k0) left there, exactly); the lane sums into out where
// k1 = k, else the accumulators into carry. One call over [0, k) or calls over consecutive
// ranges: the same floats.
template <int RT, int FT>
inline void tile(const float* x, int64_t x_stride, const float* w, int64_t w_stride, int64_t k0,
                 int64_t k1, float* out, int64_t out_stride, float* carry) {
  vf acc[RT][FT];
  for (int r = 0; r < RT; ++r)
    for (int f = 0; f < FT; ++f)
      acc[r][f] = k0 == 0 ? vzero() : vload(carry + (r * FT + f) * kLanes);
  // Unrolled four times: 2-3 % more of the tile at 16-64 rows (paired, the Xeon; the same
  // operations in the same order).
#pragma GCC unroll 4
  for (int64_t i = k0; i < k1; i += kLanes) {
    vf wv[FT];
    for (int f = 0; f < FT; ++f) {
      wv[f] = vload(w + f * w_stride + i);
      in_register(wv[f]);
    }
    for (int r = 0; r < RT; ++r) {
      vf xv = vload(x + r * x_stride + i);
      in_register(xv);
      for (int f = 0; f < FT; ++f) acc[r][f] = vfma(wv[f], xv, acc[r][f]);
    }
  }
  if (k1 < w_stride) {
    for (int r = 0; r < RT; ++r)
      for (int f = 0; f < FT; ++f) vstore(carry + (r * FT + f) * kLanes, acc[r][f]);
    return;
  }
  store_sums<RT, FT>(acc, out, out_stride);
}

// The register tile: RT x FT accumulators, FT weight vectors and one x vector in registers
// (AVX2 has 16, AVX-512 32). With AVX2, 4 x 2 (8 accumulators, 2 weights, 1 x: 11 pinned
// registers); 4 x 3 and 6 x 2 need 15-16 and spill once the vectors are pinned (35 GFLOP/s
// against 60 on one core of the 2-core AMD EPYC (Zen 3) reference, 16 rows).
// FREETOKEN_TILE_ROWS / _COLS override.
#if defined(FREETOKEN_TILE_ROWS)
constexpr int kTileRows = FREETOKEN_TILE_ROWS, kTileCols = FREETOKEN_TILE_COLS;
#elif defined(__AVX512F__)
constexpr int kTileRows = 6, kTileCols = 4;
#else
constexpr int kTileRows = 4, kTileCols = 2;
#endif
constexpr int64_t kPanel = 2 * kTileCols;  // features per panel: its float32 weights stay in L1

template <int RT, int FT = kTileCols>
inline void tile_cols(const float* x, int64_t x_stride, const float* w, int64_t k, int64_t k0,
                      int64_t k1, float* out, int64_t out_stride, int64_t cols, float* carry) {
  if constexpr (FT > 1) {
    if (cols < FT)
      return tile_cols<RT, FT - 1>(x, x_stride, w, k, k0, k1, out, out_stride, cols, carry);
  }
  tile<RT, FT>(x, x_stride, w, k, k0, k1, out, out_stride, carry);
}

template <int RT = kTileRows>
inline void tile_rows(const float* x, int64_t x_stride, const float* w, int64_t k, int64_t k0,
                      int64_t k1, float* out, int64_t out_stride, int64_t rows, int64_t cols,
                      float* carry) {
  if constexpr (RT > 1) {
    if (rows < RT)
      return tile_rows<RT - 1>(x, x_stride, w, k, k0, k1, out, out_stride, rows, cols, carry);
  }
  tile_cols<RT>(x, x_stride, w, k, k0, k1, out, out_stride, cols, carry);
}

// Above this many weights per row, the tiles take k in pieces of kKPiece (the accumulators
// carried between them): down_proj's 1,536 made a tile's 6 rows and 4 features of x and
// weights 60 KB, past the 48 KB L1 of the Xeon, so both streamed from L2 (157 GFLOP/s at 16
// rows where the K = 576 linears ran at ~205).
constexpr int64_t kKPieceAbove = 1024, kKPiece = 768;

// Rows [0, rows) against features [n0, n1), kPanel features at a time through `panel`.
template <int64_t QT>
void panels(const float* x, int64_t rows, const uint8_t* blocks, int64_t features,
            int64_t row_bytes, int64_t num_blocks, float* out, int64_t out_stride, int64_t n0,
            int64_t n1, float* panel, float* carry) {
  const int64_t k = num_blocks * kBlock;
  for (int64_t p0 = n0; p0 < n1; p0 += kPanel) {
    const int64_t count = std::min(kPanel, n1 - p0);
    dequant_panel<QT>(blocks, features, row_bytes, num_blocks, p0, count, panel);
    // The next panel's blocks into L2 while the tiles work on this one (whole groups: they
    // span the same bytes as the panel's rows did in the file's layout), an equal share of
    // its cache lines before each tile call rather than all of them before the first: a
    // burst of one prefetch per line (144 lines for a float16 panel of K = 576, 384 for
    // down_proj's) fills the core's miss buffers and stalls it about as long as the loads
    // would have. 30 layers' linears at 16 rows, float16 14.1-14.4 -> 12.3-12.4 ms, Q8_0
    // 11.8-12.3 -> 10.9, 1B block (Q6_K) 8.4-9.6 -> 7.3-8.1 (paired, Zen 5 VM).
    const uint8_t* next = blocks + (p0 + kPanel) * row_bytes;
    const uint8_t* next_end =
        next + std::max<int64_t>(0, std::min(kPanel, n1 - p0 - kPanel)) * row_bytes;
    const int64_t piece = k > kKPieceAbove ? kKPiece : k;
    const int64_t tile_calls = (k + piece - 1) / piece * ((rows + kTileRows - 1) / kTileRows) *
                               ((count + kTileCols - 1) / kTileCols);
    const int64_t share = ((next_end - next) / tile_calls + 127) / 64 * 64;  // >= a line
    for (int64_t k0 = 0; k0 < k; k0 += piece) {
      const int64_t k1 = std::min(k, k0 + piece);
      float* slot = carry;
      for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
        const float* xr = x + r0 * k;
        const int64_t rt = std::min<int64_t>(kTileRows, rows - r0);
        for (int64_t f0 = 0; f0 < count;
             f0 += kTileCols, slot += kTileRows * kTileCols * kLanes) {
          const int64_t ft = std::min<int64_t>(kTileCols, count - f0);
          float* o = out + r0 * out_stride + p0 + f0;
          const float* w = panel + f0 * k;
          if (next < next_end) {
            prefetch_range<_MM_HINT_T1>(next, std::min<int64_t>(share, next_end - next));
            next += share;
          }
          tile_rows(xr, k, w, k, k0, k1, o, out_stride, rt, ft, slot);
        }
      }
    }
  }
}
#endif

template <int64_t QT>
void rows_scalar(const float* x, int64_t x_stride, int64_t rows, const uint8_t* blocks,
                 int64_t features, int64_t row_bytes, int64_t num_blocks, float* out,
                 int64_t out_stride, int64_t n0, int64_t n1) {
  using U = Unit<QT>;
  float w[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    const FeatureBlocks fb = feature_blocks(blocks, features, row_bytes, U::kBytes, n);
    for (int64_t r = 0; r < rows; ++r) out[r * out_stride + n] = 0.f;
    for (int64_t b = 0; b < num_blocks; ++b) {
      U::scalar(fb.first + (b / U::kSubs) * fb.stride, static_cast<int>(b % U::kSubs), w);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xb = x + r * x_stride + b * kBlock;
        float s = 0.f;
        for (int j = 0; j < kBlock; ++j) s += w[j] * xb[j];
        out[r * out_stride + n] += s;
      }
    }
  }
}

// The panels take the rows in slices of at most this many bytes of x (at least 32 rows),
// cut evenly. A 1,024-row chunk of the block's four linears and the head: 190 -> 288 GFLOP/s
// on the Xeon's two cores (its L2 is 2 MB; 256 KB slices gave 280, and 4-5 % less than
// unsliced at 128-256 rows, 512 KB the same as unsliced there); 512 rows 5 % faster.
#ifndef FREETOKEN_SLICE_BYTES
#define FREETOKEN_SLICE_BYTES (512 * 1024)
#endif
constexpr int64_t kSliceBytes = FREETOKEN_SLICE_BYTES, kMinSliceRows = 32;

// Up to this many rows the direct path (one pass over the blocks, dequantized in registers);
// above, the panels (bench/gguf_linear.py measures both).
// With AVX-512's 32 registers, up to 10 rows (20 accumulators): 5-8 rows 9-23 % faster than
// the panels, 9-10 rows 5-13 %, 12 rows (24 accumulators, spilled) 6-29 % slower; F = 1
// from 9 to 16 rows was slower than the panels too (paired, the Xeon).
#if defined(__AVX512F__)
constexpr int64_t kDirectRows = 10;
#else
constexpr int64_t kDirectRows = 4;
#endif

// The i-quants (grid look-ups, gguf_iq_types.h) take the direct path for one row only and
// the panels from two: seven types' direct passes for 2-10 rows made this file's build
// ~40 s longer (50 -> 90 s with -march=native), and a kernel build is in every machine's
// first start. Both paths sum in one order, so a row's result does not change with it.
template <int64_t QT>
constexpr int64_t kDirectRowsOf =
    (QT == types::IQ2_XXS || QT == types::IQ2_XS || QT == types::IQ2_S ||
     QT == types::IQ3_XXS || QT == types::IQ3_S || QT == types::IQ1_S || QT == types::IQ1_M)
        ? 1 : kDirectRows;

// out[r * out_stride + f] for the n features of `bp` (rows of row_bytes): a whole output, or
// the columns of one part of a linear of parts (gguf_linear).
template <int64_t QT>
void gguf_linear_impl(const float* xp, int64_t rows, int64_t k, const uint8_t* bp, int64_t n,
                      int64_t row_bytes, float* op, int64_t out_stride) {
  const int64_t num_blocks = k / kBlock;
  if (rows == 0) return;
#ifdef FREETOKEN_AVX2
  if (rows > kDirectRowsOf<QT>) {
    // Panels handed out from a shared counter in shrinking pieces (parallel.h) rather than
    // one fixed share per thread: a thread that is slowed (the other process's work, an
    // interrupt, the serial code it ran before) does less of the product instead of holding
    // up the step. Which thread computes a feature changes nothing in its sums.
    const int64_t num_panels = (n + kPanel - 1) / kPanel;
    // A prompt's rows in slices whose activations stay in L2 while every panel passes over
    // them (each panel is dequantized once a slice): with all the rows of a 1,024-token
    // chunk, the tiles read x from L3 for every panel.
    const int64_t most = std::max<int64_t>(
        kMinSliceRows, kSliceBytes / (k * static_cast<int64_t>(sizeof(float))));
    const int64_t slices = (rows + most - 1) / most;
    const int64_t slice = ((rows + slices - 1) / slices + kTileRows - 1) / kTileRows * kTileRows;
    for (int64_t r0 = 0; r0 < rows; r0 += slice) {
      const int64_t count = std::min(slice, rows - r0);
      freetoken::guided_for(num_panels, 1, 1, [&](int64_t p0, int64_t p1) {
        // On a cache line: a vector load that straddles two lines costs two.
        thread_local std::vector<float> panel;
        panel.resize(std::max<size_t>(panel.size(), kPanel * k + 16));
        float* aligned = reinterpret_cast<float*>(
            (reinterpret_cast<uintptr_t>(panel.data()) + 63) & ~uintptr_t{63});
        // The accumulators a tile carries between pieces of k: one slot per tile of the slice.
        thread_local std::vector<float> carry;
        carry.resize(std::max<size_t>(
            carry.size(), ((count + kTileRows - 1) / kTileRows) * (kPanel / kTileCols) *
                              kTileRows * kTileCols * kLanes));
        panels<QT>(xp + r0 * k, count, bp, n, row_bytes, num_blocks, op + r0 * out_stride,
                   out_stride,
                   p0 * kPanel, std::min(n, p1 * kPanel), aligned, carry.data());
      });
    }
    return;
  }
  // Features per pass: rows x features is 8 FMA chains from two rows up. One row reads 4
  // features side by side rather than 8: fewer streams and no accumulator spilled to the
  // stack; the 30 layers' linears plus the head at one row measured 5-10 % faster in each
  // of four alternations (11.4 vs 12.1 ms on the reference), a decode step of one
  // sequence 0.8-1.6 ms faster (median of 30-40 paired alternations in one process).
  // The features in shrinking pieces of whole passes, as the panels.
  if constexpr (kDirectRowsOf<QT> == 1) {
    freetoken::guided_for(n, 32, 8, [&](int64_t n0, int64_t n1) {
      rows_direct<QT, 1, kOneRowFeatures<QT>>(xp, k, bp, n, row_bytes, num_blocks, op,
                                              out_stride, n0, n1);
    });
  } else {
    freetoken::guided_for(n, 32, 8, [&](int64_t n0, int64_t n1) {
      switch (rows) {
        case 1: rows_direct<QT, 1, kOneRowFeatures<QT>>(xp, k, bp, n, row_bytes, num_blocks, op,
                                                        out_stride, n0, n1);
          break;
        case 2: rows_direct<QT, 2, kOneRowFeatures<QT>>(xp, k, bp, n, row_bytes, num_blocks, op,
                                                        out_stride, n0, n1);
          break;
        case 3: rows_direct<QT, 3, 2>(xp, k, bp, n, row_bytes, num_blocks, op,
                                      out_stride, n0, n1);
          break;
        case 4: rows_direct<QT, 4, 2>(xp, k, bp, n, row_bytes, num_blocks, op,
                                      out_stride, n0, n1);
          break;
#if defined(__AVX512F__)
        case 5: rows_direct<QT, 5, 2>(xp, k, bp, n, row_bytes, num_blocks, op,
                                      out_stride, n0, n1);
          break;
        case 6: rows_direct<QT, 6, 2>(xp, k, bp, n, row_bytes, num_blocks, op,
                                      out_stride, n0, n1);
          break;
        case 7: rows_direct<QT, 7, 2>(xp, k, bp, n, row_bytes, num_blocks, op,
                                      out_stride, n0, n1);
          break;
        case 8: rows_direct<QT, 8, 2>(xp, k, bp, n, row_bytes, num_blocks, op,
                                      out_stride, n0, n1);
          break;
        case 9: rows_direct<QT, 9, 2>(xp, k, bp, n, row_bytes, num_blocks, op,
                                      out_stride, n0, n1);
          break;
        default: rows_direct<QT, 10, 2>(xp, k, bp, n, row_bytes, num_blocks, op,
                                        out_stride, n0, n1);
          break;
#else
        default: rows_direct<QT, 4, 2>(xp, k, bp, n, row_bytes, num_blocks, op,
                                       out_stride, n0, n1);
          break;
#endif
      }
    });
  }
#else
  // guided_for, not at::parallel_for: inside a team (llama_layers) each member takes its
  // share and meets the others at a barrier; at::parallel_for there would run the whole
  // linear on every member, one of them still writing its outputs while another has gone
  // on to the next kernel, which rewrites them in place.
  freetoken::guided_for(n, 16, 1, [&](int64_t n0, int64_t n1) {
    rows_scalar<QT>(xp, k, rows, bp, n, row_bytes, num_blocks, op, out_stride, n0, n1);
  });
#endif
}

// out[t] = the weights of feature ids[t] (a row of the embedding), from blocks in the kernels'
// layout: the very floats the linear kernel multiplies by (Unit), so a tied embedding and
// output head share one copy of the blocks.
template <int64_t QT>
void embedding_impl(const int64_t* ids, int64_t count, const uint8_t* blocks, int64_t features,
                    int64_t row_bytes, int64_t k, float* out) {
  using U = Unit<QT>;
  const int64_t num_blocks = k / kBlock;
  at::parallel_for(0, count, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const FeatureBlocks fb = feature_blocks(blocks, features, row_bytes, U::kBytes, ids[t]);
      float* dst = out + t * k;
      for (int64_t b = 0; b < num_blocks; ++b)
        U::scalar(fb.first + (b / U::kSubs) * fb.stride, static_cast<int>(b % U::kSubs),
                  dst + b * kBlock);
    }
  });
}

}  // namespace

namespace freetoken {

namespace {

// One linear of one type: x [rows, k] against n features of blocks `bp` into columns of out.
void linear_part(const float* xp, int64_t rows, int64_t k, const uint8_t* bp, int64_t n,
                 int64_t row_bytes, int64_t qtype, float* op, int64_t out_stride) {
  if (qtype == kQ4_1) {
    gguf_linear_impl<kQ4_1>(xp, rows, k, bp, n, row_bytes, op, out_stride);
  } else if (qtype == kQ8_0) {
    gguf_linear_impl<kQ8_0>(xp, rows, k, bp, n, row_bytes, op, out_stride);
  } else {
    freetoken::gguf::types::dispatch(qtype, [&](auto qt) {
      constexpr int64_t QT = decltype(qt)::value;
      if constexpr (QT != kQ4_1 && QT != kQ8_0)
        gguf_linear_impl<QT>(xp, rows, k, bp, n, row_bytes, op, out_stride);
    });
  }
}

// Bytes of one unit of weights of type qtype in the kernels' layout.
int64_t kernel_unit_bytes(int64_t qtype) {
  return qtype == kQ4_1 || qtype == kQ8_0 ? block_bytes(qtype)
                                          : freetoken::gguf::types::unit_bytes(qtype);
}
int64_t kernel_unit_weights(int64_t qtype) {
  return qtype == kQ4_1 || qtype == kQ8_0 ? kBlock : freetoken::gguf::types::unit_weights(qtype);
}

}  // namespace

void gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, at::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
              x.is_contiguous(), "gguf_linear: x must be a contiguous float32 [M, K] CPU tensor");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "gguf_linear: blocks must be a contiguous uint8 [N, row bytes] tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == x.size(0),
              "gguf_linear: out must be float32 [M, N]");
  const int64_t rows = x.size(0), k = x.size(1);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (qtype == kParts) {
    // A linear of parts of different types, side by side in the output (a fused q/k/v whose
    // v has another type than q and k): `blocks` is [1, bytes], a header of int64 values
    // (kParts, part count, then per part: type, features, row bytes, byte offset of its
    // blocks) and each part's blocks in the kernels' layout (block_layout.parts_blocks).
    const uint8_t* base = blocks.data_ptr<uint8_t>();
    int64_t col = 0;
    for (const LinearPart& p : linear_parts(blocks, "gguf_linear")) {
      TORCH_CHECK(k % kernel_unit_weights(p.type) == 0 &&
                  p.row_bytes == k / kernel_unit_weights(p.type) * kernel_unit_bytes(p.type),
                  "gguf_linear: a part's blocks do not fit K");
      linear_part(xp, rows, k, base + p.offset, p.n, p.row_bytes, p.type, op + col,
                  out.size(1));
      col += p.n;
    }
    TORCH_CHECK(col == out.size(1), "gguf_linear: the parts' features do not fill out");
    return;
  }
  const int64_t unit_weights = kernel_unit_weights(qtype);
  TORCH_CHECK(k % unit_weights == 0, "gguf_linear: K must be a multiple of ", unit_weights,
              " for ggml type ", qtype);
  TORCH_CHECK(blocks.size(1) == k / unit_weights * kernel_unit_bytes(qtype),
              "gguf_linear: blocks must be uint8 [N, K / unit weights * unit bytes]");
  TORCH_CHECK(out.size(1) == blocks.size(0), "gguf_linear: out must be float32 [M, N]");
  linear_part(xp, rows, k, blocks.data_ptr<uint8_t>(), blocks.size(0), blocks.size(1), qtype,
              op, out.size(1));
}

at::Tensor gguf_embedding_blocks(const at::Tensor& ids, const at::Tensor& blocks, int64_t qtype,
                                 int64_t k) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "gguf_embedding_blocks: blocks must be uint8 [N, row bytes]");
  const int64_t n = blocks.size(0), count = ids.size(0);
  const int64_t* ip = embedding_ids(ids, n, "gguf_embedding_blocks");
  at::Tensor out = at::empty({count, k}, ids.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  auto run = [&](auto qt) {
    constexpr int64_t QT = decltype(qt)::value;
    embedding_impl<QT>(ip, count, bp, n, blocks.size(1), k, out.data_ptr<float>());
  };
  if (qtype == kQ4_1) {
    run(std::integral_constant<int64_t, kQ4_1>{});
  } else if (qtype == kQ8_0) {
    run(std::integral_constant<int64_t, kQ8_0>{});
  } else {
    freetoken::gguf::types::dispatch(qtype, [&](auto qt) {
      constexpr int64_t QT = decltype(qt)::value;
      if constexpr (QT != kQ4_1 && QT != kQ8_0) run(qt);
    });
  }
  return out;
}

}  // namespace freetoken

TORCH_LIBRARY_FRAGMENT(freetoken, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int qtype, Tensor(a!) out) -> ()",
        &freetoken::gguf_linear);
  m.def("gguf_embedding_blocks(Tensor ids, Tensor blocks, int qtype, int k) -> Tensor",
        &freetoken::gguf_embedding_blocks);
}
