// y[M, N] = x[M, K] @ W[N, K]^T from GGUF blocks (Q4_1 or Q8_0) in integer arithmetic, on
// CPUs with AVX-512 VNNI (and AMX where the CPU has it): the exact path's numerics there.
//
// Each block of 32 activations of a row is written in 24-bit fixed point against its largest
// magnitude: with 2^e the power of two above max |x|, the scale s = 2^(e - 23) and the
// integers X_k = round(x_k / s) (|X_k| < 2^23, clamped to [-2^23, 2^23 - 1]). x_k / s is
// exact (a power of two), so the only rounding is of each value to the block's grid: an
// error of at most 2^-24 of the block's largest magnitude, the size of float32's own
// rounding of that value (24 significant bits). Each X_k is cut into three 8-bit digits,
// X_k = 65536 h_k + 256 m_k + l_k (h signed, m and l unsigned), and a block of weights
// (integers q: Q4_1 0..15, Q8_0 -128..127) meets the block of activations in three integer
// dot products, P_h = sum h_k q_k and likewise P_m, P_l, which are exact. Then, in float32,
// in this order:
//
//   S = fma(P_h, 65536, fma(P_m, 256, P_l))                     the block's sum of X_k q_k
//   y = fma(d, S * s, y)                                         (S * s exact: a power of two)
//   y = fma(m, float(sum_k X_k) * s, y)                          (Q4_1: w = d q + m)
//
// block after block from y = 0. So the only roundings are the activations' (as above) and
// these few per block, where the float32 path rounds after every one of the 32 products of a
// block: its error against float64 sums is of the same size (tests/test_native_kernels.py
// holds it to that; bench/gguf_linear.py times both kernels), and the exactness tests
// against transformers hold on it.
//
// Batch invariance: integer sums are exact whatever their order, and the float steps above
// are the same for every row, so the results do not depend on M, on which path computes them
// (VNNI below kAmxRows rows, AMX tiles from there) or on the other rows; the scalar path
// computes the same floats (test_native_kernels checks all three against each other).
//
// The weights in this kernel's layout (int_blocks, made at load from the kernel blocks of
// gguf_blocks.h; N a multiple of 16, seen as [N, K / 32 * 24 or 36] uint8): output features
// in groups of 16, group g's blocks one after the other, a group-block holding
//   Q4_1: d[16], m[16] as float32, then 4 x 64 bytes: byte 4f + e of vector v is
//         q_f[8v + e] | q_f[8v + 4 + e] << 4                                     (384 bytes)
//   Q8_0: d[16] as float32, then 8 x 64 bytes: byte 4f + e of vector t is q_f[4t + e]  (576)
// so that 4 consecutive weights of one feature are one 32-bit lane, as VNNI's dot products
// and AMX's B tiles take them (low nibbles: weights 8v..8v+3, high: 8v+4..8v+7).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gguf_blocks.h"
#include "ops.h"
#include "parallel.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(FREETOKEN_AVX2)
#define FREETOKEN_VNNI 1
#endif
#if defined(FREETOKEN_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && \
    defined(__linux__)
#define FREETOKEN_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using namespace freetoken::gguf;

constexpr int64_t kIntGroup = 16;  // features of a group-block
constexpr int64_t int_block_bytes(int64_t qt) { return qt == kQ4_1 ? 384 : 576; }
constexpr int64_t int_weights_offset(int64_t qt) { return qt == kQ4_1 ? 128 : 64; }
constexpr int64_t kDigitBytes = 3 * kBlock;  // a row's block: h[32], m[32], l[32]

// The activations as digits: per row and block, the 96 digit bytes, and the block's floats.
struct Digits {
  std::vector<uint8_t> d;    // [rows rounded up to 16, nb, 96]: rows past M are zeros
  std::vector<float> s;      // [rows, nb]: the scale 2^(e - 23)
  std::vector<float> xs;     // [rows, nb]: float(sum of X) * s
  std::vector<int32_t> sh;   // [rows, nb]: sum of h (Q8_0's correction of the VNNI sums)
  int64_t nb = 0;
};

// e with max |x| < 2^e (0 for a block of zeros), held above -100 so that 2^(23 - e) stays
// a float (a tinier block keeps fewer digits).
inline int block_exponent(float amax) {
  int e = 0;
  if (amax > 0.f) {
    std::frexp(amax, &e);
    e = std::max(e, -100);
  }
  return e;
}

// One row's block of 32: its digits, scale, scaled sum and sum of h.
inline void digits_block(const float* x, uint8_t* dg, float* s_out, float* xs_out,
                         int32_t* sh_out) {
  float amax = 0.f;
  bool finite = true;
  for (int k = 0; k < kBlock; ++k) {
    finite = finite && std::isfinite(x[k]);
    amax = std::max(amax, std::fabs(x[k]));
  }
  if (!finite) {
    // inf or NaN: the block's outputs become NaN, as a float32 dot product's would (or inf
    // for an infinite x; NaN here either way).
    std::memset(dg, 0, kDigitBytes);
    *s_out = *xs_out = std::numeric_limits<float>::quiet_NaN();
    *sh_out = 0;
    return;
  }
  const int e = block_exponent(amax);
  const float up = std::ldexp(1.0f, 23 - e);
  int32_t sum = 0, sum_h = 0;
  for (int k = 0; k < kBlock; ++k) {
    int32_t v = static_cast<int32_t>(std::nearbyint(x[k] * up));
    v = std::min(std::max(v, -(1 << 23)), (1 << 23) - 1);
    const uint32_t u = static_cast<uint32_t>(v + (1 << 23));
    const int32_t h = static_cast<int32_t>(u >> 16) - 128;
    dg[k] = static_cast<uint8_t>(static_cast<int8_t>(h));
    dg[kBlock + k] = static_cast<uint8_t>(u >> 8);
    dg[2 * kBlock + k] = static_cast<uint8_t>(u);
    sum += v;
    sum_h += h;
  }
  const float s = std::ldexp(1.0f, e - 23);
  *s_out = s;
  *xs_out = static_cast<float>(sum) * s;
  *sh_out = sum_h;
}

#ifdef FREETOKEN_VNNI
// digits_block on vectors: the same integers and floats.
inline void digits_block_avx512(const float* x, uint8_t* dg, float* s_out, float* xs_out,
                                int32_t* sh_out) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const __m512 abs_max = _mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b));
  // Not finite (inf or NaN): an exponent field of all ones in a or b.
  const __m512i exponent = _mm512_set1_epi32(0x7F800000);
  const __mmask16 bad =
      _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(a), exponent), exponent) |
      _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(b), exponent), exponent);
  if (bad) return digits_block(x, dg, s_out, xs_out, sh_out);
  const int e = block_exponent(_mm512_reduce_max_ps(abs_max));
  const __m512 up = _mm512_set1_ps(std::ldexp(1.0f, 23 - e));
  const __m512i lo = _mm512_set1_epi32(-(1 << 23)), hi = _mm512_set1_epi32((1 << 23) - 1);
  __m512i sum = _mm512_setzero_si512(), sum_h = _mm512_setzero_si512();
  for (int half = 0; half < 2; ++half) {
    const __m512 v = half == 0 ? a : b;
    // cvtps_epi32 rounds to nearest even (the default MXCSR mode), as nearbyint does.
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, up));
    q = _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
    const __m512i u = _mm512_add_epi32(q, _mm512_set1_epi32(1 << 23));
    const __m512i h = _mm512_sub_epi32(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(128));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dg + 16 * half), _mm512_cvtepi32_epi8(h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dg + kBlock + 16 * half),
                     _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 8)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dg + 2 * kBlock + 16 * half),
                     _mm512_cvtepi32_epi8(u));
    sum = _mm512_add_epi32(sum, q);
    sum_h = _mm512_add_epi32(sum_h, h);
  }
  const float s = std::ldexp(1.0f, e - 23);
  *s_out = s;
  *xs_out = static_cast<float>(_mm512_reduce_add_epi32(sum)) * s;
  *sh_out = _mm512_reduce_add_epi32(sum_h);
}
#endif

void make_digits(const float* x, int64_t rows, int64_t k, Digits& out, bool scalar) {
  const int64_t nb = k / kBlock, padded = (rows + 15) / 16 * 16;
  out.nb = nb;
  out.d.resize(padded * nb * kDigitBytes);
  out.s.resize(rows * nb);
  out.xs.resize(rows * nb);
  out.sh.resize(rows * nb);
  std::memset(out.d.data() + rows * nb * kDigitBytes, 0, (padded - rows) * nb * kDigitBytes);
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
#ifdef FREETOKEN_VNNI
      if (!scalar) {
        digits_block_avx512(x + b * kBlock, out.d.data() + b * kDigitBytes, &out.s[b],
                            &out.xs[b], &out.sh[b]);
        continue;
      }
#endif
      digits_block(x + b * kBlock, out.d.data() + b * kDigitBytes, &out.s[b], &out.xs[b],
                   &out.sh[b]);
    }
  };
  // In a team every member computes all rows' digits into its own copy (thread-local), as
  // gguf_linear_q8 quantizes: no barrier and no shared buffer.
  if (freetoken::in_team()) {
    run(0, rows * nb);
  } else {
    at::parallel_for(0, rows * nb, 256, run);
  }
}

// A group-block's 32 weights of feature f as integers.
template <int64_t QT>
inline int32_t weight_int(const uint8_t* gb, int f, int k) {
  const uint8_t* w = gb + int_weights_offset(QT);
  if constexpr (QT == kQ4_1) {
    const uint8_t byte = w[(k / 8) * 64 + 4 * f + k % 4];
    return (k % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
  } else {
    return static_cast<int8_t>(w[(k / 4) * 64 + 4 * f + k % 4]);
  }
}

inline float block_value(int32_t ph, int32_t pm, int32_t pl) {
  return std::fma(static_cast<float>(ph), 65536.f,
                  std::fma(static_cast<float>(pm), 256.f, static_cast<float>(pl)));
}

template <int64_t QT>
void rows_scalar(const Digits& x, int64_t rows, const uint8_t* blocks, int64_t n, float* out,
                 int64_t g0, int64_t g1) {
  const int64_t nb = x.nb;
  for (int64_t g = g0; g < g1; ++g)
    for (int f = 0; f < kIntGroup; ++f)
      for (int64_t r = 0; r < rows; ++r) {
        float y = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* gb = blocks + (g * nb + b) * int_block_bytes(QT);
          const uint8_t* dg = x.d.data() + (r * nb + b) * kDigitBytes;
          int32_t p[3] = {0, 0, 0};
          for (int k = 0; k < kBlock; ++k) {
            const int32_t q = weight_int<QT>(gb, f, k);
            p[0] += static_cast<int8_t>(dg[k]) * q;
            p[1] += dg[kBlock + k] * q;
            p[2] += dg[2 * kBlock + k] * q;
          }
          const float d = load_float(gb + 4 * f);
          y = std::fma(d, block_value(p[0], p[1], p[2]) * x.s[r * nb + b], y);
          if constexpr (QT == kQ4_1) y = std::fma(load_float(gb + 64 + 4 * f), x.xs[r * nb + b], y);
        }
        out[r * n + g * kIntGroup + f] = y;
      }
}

#ifdef FREETOKEN_VNNI
// The block's update of y for one row and one group, from the three dot products (the
// scalar path's operations, lane by lane).
template <int64_t QT>
inline __m512 block_update(__m512i ph, __m512i pm, __m512i pl, const uint8_t* gb, float s,
                           float xs, __m512 y) {
  const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ph), _mm512_set1_ps(65536.f),
                                   _mm512_fmadd_ps(_mm512_cvtepi32_ps(pm),
                                                   _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(pl)));
  y = _mm512_fmadd_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(gb)),
                      _mm512_mul_ps(v, _mm512_set1_ps(s)), y);
  if constexpr (QT == kQ4_1)
    y = _mm512_fmadd_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(gb) + 16),
                        _mm512_set1_ps(xs), y);
  return y;
}

// Weights 4t..4t+3 of the 16 features of a group-block, one feature a 32-bit lane.
template <int64_t QT>
inline __m512i weight_quad(const uint8_t* gb, int t) {
  const uint8_t* w = gb + int_weights_offset(QT);
  if constexpr (QT == kQ4_1) {
    const __m512i v = _mm512_loadu_si512(w + (t / 2) * 64);
    const __m512i nib = (t & 1) ? _mm512_srli_epi16(v, 4) : v;
    return _mm512_and_si512(nib, _mm512_set1_epi8(0x0F));
  } else {
    return _mm512_loadu_si512(w + t * 64);
  }
}

// R rows of one group's VNNI dot products: 3 x R integer accumulators per block, then the
// block's update of R float accumulators.
template <int64_t QT, int R>
void rows_vnni(const Digits& x, int64_t r0, const uint8_t* blocks, int64_t n, float* out,
               int64_t g) {
  const int64_t nb = x.nb;
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* gb = blocks + (g * nb + b) * int_block_bytes(QT);
    prefetch_range(gb + kPrefetchBytes, int_block_bytes(QT));
    __m512i p[R][3];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 3; ++i) p[r][i] = _mm512_setzero_si512();
    for (int t = 0; t < 8; ++t) {
      // w: the weights as VNNI's signed operand; wu: as its unsigned one (Q8_0: q + 128,
      // the 128 * sum(h) taken off after the block).
      const __m512i w = weight_quad<QT>(gb, t);
      const __m512i wu =
          QT == kQ4_1 ? w : _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));
      for (int r = 0; r < R; ++r) {
        const uint8_t* dg = x.d.data() + ((r0 + r) * nb + b) * kDigitBytes + 4 * t;
        int32_t hq, mq, lq;
        std::memcpy(&hq, dg, 4);
        std::memcpy(&mq, dg + kBlock, 4);
        std::memcpy(&lq, dg + 2 * kBlock, 4);
        const __m512i h = _mm512_set1_epi32(hq), m = _mm512_set1_epi32(mq),
                      l = _mm512_set1_epi32(lq);
        p[r][0] = _mm512_dpbusd_epi32(p[r][0], wu, h);  // q (u8) x h (s8)
        p[r][1] = _mm512_dpbusd_epi32(p[r][1], m, w);  // m (u8) x q (s8)
        p[r][2] = _mm512_dpbusd_epi32(p[r][2], l, w);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      __m512i ph = p[r][0];
      if constexpr (QT == kQ8_0) ph = _mm512_sub_epi32(ph, _mm512_set1_epi32(128 * x.sh[i]));
      y[r] = block_update<QT>(ph, p[r][1], p[r][2], gb, x.s[i], x.xs[i], y[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (r0 + r) * n + g * kIntGroup, y[r]);
}

// Groups [g0, g1) one after the other: a group's blocks are contiguous and the groups follow
// each other, so a thread reads one stream, which the prefetches ahead of it cover. Four
// groups side by side for one row (two for two rows), as this read before, made four
// streams a group's bytes apart, and every pass began with three groups' first 4 KB not
// prefetched: the default model's 30 layers and head at one row, read cold, 3.56-4.09 ->
// 2.84-2.92 ms, two rows 3.59-3.75 -> 3.02-3.16 (Zen 5, AVX-512 VNNI, paired; the float32
// kernel 3.0-3.5); on weights in cache (the default block repeated) one row the same,
// 0.042-0.045 ms.
template <int64_t QT, int R>
void groups_vnni(const Digits& x, int64_t r0, const uint8_t* blocks, int64_t n, float* out,
                 int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) rows_vnni<QT, R>(x, r0, blocks, n, out, g);
}
#endif

#ifdef FREETOKEN_AMX
// Linux grants a process the AMX tile state on request (once); false where it refuses.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-2 and 3-5: the three dot products of a block (rows x 16 int32), two sets so that
// one block's products run while the other's are stored; 6: a part of the rows' digits of a
// block (rows x 32 bytes: h, m, l in turn); 7: the group-block's weights (8 rows of 4-weight
// lanes). `rows`: the tile rows (16, or fewer when the call has fewer: the products and
// stores shrink).
void configure_tiles(int rows) {
  TileConfig c;
  for (int t = 0; t < 6; ++t) c.colsb[t] = 64, c.rows[t] = rows;
  c.colsb[6] = 32, c.rows[6] = rows;
  c.colsb[7] = 64, c.rows[7] = 8;
  _tile_loadconfig(&c);
}

// The three tile products of a block for the tile's rows (digits from dg, `stride` bytes
// between rows) into the tiles C0..C2, stored to c. (The tile intrinsics take their tile
// numbers as literals: a macro makes one function for each set.)
#define FREETOKEN_TILE_PRODUCTS(NAME, C0, C1, C2)                                         \
  template <int64_t QT>                                                                    \
  inline void NAME(const uint8_t* dg, int64_t stride, const uint8_t* weights,              \
                   int32_t(*c)[16][16]) {                                                  \
    _tile_loadd(7, weights, 64);                                                           \
    _tile_zero(C0);                                                                        \
    _tile_zero(C1);                                                                        \
    _tile_zero(C2);                                                                        \
    _tile_loadd(6, dg, stride);                                                            \
    if constexpr (QT == kQ4_1) {                                                           \
      _tile_dpbsud(C0, 6, 7); /* h (s8) x q (u8) */                                        \
    } else {                                                                               \
      _tile_dpbssd(C0, 6, 7); /* h (s8) x q (s8): exact, no correction */                  \
    }                                                                                      \
    _tile_loadd(6, dg + kBlock, stride);                                                   \
    if constexpr (QT == kQ4_1) {                                                           \
      _tile_dpbuud(C1, 6, 7); /* m (u8) x q (u8) */                                        \
    } else {                                                                               \
      _tile_dpbusd(C1, 6, 7); /* m (u8) x q (s8) */                                        \
    }                                                                                      \
    _tile_loadd(6, dg + 2 * kBlock, stride);                                               \
    if constexpr (QT == kQ4_1) {                                                           \
      _tile_dpbuud(C2, 6, 7);                                                              \
    } else {                                                                               \
      _tile_dpbusd(C2, 6, 7);                                                              \
    }                                                                                      \
    _tile_stored(C0, c[0], 64);                                                            \
    _tile_stored(C1, c[1], 64);                                                            \
    _tile_stored(C2, c[2], 64);                                                            \
  }
FREETOKEN_TILE_PRODUCTS(tile_products_even, 0, 1, 2)
FREETOKEN_TILE_PRODUCTS(tile_products_odd, 3, 4, 5)
#undef FREETOKEN_TILE_PRODUCTS

// R rows (the tile's, R <= 16) of one group against every block: per block, the tile
// products into one of two buffers while the vector units update y from the other buffer's
// previous block (a load right after a tile store waits for it to reach the cache).
template <int64_t QT, int R>
void group_amx(const Digits& x, int64_t r0, const uint8_t* group, const uint8_t* wbuf,
               float* out, int64_t n, int64_t g) {
  const int64_t nb = x.nb, stride = nb * kDigitBytes;
  alignas(64) int32_t c[2][3][16][16];
  __m512 y[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  const uint8_t* dg = x.d.data() + r0 * nb * kDigitBytes;
  auto weights = [&](int64_t b) {
    return QT == kQ4_1 ? wbuf + b * 512 : group + b * int_block_bytes(QT) + int_weights_offset(QT);
  };
  tile_products_even<QT>(dg, stride, weights(0), c[0]);
  for (int64_t b = 0; b < nb; ++b) {
    if (b + 1 < nb) {
      if ((b + 1) & 1) {
        tile_products_odd<QT>(dg + (b + 1) * kDigitBytes, stride, weights(b + 1), c[1]);
      } else {
        tile_products_even<QT>(dg + (b + 1) * kDigitBytes, stride, weights(b + 1), c[0]);
      }
    }
    const uint8_t* gb = group + b * int_block_bytes(QT);
    int32_t (*cb)[16][16] = c[b & 1];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      y[r] = block_update<QT>(_mm512_load_si512(cb[0][r]), _mm512_load_si512(cb[1][r]),
                              _mm512_load_si512(cb[2][r]), gb, x.s[i], x.xs[i], y[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (r0 + r) * n + g * kIntGroup, y[r]);
}

template <int64_t QT, int R = 16>
void group_amx_rows(const Digits& x, int64_t r0, int64_t rows, const uint8_t* group,
                    const uint8_t* wbuf, float* out, int64_t n, int64_t g) {
  if constexpr (R > 1) {
    if (rows < R) return group_amx_rows<QT, R - 1>(x, r0, rows, group, wbuf, out, n, g);
  }
  group_amx<QT, R>(x, r0, group, wbuf, out, n, g);
}

// Rows [0, rows) against the groups [g0, g1), in tiles of 16 rows (the digits have zero rows
// past M): per group, Q4_1's nibbles unpacked into bytes once (`wbuf`, every block; Q8_0's
// bytes are read in place).
template <int64_t QT>
void rows_amx(const Digits& x, int64_t rows, const uint8_t* blocks, int64_t n, float* out,
              int64_t g0, int64_t g1, uint8_t* wbuf) {
  const int64_t nb = x.nb;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = blocks + g * nb * int_block_bytes(QT);
    if constexpr (QT == kQ4_1) {
      for (int64_t b = 0; b < nb; ++b)
        for (int t = 0; t < 8; ++t)
          _mm512_store_si512(wbuf + (b * 8 + t) * 64,
                             weight_quad<QT>(group + b * int_block_bytes(QT), t));
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
      group_amx_rows<QT>(x, r0, std::min<int64_t>(16, rows - r0), group, wbuf, out, n, g);
  }
}
#endif

// From this many rows the AMX tiles, below them VNNI (the same floats either way).
#ifndef FREETOKEN_AMX_ROWS
#define FREETOKEN_AMX_ROWS 8
#endif
constexpr int64_t kAmxRows = FREETOKEN_AMX_ROWS;

template <int64_t QT>
void int_linear_impl(const Digits& x, int64_t rows, const uint8_t* blocks, int64_t n,
                     float* out, bool allow_amx) {
  const int64_t groups = (n + kIntGroup - 1) / kIntGroup;
  (void)allow_amx;
#ifdef FREETOKEN_AMX
  if (allow_amx && rows >= kAmxRows && amx_permitted()) {
    freetoken::guided_for(groups, 1, 1, [&](int64_t g0, int64_t g1) {
      configure_tiles(static_cast<int>(std::min<int64_t>(16, rows)));
      thread_local std::vector<uint8_t> wbuf;
      wbuf.resize(x.nb * 512 + 64);
      uint8_t* aligned = reinterpret_cast<uint8_t*>(
          (reinterpret_cast<uintptr_t>(wbuf.data()) + 63) & ~uintptr_t{63});
      rows_amx<QT>(x, rows, blocks, n, out, g0, g1, aligned);
      _tile_release();
    });
    return;
  }
#endif
#ifdef FREETOKEN_VNNI
  freetoken::guided_for(groups, 2, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      switch (std::min<int64_t>(4, rows - r0)) {
        case 1: groups_vnni<QT, 1>(x, r0, blocks, n, out, g0, g1); break;
        case 2: groups_vnni<QT, 2>(x, r0, blocks, n, out, g0, g1); break;
        case 3: groups_vnni<QT, 3>(x, r0, blocks, n, out, g0, g1); break;
        default: groups_vnni<QT, 4>(x, r0, blocks, n, out, g0, g1); break;
      }
    }
  });
#else
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    rows_scalar<QT>(x, rows, blocks, n, out, g0, g1);
  });
#endif
}

template <int64_t QT>
void make_int_blocks(const uint8_t* blocks, int64_t features, int64_t row_bytes,
                     int64_t num_blocks, uint8_t* out) {
  const int64_t groups = (features + kIntGroup - 1) / kIntGroup;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < num_blocks; ++b) {
        uint8_t* gb = out + (g * num_blocks + b) * int_block_bytes(QT);
        std::memset(gb, 0, int_block_bytes(QT));  // the nibbles are or-ed in
        uint8_t* wq = gb + int_weights_offset(QT);
        for (int64_t f = 0; f < kIntGroup; ++f) {
          const FeatureBlocks fb =
              feature_blocks(blocks, features, row_bytes, block_bytes(QT), g * kIntGroup + f);
          const uint8_t* block = fb.first + b * fb.stride;
          if constexpr (QT == kQ4_1) {
            std::memcpy(gb + 4 * f, block, 4);
            std::memcpy(gb + 64 + 4 * f, block + 4, 4);
            for (int k = 0; k < kBlock; ++k) {
              const uint8_t q = k < 16 ? (block[8 + k] & 0x0F) : (block[8 + k - 16] >> 4);
              uint8_t& byte = wq[(k / 8) * 64 + 4 * f + k % 4];
              byte |= (k % 8) < 4 ? q : static_cast<uint8_t>(q << 4);
            }
          } else {
            const float d = half_to_float(block);
            std::memcpy(gb + 4 * f, &d, 4);
            for (int k = 0; k < kBlock; ++k) wq[(k / 4) * 64 + 4 * f + k % 4] = block[2 + k];
          }
        }
      }
  });
}

}  // namespace

namespace freetoken {

bool int_linear_available() {
#ifdef FREETOKEN_VNNI
  return true;
#else
  return false;
#endif
}

at::Tensor gguf_int_blocks(const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "gguf_int_blocks: Q4_1 (3) or Q8_0 (8) only");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              blocks.size(1) % block_bytes(qtype) == 0,
              "gguf_int_blocks: blocks must be the kernel blocks, uint8 [N, K / 32 * block bytes]");
  const int64_t n = blocks.size(0), row_bytes = blocks.size(1);
  const int64_t num_blocks = row_bytes / block_bytes(qtype);
  TORCH_CHECK(n % kIntGroup == 0, "gguf_int_blocks: the output features must be a multiple of ",
              kIntGroup, " (", n, ")");
  // Seen as [N, bytes a feature] (a group-block's bytes are 16 features' share).
  at::Tensor out = at::empty({n, num_blocks * int_block_bytes(qtype) / kIntGroup},
                             blocks.options());
  if (qtype == kQ4_1) {
    make_int_blocks<kQ4_1>(blocks.data_ptr<uint8_t>(), n, row_bytes, num_blocks,
                           out.data_ptr<uint8_t>());
  } else {
    make_int_blocks<kQ8_0>(blocks.data_ptr<uint8_t>(), n, row_bytes, num_blocks,
                           out.data_ptr<uint8_t>());
  }
  return out;
}

// mode: 0 the CPU's paths (VNNI below kAmxRows rows, AMX tiles from there where the CPU and
// the kernel grant them), 1 the scalar reference, 2 VNNI at every row count (tests).
void gguf_linear_int(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, at::Tensor out,
                     int64_t mode) {
  TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "gguf_linear_int: Q4_1 (3) or Q8_0 (8) only");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
              x.is_contiguous(), "gguf_linear_int: x must be a contiguous float32 [M, K] CPU tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "gguf_linear_int: K must be a multiple of 32");
  TORCH_CHECK(mode >= 0 && mode <= 2, "gguf_linear_int: mode 0, 1 or 2");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
              out.size(0) == x.size(0), "gguf_linear_int: out must be float32 [M, N]");
  const int64_t n = out.size(1), nb = x.size(1) / kBlock;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.dim() == 2 &&
              blocks.size(0) == n && n % kIntGroup == 0 &&
              blocks.size(1) * kIntGroup == nb * int_block_bytes(qtype),
              "gguf_linear_int: blocks must be gguf_int_blocks [N, K / 32 * ",
              int_block_bytes(qtype) / kIntGroup, "] (N a multiple of 16)");
  const int64_t rows = x.size(0);
  if (rows == 0 || n == 0) return;
  // Reused across calls; one per thread, as a team's members each make the digits.
  thread_local Digits digits;
  make_digits(x.data_ptr<float>(), rows, x.size(1), digits, mode == 1);
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (mode == 1) {
    const int64_t groups = (n + kIntGroup - 1) / kIntGroup;
    if (qtype == kQ4_1) {
      rows_scalar<kQ4_1>(digits, rows, bp, n, op, 0, groups);
    } else {
      rows_scalar<kQ8_0>(digits, rows, bp, n, op, 0, groups);
    }
    return;
  }
  if (qtype == kQ4_1) {
    int_linear_impl<kQ4_1>(digits, rows, bp, n, op, mode == 0);
  } else {
    int_linear_impl<kQ8_0>(digits, rows, bp, n, op, mode == 0);
  }
}

}  // namespace freetoken

TORCH_LIBRARY_FRAGMENT(freetoken, m) {
  m.def("gguf_int_blocks(Tensor blocks, int qtype) -> Tensor", &freetoken::gguf_int_blocks);
  m.def("gguf_linear_int(Tensor x, Tensor blocks, int qtype, Tensor(a!) out, int mode=0) -> ()",
        &freetoken::gguf_linear_int);
  m.def("int_linear_available() -> bool", &freetoken::int_linear_available);
}
