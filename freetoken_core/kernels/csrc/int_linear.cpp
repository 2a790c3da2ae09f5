// y[M, N] = x[M, K] @ W[N, K]^T from GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
// Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS or MXFP4) in integer arithmetic, on CPUs with AVX-512 VNNI
// (and AMX tiles from a few rows, where the CPU has them): the exact path's numerics there.
// The AMX path is tested on CPUs without AMX by a build whose tile instructions are emulated
// (amx_emulation.h, tests/test_int_linear_amx.py).
//
// Each block of 32 activations of a row is written in 24-bit fixed point against its largest
// magnitude: with 2^e the power of two above max |x|, the scale s = 2^(e - 23) and the
// integers X_k = round(x_k / s) (|X_k| < 2^23, clamped to [-2^23, 2^23 - 1]). x_k / s is
// exact (a power of two), so the only rounding is of each value to the block's grid: an
// error of at most 2^-24 of the block's largest magnitude, the size of float32's own
// rounding of that value (24 significant bits). Each X_k is cut into three 8-bit digits,
// X_k = 65536 h_k + 256 m_k + l_k (h signed, m and l unsigned), and a block of weights
// (integers q: Q2_K 0..3, Q4_1 and Q4_K 0..15, Q5_1 and Q5_K 0..31, Q4_0 -8..7, Q5_0
// -16..15, Q8_0 -128..127, Q3_K -4..3, Q6_K -32..31, IQ4_NL and IQ4_XS their levels
// -127..113, MXFP4 its levels -12..12) meets the block of activations in three integer
// dot products, P_h = sum h_k q_k and likewise P_m, P_l, which are exact. Then, in float32,
// in this order:
//
//   S = fma(P_h, 65536, fma(P_m, 256, P_l))                     the block's sum of X_k q_k
//   y = fma(d, S * s, y)                                         (S * s exact: a power of two)
//   y = fma(m, float(sum_k X_k) * s, y)                (Q4_1, Q5_1, Q4_K, Q5_K: w = d q + m)
//
// block after block from y = 0. The super-block types' blocks are their sub-blocks: Q4_K's
// and Q5_K's d is the super-block's d times the sub-block's 6-bit scale and m is -(dmin times
// its 6-bit min), IQ4_XS's d is d times (its 6-bit scale - 32), all exact float32 products
// (the values the float32 kernel multiplies by); the halves of 16 of Q2_K, Q3_K and Q6_K have
// their own integer scales (Q2_K's 4 bits, Q3_K's 6 bits - 32, Q6_K's int8), which multiply
// the halves' dot products in integers, P_h = sc_a P_h,a + sc_b P_h,b (|P_h| < 2^25: exact),
// and d is the super-block's; Q2_K's halves have their own mins too, m_a = -(dmin times its
// 4-bit min), so its m term is two, y = fma(m_a, float(sum_a X_k) * s, y), then m_b's.
// So the only roundings are the activations' (as above) and these few per block, where the
// float32 path rounds after every one of the 32 products of a block: its error against
// float64 sums is of the same size (tests/test_native_kernels.py holds it to that;
// bench/gguf_linear.py times both kernels), and the exactness tests against transformers
// hold on it.
//
// Batch invariance: integer sums are exact whatever their order, and the float steps above
// are the same for every row, so the results do not depend on M, on which path computes them
// (VNNI below kAmxRows rows, AMX tiles from there) or on the other rows; the scalar path
// computes the same floats (test_native_kernels checks all three against each other).
//
// The weights in this kernel's layout (int_blocks, made at load from the kernel blocks of
// gguf_blocks.h; N a multiple of 16, seen as [N, K / 32 * bytes a feature] uint8): output
// features in groups of 16, group g's units one after the other (a unit: a block of 32
// weights; Q4_K's, Q5_K's, Q6_K's and IQ4_XS's a super-block of 256), a group-unit holding
//   Q4_1: d[16], m[16] as float16, then 4 x 64 bytes: byte 4f + e of vector v is
//         q_f[8v + e] | q_f[8v + 4 + e] << 4                                     (320 bytes)
//   Q8_0: d[16] as float32, then 8 x 64 bytes: byte 4f + e of vector t is q_f[4t + e]  (576)
//   Q4_0: d[16] as float32, then the nibbles (q + 8) as Q4_1's                         (320)
//   Q5_0: d[16] as float32, the low nibbles of q + 16 as Q4_1's, then 64 bytes of their high
//         bits: bit i of byte 4f + e belongs to weight 4i + e                        (384)
//   Q5_1: d[16], m[16] as float16, then the nibbles and fifth bits as Q5_0's          (384)
//   IQ4_NL: d[16] as float32, then the nibbles (level indices) as Q4_1's              (320)
//   MXFP4: e[16] (the file's E8M0 bytes: d = 2^(e - 128), made a float32 as the decoders
//         make it), then the nibbles (level indices) as Q4_1's       (272: the file's bytes)
//   Q4_K: d[16], dmin[16] as float16, sc[8][16] and m[8][16] (the 6-bit scales and mins,
//         a byte each, [sub-block][feature]), then each sub-block's nibbles as Q4_1's
//         (256 bytes each)                                           (2368 bytes: 4.625 bits)
//   Q5_K: as Q4_K, each sub-block's nibbles followed by its fifth bits as Q5_0's
//         (320 bytes each)                                           (2880 bytes: 5.625 bits)
//   IQ4_XS: d[16] as float32, sc[8][16] (int8: the 6-bit scales - 32), then each
//         sub-block's nibbles as Q4_1's                               (2240 bytes: 4.38 bits)
//   Q2_K: d[16], dmin[16] as float16, sc[16][16] (the file's bytes: the 4-bit scale of a
//         half sub-block, its min << 4; [half sub-block][feature]), then per sub-block of 32
//         its two-bit weights in 2 x 64 bytes: bits 2i, 2i + 1 of byte 4f + e of vector v
//         belong to weight 4 (4v + i) + e                       (1344 bytes: 2.625, the file's)
//   Q3_K: d[16] as float32, sc[16][16] (int8: the 6-bit scales - 32), then per sub-block of
//         32 the two low bits of q + 4 as Q2_K's (128 bytes) and their third bits in 64 bytes
//         as Q5_0's fifth bits                                    (1856 bytes: 3.625 bits)
//   Q6_K: d[16] as float32, sc[16][16] (int8, [half sub-block][feature]), then per
//         sub-block of 32 the low nibbles of q + 32 as Q4_1's (256 bytes) and their high two
//         bits in 2 x 64 bytes: bits 2i, 2i + 1 of byte 4f + e of vector u belong to weight
//         4 (4u + i) + e                                               (3392 bytes: 6.6 bits)
// so that 4 consecutive weights of one feature are one 32-bit lane, as VNNI's dot products
// and AMX's B tiles take them (low nibbles: weights 8v..8v+3, high: 8v+4..8v+7).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <optional>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_types.h"
#include "ops.h"
#include "parallel.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(FREETOKEN_AVX2)
#define FREETOKEN_VNNI 1
#endif
#if defined(FREETOKEN_VNNI) && defined(FREETOKEN_AMX_EMULATE)
// The tests' build of the AMX path on a CPU without AMX: the tile instructions in software.
#define FREETOKEN_AMX 1
#include "amx_emulation.h"
#elif defined(FREETOKEN_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && \
    defined(__linux__)
#define FREETOKEN_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define FT_TILE_LOADCONFIG(config) _tile_loadconfig(config)
#define FT_TILE_RELEASE() _tile_release()
#define FT_TILE_LOADD(tile, base, stride) _tile_loadd(tile, base, stride)
#define FT_TILE_STORED(tile, base, stride) _tile_stored(tile, base, stride)
#define FT_TILE_ZERO(tile) _tile_zero(tile)
#define FT_TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#define FT_TILE_DPBSUD(c, a, b) _tile_dpbsud(c, a, b)
#define FT_TILE_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)
#define FT_TILE_DPBUUD(c, a, b) _tile_dpbuud(c, a, b)
#endif

namespace {

using namespace freetoken::gguf;
constexpr int64_t kQ4_0 = types::Q4_0, kQ5_0 = types::Q5_0, kQ5_1 = types::Q5_1,
                  kQ2_K = types::Q2_K, kQ3_K = types::Q3_K, kQ4_K = types::Q4_K,
                  kQ5_K = types::Q5_K, kQ6_K = types::Q6_K, kIQ4_NL = types::IQ4_NL,
                  kIQ4_XS = types::IQ4_XS, kMXFP4 = types::MXFP4;

constexpr int64_t kIntTypes[] = {kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ2_K, kQ3_K,
                                 kQ4_K, kQ5_K, kQ6_K, kIQ4_NL, kIQ4_XS, kMXFP4};
constexpr bool int_type(int64_t qt) {
  for (int64_t t : kIntTypes)
    if (t == qt) return true;
  return false;
}
// The types whose weights are unsigned (0..3, 0..15, 0..31) with a min (w = d q + m); the
// others' are signed (q - 8, q - 16, int8, q - 4, q - 32, IQ4's and MXFP4's levels): VNNI's
// unsigned operand against h is then q + 128, and 128 * sum(h) is taken off after the block.
constexpr bool with_min(int64_t qt) {
  return qt == kQ4_1 || qt == kQ5_1 || qt == kQ2_K || qt == kQ4_K || qt == kQ5_K;
}
constexpr bool signed_weights(int64_t qt) { return !with_min(qt); }
constexpr bool super_blocks(int64_t qt) {
  return qt == kQ2_K || qt == kQ3_K || qt == kQ4_K || qt == kQ5_K || qt == kQ6_K ||
         qt == kIQ4_XS;
}
// Each half of 16 weights of a block with its own integer scale (and Q2_K's its own min).
constexpr bool halves(int64_t qt) { return qt == kQ2_K || qt == kQ3_K || qt == kQ6_K; }
// Two bits a weight in 2 x 64 bytes a block (Q3_K's third in 64 more), not nibbles.
constexpr bool two_bits(int64_t qt) { return qt == kQ2_K || qt == kQ3_K; }
// The offset of the signed types' stored weights (stored q + kZero, all but Q8_0's and the
// levels').
constexpr int weight_zero(int64_t qt) {
  return qt == kQ4_0 ? 8 : qt == kQ5_0 ? 16 : qt == kQ3_K ? 4 : qt == kQ6_K ? 32 : 0;
}
// Q4_K's and Q5_K's sub-block scales and mins (d, dmin, 6-bit scale and min a byte each).
constexpr bool k4_scales(int64_t qt) { return qt == kQ4_K || qt == kQ5_K; }
// A fifth bit a weight, in 64 bytes after the block's nibbles.
constexpr bool fifth_bit(int64_t qt) { return qt == kQ5_0 || qt == kQ5_1 || qt == kQ5_K; }
// Nibbles that index a table of 16 int8 levels (the weights): IQ4_NL's and IQ4_XS's, MXFP4's.
constexpr bool with_levels(int64_t qt) { return qt == kIQ4_NL || qt == kIQ4_XS || qt == kMXFP4; }
constexpr const int8_t* level_values(int64_t qt) {
  return qt == kMXFP4 ? types::detail::kMXFP4Values : types::detail::kIQ4Values;
}
constexpr int64_t kIntGroup = 16;  // features of a group-unit
// Blocks of 32 a unit, and a group-unit's bytes (see above).
constexpr int64_t unit_blocks(int64_t qt) { return super_blocks(qt) ? 8 : 1; }
constexpr int64_t int_unit_bytes(int64_t qt) {
  return qt == kMXFP4 ? 272
         : qt == kQ4_0 || qt == kIQ4_NL || qt == kQ4_1 ? 320
         : qt == kQ5_0 || qt == kQ5_1 ? 384
         : qt == kQ8_0 ? 576 : qt == kQ2_K ? 1344 : qt == kQ3_K ? 1856 : qt == kQ4_K ? 2368
         : qt == kQ5_K ? 2880 : qt == kIQ4_XS ? 2240 : 3392;
}
// Where block j's weights start in a group-unit.
constexpr int64_t int_weights_offset(int64_t qt, int64_t j) {
  return qt == kMXFP4 ? 16
         : qt == kQ4_0 || qt == kQ4_1 || qt == kQ5_0 || qt == kQ5_1 || qt == kQ8_0 ||
                 qt == kIQ4_NL ? 64
         : qt == kQ2_K ? 320 + 128 * j : qt == kQ3_K ? 320 + 192 * j
         : qt == kQ4_K ? 320 + 256 * j : qt == kQ5_K ? 320 + 320 * j
         : qt == kIQ4_XS ? 192 + 256 * j : 320 + 384 * j;
}
// Where a group-unit keeps its scales (see above): the types with a min their m (dmin) as
// float16 after d, the super-block types their sub-block scales after d (and m), Q4_K and
// Q5_K their sub-block mins after those.
constexpr int64_t kMinAt = 32, kScalesAt = 64, kMinsAt = 192;
// A unit's bytes in the kernel blocks the layout is made from (gguf_blocks.h's for Q4_1 and
// Q8_0; the K-quants' super-blocks as the file stores them).
constexpr int64_t kernel_unit_bytes(int64_t qt) {
  return qt == kQ4_0 || qt == kIQ4_NL ? 18 : qt == kMXFP4 ? 17 : qt == kQ5_0 ? 22
         : qt == kQ5_1 ? 24
         : qt == kQ2_K ? 84 : qt == kQ3_K ? 110 : qt == kQ4_K ? 144 : qt == kQ5_K ? 176
         : qt == kQ6_K ? 210 : qt == kIQ4_XS ? 136 : block_bytes(qt);
}
constexpr int64_t kDigitBytes = 3 * kBlock;  // a row's block: h[32], m[32], l[32]

// The activations as digits: per row and block, the 96 digit bytes, and the block's floats.
struct Digits {
  std::vector<uint8_t> d;    // [rows rounded up to 16, nb, 96]: rows past M are zeros
  std::vector<float> s;      // [rows, nb]: the scale 2^(e - 23)
  std::vector<float> xs;     // [rows, nb]: float(sum of X) * s
  std::vector<int32_t> sh;   // [rows, nb]: sum of h (the correction of VNNI sums of q + 128)
  std::vector<int32_t> sh16; // [rows, nb]: the same over the block's first 16 (the halves)
  std::vector<float> xsh;    // [rows, nb, 2]: float(sum of X over each half) * s (Q2_K's mins)
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

// One row's block of 32: its digits, scale, scaled sums (the block's and its halves') and
// sums of h.
inline void digits_block(const float* x, uint8_t* dg, float* s_out, float* xs_out,
                         float* xsh_out, int32_t* sh_out, int32_t* sh16_out) {
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
    *s_out = *xs_out = xsh_out[0] = xsh_out[1] = std::numeric_limits<float>::quiet_NaN();
    *sh_out = *sh16_out = 0;
    return;
  }
  const int e = block_exponent(amax);
  const float up = std::ldexp(1.0f, 23 - e);
  int32_t sum = 0, sum16 = 0, sum_h = 0, sum_h16 = 0;
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
    if (k == 15) sum_h16 = sum_h, sum16 = sum;
  }
  const float s = std::ldexp(1.0f, e - 23);
  *s_out = s;
  *xs_out = static_cast<float>(sum) * s;
  xsh_out[0] = static_cast<float>(sum16) * s;
  xsh_out[1] = static_cast<float>(sum - sum16) * s;
  *sh_out = sum_h;
  *sh16_out = sum_h16;
}

#ifdef FREETOKEN_VNNI
// digits_block on vectors: the same integers and floats.
inline void digits_block_avx512(const float* x, uint8_t* dg, float* s_out, float* xs_out,
                                float* xsh_out, int32_t* sh_out, int32_t* sh16_out) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const __m512 abs_max = _mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b));
  // Not finite (inf or NaN): an exponent field of all ones in a or b.
  const __m512i exponent = _mm512_set1_epi32(0x7F800000);
  const __mmask16 bad =
      _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(a), exponent), exponent) |
      _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(b), exponent), exponent);
  if (bad) return digits_block(x, dg, s_out, xs_out, xsh_out, sh_out, sh16_out);
  const int e = block_exponent(_mm512_reduce_max_ps(abs_max));
  const __m512 up = _mm512_set1_ps(std::ldexp(1.0f, 23 - e));
  const __m512i lo = _mm512_set1_epi32(-(1 << 23)), hi = _mm512_set1_epi32((1 << 23) - 1);
  __m512i sum[2], sum_h[2];
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
    sum[half] = q;
    sum_h[half] = h;
  }
  const float s = std::ldexp(1.0f, e - 23);
  *s_out = s;
  const int32_t sum16 = _mm512_reduce_add_epi32(sum[0]),
                sum32 = sum16 + _mm512_reduce_add_epi32(sum[1]);
  *xs_out = static_cast<float>(sum32) * s;
  xsh_out[0] = static_cast<float>(sum16) * s;
  xsh_out[1] = static_cast<float>(sum32 - sum16) * s;
  *sh16_out = _mm512_reduce_add_epi32(sum_h[0]);
  *sh_out = *sh16_out + _mm512_reduce_add_epi32(sum_h[1]);
}
#endif

void make_digits(const float* x, int64_t rows, int64_t k, Digits& out, bool scalar) {
  const int64_t nb = k / kBlock, padded = (rows + 15) / 16 * 16;
  out.nb = nb;
  out.d.resize(padded * nb * kDigitBytes);
  out.s.resize(rows * nb);
  out.xs.resize(rows * nb);
  out.sh.resize(rows * nb);
  out.sh16.resize(rows * nb);
  out.xsh.resize(rows * nb * 2);
  std::memset(out.d.data() + rows * nb * kDigitBytes, 0, (padded - rows) * nb * kDigitBytes);
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
#ifdef FREETOKEN_VNNI
      if (!scalar) {
        digits_block_avx512(x + b * kBlock, out.d.data() + b * kDigitBytes, &out.s[b],
                            &out.xs[b], &out.xsh[2 * b], &out.sh[b], &out.sh16[b]);
        continue;
      }
#endif
      digits_block(x + b * kBlock, out.d.data() + b * kDigitBytes, &out.s[b], &out.xs[b],
                   &out.xsh[2 * b], &out.sh[b], &out.sh16[b]);
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

// Group g's unit holding block b, and b's index in it.
template <int64_t QT>
inline const uint8_t* group_unit(const uint8_t* blocks, int64_t nb, int64_t g, int64_t b) {
  constexpr int64_t ub = unit_blocks(QT);
  return blocks + (g * (nb / ub) + b / ub) * int_unit_bytes(QT);
}

// Block j's 32 weights of feature f (in a group-unit) as the integers of the dot products.
template <int64_t QT>
inline int32_t weight_int(const uint8_t* gu, int64_t j, int f, int k) {
  const uint8_t* w = gu + int_weights_offset(QT, j);
  if constexpr (QT == kQ8_0) {
    return static_cast<int8_t>(w[(k / 4) * 64 + 4 * f + k % 4]);
  } else if constexpr (two_bits(QT)) {
    const int32_t low = (w[(k / 16) * 64 + 4 * f + k % 4] >> (2 * ((k / 4) % 4))) & 3;
    if constexpr (QT == kQ3_K) return (low | ((w[128 + 4 * f + k % 4] >> (k / 4)) & 1) << 2) - 4;
    return low;
  } else {
    const uint8_t byte = w[(k / 8) * 64 + 4 * f + k % 4];
    const int32_t low = (k % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
    if constexpr (QT == kQ6_K) {
      const int32_t high = (w[256 + (k / 16) * 64 + 4 * f + k % 4] >> (2 * ((k / 4) % 4))) & 3;
      return (low | high << 4) - 32;
    }
    if constexpr (fifth_bit(QT)) {
      const int32_t q = low | ((w[256 + 4 * f + k % 4] >> (k / 4)) & 1) << 4;
      return QT == kQ5_0 ? q - 16 : q;
    }
    if constexpr (with_levels(QT)) return level_values(QT)[low];
    if constexpr (QT == kQ4_0) return low - 8;
    return low;
  }
}

// Block j's d and m of feature f (m: Q4_1's, -(dmin * min) for Q4_K, 0 for the others).
template <int64_t QT>
inline float block_d(const uint8_t* gu, int64_t j, int f) {
  if constexpr (QT == kMXFP4) return types::detail::e8m0_half(gu[f]);
  const float d = with_min(QT) ? half_to_float(gu + 2 * f) : load_float(gu + 4 * f);
  if constexpr (k4_scales(QT)) return d * static_cast<float>(gu[kScalesAt + 16 * j + f]);
  if constexpr (QT == kIQ4_XS)
    return d * static_cast<float>(static_cast<int8_t>(gu[kScalesAt + 16 * j + f]));
  return d;
}
template <int64_t QT>
inline float block_m(const uint8_t* gu, int64_t j, int f) {
  if constexpr (QT == kQ4_1 || QT == kQ5_1) return half_to_float(gu + kMinAt + 2 * f);
  if constexpr (k4_scales(QT))
    return -(half_to_float(gu + kMinAt + 2 * f) * static_cast<float>(gu[kMinsAt + 16 * j + f]));
  return 0.f;
}

// The integer scale of half hf of block j of feature f (the types with halves), and Q2_K's
// m of that half, -(dmin * min) (its byte: the scale in the low nibble, the min in the high).
template <int64_t QT>
inline int32_t half_scale(const uint8_t* gu, int64_t j, int hf, int f) {
  const uint8_t byte = gu[kScalesAt + 16 * (2 * j + hf) + f];
  if constexpr (QT == kQ2_K) return byte & 15;
  return static_cast<int8_t>(byte);
}
inline float half_min_q2_k(const uint8_t* gu, int64_t j, int hf, int f) {
  return -(half_to_float(gu + kMinAt + 2 * f) *
           static_cast<float>(gu[kScalesAt + 16 * (2 * j + hf) + f] >> 4));
}

inline float block_value(int32_t ph, int32_t pm, int32_t pl) {
  return std::fma(static_cast<float>(ph), 65536.f,
                  std::fma(static_cast<float>(pm), 256.f, static_cast<float>(pl)));
}

// `ldo`: floats between rows of out (a linear of parts writes into a wider output).
template <int64_t QT>
void rows_scalar(const Digits& x, int64_t rows, const uint8_t* blocks, int64_t ldo, float* out,
                 int64_t g0, int64_t g1) {
  const int64_t nb = x.nb;
  for (int64_t g = g0; g < g1; ++g)
    for (int f = 0; f < kIntGroup; ++f)
      for (int64_t r = 0; r < rows; ++r) {
        float y = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* gu = group_unit<QT>(blocks, nb, g, b);
          const int64_t j = b % unit_blocks(QT);
          const uint8_t* dg = x.d.data() + (r * nb + b) * kDigitBytes;
          int32_t p[2][3] = {{0, 0, 0}, {0, 0, 0}};  // the halves' dot products
          for (int k = 0; k < kBlock; ++k) {
            const int32_t q = weight_int<QT>(gu, j, f, k);
            int32_t* ph = p[k / 16];
            ph[0] += static_cast<int8_t>(dg[k]) * q;
            ph[1] += dg[kBlock + k] * q;
            ph[2] += dg[2 * kBlock + k] * q;
          }
          int32_t sum[3];
          for (int i = 0; i < 3; ++i) {
            if constexpr (halves(QT)) {
              sum[i] = half_scale<QT>(gu, j, 0, f) * p[0][i] + half_scale<QT>(gu, j, 1, f) * p[1][i];
            } else {
              sum[i] = p[0][i] + p[1][i];
            }
          }
          const int64_t i = r * nb + b;
          y = std::fma(block_d<QT>(gu, j, f), block_value(sum[0], sum[1], sum[2]) * x.s[i], y);
          if constexpr (QT == kQ2_K) {
            y = std::fma(half_min_q2_k(gu, j, 0, f), x.xsh[2 * i], y);
            y = std::fma(half_min_q2_k(gu, j, 1, f), x.xsh[2 * i + 1], y);
          } else if constexpr (with_min(QT)) {
            y = std::fma(block_m<QT>(gu, j, f), x.xs[i], y);
          }
        }
        out[r * ldo + g * kIntGroup + f] = y;
      }
}

#ifdef FREETOKEN_VNNI
// Block j's d and m of the 16 features (block_d, block_m lane by lane).
template <int64_t QT>
inline __m512 block_d16(const uint8_t* gu, int64_t j) {
  if constexpr (QT == kMXFP4) {
    // e8m0_half lane by lane: (e - 1) << 23 for e >= 2, 0x00200000 << e (2^-128, 2^-127)
    // below.
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gu)));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 low = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(low, normal, tiny));
  }
  // (The types with a min keep d and m as float16: one conversion a block.)
  const __m512 d = with_min(QT)
      ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gu)))
      : _mm512_loadu_ps(reinterpret_cast<const float*>(gu));
  if constexpr (k4_scales(QT)) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gu + kScalesAt + 16 * j));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
  }
  if constexpr (QT == kIQ4_XS) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gu + kScalesAt + 16 * j));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
  }
  return d;
}
template <int64_t QT>
inline __m512 block_m16(const uint8_t* gu, int64_t j) {
  if constexpr (!with_min(QT)) return _mm512_setzero_ps();  // (not read: no m term)
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gu + kMinAt)));
  if constexpr (k4_scales(QT)) {
    const __m128i mn = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gu + kMinsAt + 16 * j));
    // -(dmin * min): a product and a sign, as block_m.
    return _mm512_xor_ps(_mm512_set1_ps(-0.f),
                         _mm512_mul_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn))));
  }
  return m;
}

// The block's update of y for one row and one group, from the three dot products (the
// scalar path's operations, lane by lane); d, m: the block's (block_d16, block_m16).
template <int64_t QT>
inline __m512 block_update(__m512i ph, __m512i pm, __m512i pl, __m512 d, __m512 m, float s,
                           float xs, __m512 y) {
  const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ph), _mm512_set1_ps(65536.f),
                                   _mm512_fmadd_ps(_mm512_cvtepi32_ps(pm),
                                                   _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(pl)));
  y = _mm512_fmadd_ps(d, _mm512_mul_ps(v, _mm512_set1_ps(s)), y);
  if constexpr (with_min(QT) && !halves(QT)) y = _mm512_fmadd_ps(m, _mm512_set1_ps(xs), y);
  return y;
}

// The integer scales of a block's halves for the 16 features (half_scale lane by lane).
template <int64_t QT>
inline void half_scales16(const uint8_t* gu, int64_t j, __m512i sc[2]) {
  for (int hf = 0; hf < 2; ++hf) {
    const __m128i b =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(gu + kScalesAt + 16 * (2 * j + hf)));
    sc[hf] = QT == kQ2_K ? _mm512_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(15)))
                         : _mm512_cvtepi8_epi32(b);
  }
}

// Q2_K's mins: y += m_a * xs_a, then m_b * xs_b (half_min_q2_k lane by lane; xsh: the row's
// block's two scaled half sums).
inline __m512 q2_k_min_update(const uint8_t* gu, int64_t j, const float* xsh, __m512 y) {
  const __m512 dmin =
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gu + kMinAt)));
  for (int hf = 0; hf < 2; ++hf) {
    const __m128i b =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(gu + kScalesAt + 16 * (2 * j + hf)));
    const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(
        _mm_srli_epi16(b, 4), _mm_set1_epi8(15))));
    const __m512 m = _mm512_xor_ps(_mm512_set1_ps(-0.f), _mm512_mul_ps(dmin, mn));
    y = _mm512_fmadd_ps(m, _mm512_set1_ps(xsh[hf]), y);
  }
  return y;
}

// Weights 4t..4t+3 of the 16 features of a block (w: its weights in a group-unit), one
// feature a 32-bit lane; Q4_0's, Q5_0's, Q3_K's and Q6_K's as stored, before the - 8, - 16,
// - 4, - 32.
template <int64_t QT>
inline __m512i weight_quad(const uint8_t* w, int t) {
  if constexpr (QT == kQ8_0) {
    return _mm512_loadu_si512(w + t * 64);
  } else if constexpr (two_bits(QT)) {
    // Bits 2i, 2i + 1 (i = t % 4) of vector t / 4 to bits 0, 1; Q3_K's third bit: bit t of
    // the 64 bytes after them to bit 2.
    const __m512i v = _mm512_loadu_si512(w + (t / 4) * 64);
    const int i = t % 4;
    const __m512i low = i == 0 ? v : _mm512_srli_epi16(v, 2 * i);
    __m512i q = _mm512_and_si512(low, _mm512_set1_epi8(3));
    if constexpr (QT == kQ3_K) {
      const __m512i hv = _mm512_loadu_si512(w + 128);
      const __m512i moved = t < 2 ? _mm512_slli_epi16(hv, 2 - t)
                            : t == 2 ? hv : _mm512_srli_epi16(hv, t - 2);
      q = _mm512_or_si512(q, _mm512_and_si512(moved, _mm512_set1_epi8(4)));
    }
    return q;
  } else {
    const __m512i v = _mm512_loadu_si512(w + (t / 2) * 64);
    const __m512i nib = (t & 1) ? _mm512_srli_epi16(v, 4) : v;
    __m512i q = _mm512_and_si512(nib, _mm512_set1_epi8(0x0F));
    if constexpr (QT == kQ6_K) {
      // Bits 2i, 2i + 1 (i = t % 4) of the high-bit bytes to bits 4, 5.
      const __m512i hv = _mm512_loadu_si512(w + 256 + (t / 4) * 64);
      const int i = t % 4;
      const __m512i moved = i == 0 ? _mm512_slli_epi16(hv, 4)
                            : i == 1 ? _mm512_slli_epi16(hv, 2)
                            : i == 2 ? hv
                                     : _mm512_srli_epi16(hv, 2);
      q = _mm512_or_si512(q, _mm512_and_si512(moved, _mm512_set1_epi8(0x30)));
    }
    if constexpr (with_levels(QT)) {
      // The levels (int8), looked up by nibble in each 128-bit lane.
      const __m512i levels = _mm512_broadcast_i32x4(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(level_values(QT))));
      q = _mm512_shuffle_epi8(levels, q);
    }
    if constexpr (fifth_bit(QT)) {
      // Bit t of the high-bit bytes to bit 4.
      const __m512i hv = _mm512_loadu_si512(w + 256);
      const __m512i moved = t < 4 ? _mm512_slli_epi16(hv, 4 - t) : _mm512_srli_epi16(hv, t - 4);
      q = _mm512_or_si512(q, _mm512_and_si512(moved, _mm512_set1_epi8(0x10)));
    }
    return q;
  }
}

// R rows of one group's VNNI dot products: 3 x R integer accumulators per block (Q2_K, Q3_K,
// Q6_K: per half), then the block's update of R float accumulators.
template <int64_t QT, int R>
void rows_vnni(const Digits& x, int64_t r0, const uint8_t* blocks, int64_t ldo, float* out,
               int64_t g) {
  const int64_t nb = x.nb;
  constexpr int64_t ub = unit_blocks(QT), block_share = int_unit_bytes(QT) / ub;
  constexpr int kHalves = halves(QT) ? 2 : 1;
  const uint8_t* group = blocks + g * nb * block_share;
  __m512 y[R];
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* gu = group + (b / ub) * int_unit_bytes(QT);
    const int64_t j = b % ub;
    // The group's units are one stream: a block's share of its bytes, 4 KB ahead.
    prefetch_range(group + b * block_share + kPrefetchBytes, block_share);
    const uint8_t* wp = gu + int_weights_offset(QT, j);
    __m512i p[R][kHalves][3];
    for (int r = 0; r < R; ++r)
      for (int hf = 0; hf < kHalves; ++hf)
        for (int i = 0; i < 3; ++i) p[r][hf][i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      // w: the weights as VNNI's signed operand; wu: as its unsigned one (signed weights:
      // q + 128, the 128 * sum(h) taken off after the block).
      const __m512i w8 = weight_quad<QT>(wp, t);
      __m512i w = w8, wu = w8;
      if constexpr (QT == kQ8_0 || with_levels(QT)) {
        wu = _mm512_xor_si512(w8, _mm512_set1_epi8(static_cast<char>(0x80)));
      } else if constexpr (signed_weights(QT)) {
        constexpr int kZero = weight_zero(QT);  // q - kZero
        w = _mm512_sub_epi8(w8, _mm512_set1_epi8(kZero));
        wu = _mm512_add_epi8(w8, _mm512_set1_epi8(128 - kZero));
      }
      const int hf = kHalves == 2 ? t / 4 : 0;
      for (int r = 0; r < R; ++r) {
        const uint8_t* dg = x.d.data() + ((r0 + r) * nb + b) * kDigitBytes + 4 * t;
        int32_t hq, mq, lq;
        std::memcpy(&hq, dg, 4);
        std::memcpy(&mq, dg + kBlock, 4);
        std::memcpy(&lq, dg + 2 * kBlock, 4);
        const __m512i h = _mm512_set1_epi32(hq), m = _mm512_set1_epi32(mq),
                      l = _mm512_set1_epi32(lq);
        p[r][hf][0] = _mm512_dpbusd_epi32(p[r][hf][0], wu, h);  // q (u8) x h (s8)
        p[r][hf][1] = _mm512_dpbusd_epi32(p[r][hf][1], m, w);  // m (u8) x q (s8)
        p[r][hf][2] = _mm512_dpbusd_epi32(p[r][hf][2], l, w);
      }
    }
    const __m512 d = block_d16<QT>(gu, j);
    const __m512 mv = block_m16<QT>(gu, j);
    __m512i sc[2];
    if constexpr (halves(QT)) half_scales16<QT>(gu, j, sc);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      __m512i ps[3];
      if constexpr (halves(QT)) {
        __m512i h0 = p[r][0][0], h1 = p[r][1][0];
        if constexpr (signed_weights(QT)) {
          h0 = _mm512_sub_epi32(h0, _mm512_set1_epi32(128 * x.sh16[i]));
          h1 = _mm512_sub_epi32(h1, _mm512_set1_epi32(128 * (x.sh[i] - x.sh16[i])));
        }
        ps[0] = _mm512_add_epi32(_mm512_mullo_epi32(sc[0], h0), _mm512_mullo_epi32(sc[1], h1));
        for (int k = 1; k < 3; ++k)
          ps[k] = _mm512_add_epi32(_mm512_mullo_epi32(sc[0], p[r][0][k]),
                                   _mm512_mullo_epi32(sc[1], p[r][1][k]));
      } else {
        for (int k = 0; k < 3; ++k) ps[k] = p[r][0][k];
        if constexpr (signed_weights(QT))
          ps[0] = _mm512_sub_epi32(ps[0], _mm512_set1_epi32(128 * x.sh[i]));
      }
      y[r] = block_update<QT>(ps[0], ps[1], ps[2], d, mv, x.s[i], x.xs[i], y[r]);
      if constexpr (QT == kQ2_K) y[r] = q2_k_min_update(gu, j, &x.xsh[2 * i], y[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (r0 + r) * ldo + g * kIntGroup, y[r]);
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
void groups_vnni(const Digits& x, int64_t r0, const uint8_t* blocks, int64_t ldo, float* out,
                 int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) rows_vnni<QT, R>(x, r0, blocks, ldo, out, g);
}
#endif

#ifdef FREETOKEN_AMX
// The tiles take every type of the kernel. A tile product is 16 rows' digits of a
// block against 16 features' 32 weights, the weights as bytes in B (unpacked once a group:
// nibbles, two bits, fifth bits, Q3_K's and Q6_K's high bits, IQ4's and MXFP4's levels;
// Q8_0's read in place), unsigned for the types with a min and signed for the others (q - 8,
// q - 16, q - 4, q - 32, the levels, int8), so that every product is exact without the VNNI
// path's q + 128 correction: h (s8) against the weights in TDPBSUD / TDPBSSD, m and l (u8) in
// TDPBUUD / TDPBUSD. The halves of 16 of Q2_K, Q3_K and Q6_K have their own scales: two
// products of 16 weights a digit (group_amx_halves).

// Linux grants a process the AMX tile state on request (once); false where it refuses.
bool amx_permitted() {
#ifdef FREETOKEN_AMX_EMULATE
  return true;
#endif
  static const bool ok = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Cleared by gguf_int_amx_allow(false): the process then computes on VNNI at every row
// count (kernels/__init__.py: FREETOKEN_AMX=0, or a probe in a child process found that the
// tiles trap or disagree with VNNI on this machine, as on VMs that list AMX but trap it).
std::atomic<bool> amx_allowed{true};
bool amx_usable() { return amx_allowed.load(std::memory_order_relaxed) && amx_permitted(); }

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
// stores shrink). With `halves` (Q2_K, Q3_K, Q6_K): tiles 0-2 and 3-5 the first and the second half's
// products, 6 a half's digits (rows x 16 bytes), 7 a half's weights (4 rows).
void configure_tiles(int rows, bool halves) {
  TileConfig c;
  for (int t = 0; t < 6; ++t) c.colsb[t] = 64, c.rows[t] = rows;
  c.colsb[6] = halves ? 16 : 32, c.rows[6] = rows;
  c.colsb[7] = 64, c.rows[7] = halves ? 4 : 8;
  FT_TILE_LOADCONFIG(&c);
}

// The three tile products of a block for the tile's rows (digits from dg, `stride` bytes
// between rows) into the tiles C0..C2, stored to c. (The tile intrinsics take their tile
// numbers as literals: a macro makes one function for each set.)
// Tile C += the digits in tile 6 against the weights in tile 7, for the type QT in scope: h
// (s8) in FREETOKEN_TILE_H, m or l (u8) in FREETOKEN_TILE_ML, against unsigned weights (the
// types with a min) or signed ones (the others: exact, no correction).
#define FREETOKEN_TILE_H(C)              \
  if constexpr (with_min(QT)) {          \
    FT_TILE_DPBSUD(C, 6, 7);             \
  } else {                               \
    FT_TILE_DPBSSD(C, 6, 7);             \
  }
#define FREETOKEN_TILE_ML(C)             \
  if constexpr (with_min(QT)) {          \
    FT_TILE_DPBUUD(C, 6, 7);             \
  } else {                               \
    FT_TILE_DPBUSD(C, 6, 7);             \
  }
#define FREETOKEN_TILE_PRODUCTS(NAME, C0, C1, C2)                                         \
  template <int64_t QT>                                                                    \
  inline void NAME(const uint8_t* dg, int64_t stride, const uint8_t* weights,              \
                   int32_t(*c)[16][16]) {                                                  \
    FT_TILE_LOADD(7, weights, 64);                                                         \
    FT_TILE_ZERO(C0);                                                                      \
    FT_TILE_ZERO(C1);                                                                      \
    FT_TILE_ZERO(C2);                                                                      \
    FT_TILE_LOADD(6, dg, stride);                                                          \
    FREETOKEN_TILE_H(C0)                                                                   \
    FT_TILE_LOADD(6, dg + kBlock, stride);                                                 \
    FREETOKEN_TILE_ML(C1)                                                                  \
    FT_TILE_LOADD(6, dg + 2 * kBlock, stride);                                             \
    FREETOKEN_TILE_ML(C2)                                                                  \
    FT_TILE_STORED(C0, c[0], 64);                                                          \
    FT_TILE_STORED(C1, c[1], 64);                                                          \
    FT_TILE_STORED(C2, c[2], 64);                                                          \
  }
FREETOKEN_TILE_PRODUCTS(tile_products_even, 0, 1, 2)
FREETOKEN_TILE_PRODUCTS(tile_products_odd, 3, 4, 5)
#undef FREETOKEN_TILE_PRODUCTS

// Weights 4t..4t+3 of the 16 features of a block as the tiles' B takes them: weight_quad's
// bytes, the signed types' less their offset (Q4_0 8, Q5_0 16, Q3_K 4, Q6_K 32; IQ4's and
// MXFP4's levels and Q8_0's bytes are signed already).
template <int64_t QT>
inline __m512i amx_weight_quad(const uint8_t* w, int t) {
  const __m512i q = weight_quad<QT>(w, t);
  if constexpr (weight_zero(QT) != 0) return _mm512_sub_epi8(q, _mm512_set1_epi8(weight_zero(QT)));
  return q;
}

// Group g's blocks, where the tiles read them: `wbuf` (block b's 8 x 64 bytes at b * 512),
// unpacked from the group's units, or Q8_0's in place.
template <int64_t QT>
const uint8_t* amx_weights(const uint8_t* group, int64_t nb, uint8_t* wbuf) {
  if constexpr (QT == kQ8_0) {
    return group + int_weights_offset(QT, 0);  // (block b at b * int_unit_bytes: 576)
  } else {
    constexpr int64_t ub = unit_blocks(QT);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wp =
          group + (b / ub) * int_unit_bytes(QT) + int_weights_offset(QT, b % ub);
      for (int t = 0; t < 8; ++t)
        _mm512_store_si512(wbuf + (b * 8 + t) * 64, amx_weight_quad<QT>(wp, t));
    }
    return wbuf;
  }
}
constexpr int64_t amx_weight_stride(int64_t qt) { return qt == kQ8_0 ? int_unit_bytes(qt) : 512; }

// R rows (the tile's, R <= 16) of one group against every block: per block, the tile
// products into one of two buffers while the vector units update y from the other buffer's
// previous block (a load right after a tile store waits for it to reach the cache).
template <int64_t QT, int R>
void group_amx(const Digits& x, int64_t r0, const uint8_t* group, const uint8_t* weights,
               float* out, int64_t n, int64_t g) {
  const int64_t nb = x.nb, stride = nb * kDigitBytes;
  constexpr int64_t ub = unit_blocks(QT), ws = amx_weight_stride(QT);
  alignas(64) int32_t c[2][3][16][16];
  __m512 y[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  const uint8_t* dg = x.d.data() + r0 * nb * kDigitBytes;
  tile_products_even<QT>(dg, stride, weights, c[0]);
  for (int64_t b = 0; b < nb; ++b) {
    if (b + 1 < nb) {
      if ((b + 1) & 1) {
        tile_products_odd<QT>(dg + (b + 1) * kDigitBytes, stride, weights + (b + 1) * ws,
                              c[1]);
      } else {
        tile_products_even<QT>(dg + (b + 1) * kDigitBytes, stride, weights + (b + 1) * ws,
                               c[0]);
      }
    }
    const uint8_t* gu = group + (b / ub) * int_unit_bytes(QT);
    const __m512 d = block_d16<QT>(gu, b % ub), m = block_m16<QT>(gu, b % ub);
    int32_t (*cb)[16][16] = c[b & 1];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      y[r] = block_update<QT>(_mm512_load_si512(cb[0][r]), _mm512_load_si512(cb[1][r]),
                              _mm512_load_si512(cb[2][r]), d, m, x.s[i], x.xs[i], y[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (r0 + r) * n + g * kIntGroup, y[r]);
}

// The types with halves (Q2_K, Q3_K, Q6_K): each block's halves of 16 weights in their own
// products (tiles 0-2 and 3-5, a half's digits and weights in 6 and 7: configure_tiles with
// `halves`), then the halves' sums scaled by their integer scales, as the VNNI path does, and
// the block's update (and Q2_K's mins).
template <int64_t QT, int R>
void group_amx_halves(const Digits& x, int64_t r0, const uint8_t* group,
                      const uint8_t* weights, float* out, int64_t n, int64_t g) {
  constexpr int64_t ub = unit_blocks(QT);
  const int64_t nb = x.nb, stride = nb * kDigitBytes;
  alignas(64) int32_t c[2][3][16][16];
  __m512 y[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  const uint8_t* dg = x.d.data() + r0 * nb * kDigitBytes;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* db = dg + b * kDigitBytes;
    const uint8_t* wb = weights + b * 512;
    FT_TILE_ZERO(0);
    FT_TILE_ZERO(1);
    FT_TILE_ZERO(2);
    FT_TILE_ZERO(3);
    FT_TILE_ZERO(4);
    FT_TILE_ZERO(5);
    FT_TILE_LOADD(7, wb, 64);  // the first half's 16 weights
    FT_TILE_LOADD(6, db, stride);
    FREETOKEN_TILE_H(0)
    FT_TILE_LOADD(6, db + kBlock, stride);
    FREETOKEN_TILE_ML(1)
    FT_TILE_LOADD(6, db + 2 * kBlock, stride);
    FREETOKEN_TILE_ML(2)
    FT_TILE_LOADD(7, wb + 256, 64);  // the second half's
    FT_TILE_LOADD(6, db + 16, stride);
    FREETOKEN_TILE_H(3)
    FT_TILE_LOADD(6, db + kBlock + 16, stride);
    FREETOKEN_TILE_ML(4)
    FT_TILE_LOADD(6, db + 2 * kBlock + 16, stride);
    FREETOKEN_TILE_ML(5)
    FT_TILE_STORED(0, c[0][0], 64);
    FT_TILE_STORED(1, c[0][1], 64);
    FT_TILE_STORED(2, c[0][2], 64);
    FT_TILE_STORED(3, c[1][0], 64);
    FT_TILE_STORED(4, c[1][1], 64);
    FT_TILE_STORED(5, c[1][2], 64);
    const uint8_t* gu = group + (b / ub) * int_unit_bytes(QT);
    const int64_t j = b % ub;
    const __m512 d = block_d16<QT>(gu, j), m = block_m16<QT>(gu, j);
    __m512i sc[2];
    half_scales16<QT>(gu, j, sc);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      __m512i ps[3];
      for (int k = 0; k < 3; ++k)
        ps[k] = _mm512_add_epi32(_mm512_mullo_epi32(sc[0], _mm512_load_si512(c[0][k][r])),
                                 _mm512_mullo_epi32(sc[1], _mm512_load_si512(c[1][k][r])));
      y[r] = block_update<QT>(ps[0], ps[1], ps[2], d, m, x.s[i], x.xs[i], y[r]);
      if constexpr (QT == kQ2_K) y[r] = q2_k_min_update(gu, j, &x.xsh[2 * i], y[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (r0 + r) * n + g * kIntGroup, y[r]);
}

#undef FREETOKEN_TILE_H
#undef FREETOKEN_TILE_ML

template <int64_t QT, int R = 16>
void group_amx_rows(const Digits& x, int64_t r0, int64_t rows, const uint8_t* group,
                    const uint8_t* weights, float* out, int64_t n, int64_t g) {
  if constexpr (R > 1) {
    if (rows < R) return group_amx_rows<QT, R - 1>(x, r0, rows, group, weights, out, n, g);
  }
  if constexpr (halves(QT)) {
    group_amx_halves<QT, R>(x, r0, group, weights, out, n, g);
  } else {
    group_amx<QT, R>(x, r0, group, weights, out, n, g);
  }
}

// Rows [0, rows) against the groups [g0, g1), in tiles of 16 rows (the digits have zero rows
// past M): per group, the blocks' weights where the tiles read them (amx_weights: unpacked
// once into `wbuf`, every block; Q8_0's bytes in place).
template <int64_t QT>
void rows_amx(const Digits& x, int64_t rows, const uint8_t* blocks, int64_t n, float* out,
              int64_t g0, int64_t g1, uint8_t* wbuf) {
  const int64_t nb = x.nb;
  constexpr int64_t group_share = int_unit_bytes(QT) / unit_blocks(QT);  // a block's bytes
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = blocks + g * nb * group_share;
    const uint8_t* weights = amx_weights<QT>(group, nb, wbuf);
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
      group_amx_rows<QT>(x, r0, std::min<int64_t>(16, rows - r0), group, weights, out, n, g);
  }
}
#endif

// From this many rows the AMX tiles, below them VNNI (the same floats either way).
#ifndef FREETOKEN_AMX_ROWS
#define FREETOKEN_AMX_ROWS 8
#endif
constexpr int64_t kAmxRows = FREETOKEN_AMX_ROWS;

// Rows [0, rows) of x against the n features of `blocks` (n a multiple of 16) into out,
// `ldo` floats between its rows.
template <int64_t QT>
void int_linear_impl(const Digits& x, int64_t rows, const uint8_t* blocks, int64_t n,
                     int64_t ldo, float* out, bool allow_amx) {
  const int64_t groups = n / kIntGroup;
  (void)allow_amx;
#ifdef FREETOKEN_AMX
  if (allow_amx && rows >= kAmxRows && amx_usable()) {
    freetoken::guided_for(groups, 1, 1, [&](int64_t g0, int64_t g1) {
      configure_tiles(static_cast<int>(std::min<int64_t>(16, rows)), halves(QT));
      thread_local std::vector<uint8_t> wbuf;
      wbuf.resize(x.nb * 512 + 64);
      uint8_t* aligned = reinterpret_cast<uint8_t*>(
          (reinterpret_cast<uintptr_t>(wbuf.data()) + 63) & ~uintptr_t{63});
      rows_amx<QT>(x, rows, blocks, ldo, out, g0, g1, aligned);
      FT_TILE_RELEASE();
    });
    return;
  }
#endif
#ifdef FREETOKEN_VNNI
  freetoken::guided_for(groups, 2, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      switch (std::min<int64_t>(4, rows - r0)) {
        case 1: groups_vnni<QT, 1>(x, r0, blocks, ldo, out, g0, g1); break;
        case 2: groups_vnni<QT, 2>(x, r0, blocks, ldo, out, g0, g1); break;
        case 3: groups_vnni<QT, 3>(x, r0, blocks, ldo, out, g0, g1); break;
        default: groups_vnni<QT, 4>(x, r0, blocks, ldo, out, g0, g1); break;
      }
    }
  });
#else
  freetoken::guided_for(groups, 4, 1, [&](int64_t g0, int64_t g1) {  // team-aware
    rows_scalar<QT>(x, rows, blocks, ldo, out, g0, g1);
  });
#endif
}

// The layout above from the kernel blocks (gguf_blocks.h's interleaved groups of kGroup
// features; the K-quants' super-blocks as the file has them).
template <int64_t QT>
void make_int_blocks(const uint8_t* blocks, int64_t features, int64_t row_bytes,
                     int64_t num_units, uint8_t* out) {
  const int64_t groups = features / kIntGroup;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t u = 0; u < num_units; ++u) {
        uint8_t* gu = out + (g * num_units + u) * int_unit_bytes(QT);
        std::memset(gu, 0, int_unit_bytes(QT));  // (the fifth and high bits are or-ed in)
        for (int64_t f = 0; f < kIntGroup; ++f) {
          const FeatureBlocks fb = feature_blocks(blocks, features, row_bytes,
                                                  kernel_unit_bytes(QT), g * kIntGroup + f);
          const uint8_t* unit = fb.first + u * fb.stride;
          // (Weights as the VNNI path reads them: Q6_K's q + 32; a layout word holds 8 of a
          // block's weights, little-endian.)
          static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "a little-endian CPU");
          // Weights 8c .. 8c + 7 of block j, the low (shift 0) or high (shift 4) nibbles of
          // the 8 bytes at src: one 4-byte word of the layout, weight 8c + i in byte i's low
          // nibble and 8c + 4 + i in its high one.
          auto put_nibbles8 = [&](int64_t j, int c, const uint8_t* src, int shift) {
            uint64_t x;
            std::memcpy(&x, src, 8);
            const uint64_t n = (x >> shift) & 0x0F0F0F0F0F0F0F0FULL;
            const uint32_t word =
                static_cast<uint32_t>(n) | (static_cast<uint32_t>(n >> 32) << 4);
            std::memcpy(gu + int_weights_offset(QT, j) + c * 64 + 4 * f, &word, 4);
          };
          // A 32-weight block whose weight k < 16 is the low nibble of qs[k] and k + 16 the
          // high one (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, MXFP4).
          auto put_split_nibbles = [&](int64_t j, const uint8_t* qs) {
            for (int c = 0; c < 4; ++c) put_nibbles8(j, c, qs + 8 * (c % 2), 4 * (c / 2));
          };
          auto put_fifth = [&](int64_t j, int k, uint32_t bit) {
            gu[int_weights_offset(QT, j) + 256 + 4 * f + k % 4] |=
                static_cast<uint8_t>(bit << (k / 4));
          };
          if constexpr (QT == kQ4_1) {
            // (The kernel blocks' d and m are float16 values widened: narrowed back exactly.)
            for (int i = 0; i < 2; ++i) {
              const uint16_t h = c10::Half(load_float(unit + 4 * i)).x;
              std::memcpy(gu + kMinAt * i + 2 * f, &h, 2);
            }
            put_split_nibbles(0, unit + 8);
          } else if constexpr (QT == kQ4_0 || QT == kQ5_0 || QT == kQ5_1 || QT == kIQ4_NL) {
            // Q4_0, IQ4_NL: d@0, qs[16]@2; Q5_0: d@0, qh[4]@2, qs[16]@6; Q5_1: d@0, m@2,
            // qh[4]@4, qs[16]@8 (gguf_types.h).
            if constexpr (QT == kQ5_1) {
              std::memcpy(gu + 2 * f, unit, 2);
              std::memcpy(gu + kMinAt + 2 * f, unit + 2, 2);
            } else {
              const float d = half_to_float(unit);
              std::memcpy(gu + 4 * f, &d, 4);
            }
            const int qh_at = QT == kQ5_0 ? 2 : 4;
            const uint8_t* qs = unit + (QT == kQ5_0 ? 6 : QT == kQ5_1 ? 8 : 2);
            uint32_t qh = 0;
            if constexpr (fifth_bit(QT)) std::memcpy(&qh, unit + qh_at, 4);
            put_split_nibbles(0, qs);
            if constexpr (fifth_bit(QT))
              for (int k = 0; k < kBlock; ++k) put_fifth(0, k, (qh >> k) & 1);
          } else if constexpr (QT == kMXFP4) {
            // e@0, qs[16]@1 (gguf_types.h): the byte as it is.
            gu[f] = unit[0];
            put_split_nibbles(0, unit + 1);
          } else if constexpr (QT == kQ8_0) {
            const float d = half_to_float(unit);
            std::memcpy(gu + 4 * f, &d, 4);
            uint8_t* wq = gu + int_weights_offset(QT, 0);
            for (int c = 0; c < kBlock / 4; ++c)
              std::memcpy(wq + c * 64 + 4 * f, unit + 2 + 4 * c, 4);
          } else if constexpr (k4_scales(QT)) {
            // Q4_K: d@0, dmin@2, scales[12]@4, qs[128]@16; Q5_K: qh[32]@16, qs[128]@48, bit j
            // of qh[k] the fifth of sub-block j's weight k (gguf_types.h).
            std::memcpy(gu + 2 * f, unit, 2);        // d
            std::memcpy(gu + kMinAt + 2 * f, unit + 2, 2);  // dmin
            const uint8_t* qs = unit + (QT == kQ4_K ? 16 : 48);
            for (int j = 0; j < 8; ++j) {
              int sc, mn;
              types::detail::scale_min_k4(unit + 4, j, sc, mn);
              gu[kScalesAt + 16 * j + f] = static_cast<uint8_t>(sc);
              gu[kMinsAt + 16 * j + f] = static_cast<uint8_t>(mn);
              for (int c = 0; c < 4; ++c)
                put_nibbles8(j, c, qs + 32 * (j / 2) + 8 * c, 4 * (j % 2));
              if constexpr (QT == kQ5_K)
                for (int k = 0; k < kBlock; ++k) put_fifth(j, k, (unit[16 + k] >> j) & 1);
            }
          } else if constexpr (two_bits(QT)) {
            // Q2_K: scales[16]@0 (scale | min << 4), qs[64]@16, d@80, dmin@82; Q3_K:
            // hmask[32]@0, qs[64]@32, scales[12]@96, d@108. Sub-block j's weight k:
            // (qs[32 (j / 4) + k] >> 2 (j % 4)) & 3, Q3_K's plus 4 if bit j of hmask[k]
            // (q + 4 of its q); half h of sub-block j has scale 2j + h (gguf_types.h).
            const uint8_t* qs = unit + (QT == kQ2_K ? 16 : 32);
            if constexpr (QT == kQ2_K) {
              std::memcpy(gu + 2 * f, unit + 80, 2);           // d
              std::memcpy(gu + kMinAt + 2 * f, unit + 82, 2);  // dmin
              for (int i = 0; i < 16; ++i) gu[kScalesAt + 16 * i + f] = unit[i];
            } else {
              const float d = half_to_float(unit + 108);
              std::memcpy(gu + 4 * f, &d, 4);
              for (int i = 0; i < 16; ++i)
                gu[kScalesAt + 16 * i + f] = static_cast<uint8_t>(
                    static_cast<int8_t>(types::detail::scale_q3_k(unit + 96, i) - 32));
            }
            for (int j = 0; j < 8; ++j) {
              uint8_t* w = gu + int_weights_offset(QT, j);
              for (int k = 0; k < kBlock; ++k) {
                const int low = (qs[32 * (j / 4) + k] >> (2 * (j % 4))) & 3;
                w[(k / 16) * 64 + 4 * f + k % 4] |= static_cast<uint8_t>(low << (2 * ((k / 4) % 4)));
                if constexpr (QT == kQ3_K)
                  w[128 + 4 * f + k % 4] |= static_cast<uint8_t>(((unit[k] >> j) & 1) << (k / 4));
              }
            }
          } else if constexpr (QT == kIQ4_XS) {
            // d@0, scales_h@2, scales_l[4]@4, qs[128]@8; sub-block j's scale (6 bits) - 32.
            const float d = half_to_float(unit);
            std::memcpy(gu + 4 * f, &d, 4);
            for (int j = 0; j < 8; ++j) {
              gu[kScalesAt + 16 * j + f] = static_cast<uint8_t>(
                  static_cast<int8_t>(types::detail::scale_iq4_xs(unit, j) - 32));
              put_split_nibbles(j, unit + 8 + 16 * j);
            }
          } else {
            // Q6_K: ql[128]@0, qh[64]@128, int8 scales[16]@192, d@208 (Type<Q6_K>).
            const float d = half_to_float(unit + 208);
            std::memcpy(gu + 4 * f, &d, 4);
            for (int s = 0; s < 16; ++s) gu[kScalesAt + 16 * s + f] = unit[192 + s];
            // Block j = 4 h + c: weight k's low four bits are nibble c / 2 of
            // ql[64 h + 32 (c % 2) + k], its high two bits pair c of qh[32 h + k]; those go
            // to byte k % 4 of word k / 16 (after the nibbles), pair (k / 4) % 4.
            for (int j = 0; j < 8; ++j) {
              const int h = j / 4, c = j % 4;
              for (int w = 0; w < 4; ++w)
                put_nibbles8(j, w, unit + 64 * h + 32 * (c % 2) + 8 * w, 4 * (c / 2));
              for (int half = 0; half < 2; ++half) {
                uint64_t x[2];
                std::memcpy(x, unit + 128 + 32 * h + 16 * half, 16);
                const uint64_t lo = (x[0] >> (2 * c)) & 0x0303030303030303ULL;
                const uint64_t hi = (x[1] >> (2 * c)) & 0x0303030303030303ULL;
                const uint32_t word = static_cast<uint32_t>(lo) |
                                      (static_cast<uint32_t>(lo >> 32) << 2) |
                                      (static_cast<uint32_t>(hi) << 4) |
                                      (static_cast<uint32_t>(hi >> 32) << 6);
                std::memcpy(gu + int_weights_offset(QT, j) + 256 + half * 64 + 4 * f, &word, 4);
              }
            }
          }
        }
      }
  });
}

// Feature f's unit of the group-unit `gu` back in the file's bytes (Type<QT>'s unit, as
// gguf_types.h decodes it): the inverse of make_int_blocks for one feature. Every bit of the
// file's unit is kept in the layout (its float16 scales widened to float32 for some types:
// narrowed back exactly), so this is the file's unit byte for byte.
template <int64_t QT>
void file_unit(const uint8_t* gu, int f, uint8_t* unit) {
  using T = types::Type<QT>;
  std::memset(unit, 0, T::kBytes);
  const auto nibble = [&](int64_t j, int k) -> uint8_t {
    const uint8_t byte = gu[int_weights_offset(QT, j) + (k / 8) * 64 + 4 * f + k % 4];
    return (k % 8) < 4 ? byte & 0x0F : byte >> 4;
  };
  const auto two = [&](int64_t j, int k) -> uint8_t {  // Q2_K's and Q3_K's low two bits
    return (gu[int_weights_offset(QT, j) + (k / 16) * 64 + 4 * f + k % 4] >> (2 * ((k / 4) % 4))) &
           3;
  };
  const auto high_bit = [&](int64_t j, int k) -> uint8_t {  // Q5's fifth, Q3_K's third bit
    return (gu[int_weights_offset(QT, j) + (two_bits(QT) ? 128 : 256) + 4 * f + k % 4] >>
            (k / 4)) & 1;
  };
  const auto float_d = [&](uint8_t* at) {  // d kept as float32: back to its float16 bits
    const uint16_t h = c10::Half(load_float(gu + 4 * f)).x;
    std::memcpy(at, &h, 2);
  };
  const auto nibbles32 = [&](int64_t j, uint8_t* qs) {  // weight k < 16 low, k + 16 high
    for (int k = 0; k < 16; ++k) qs[k] = nibble(j, k) | nibble(j, k + 16) << 4;
  };
  const auto int8_scale = [&](int i) {  // the layout's int8 scale i of the feature
    return static_cast<int>(static_cast<int8_t>(gu[kScalesAt + 16 * i + f]));
  };
  if constexpr (QT == kQ4_0 || QT == kIQ4_NL) {  // d@0, qs[16]@2
    float_d(unit);
    nibbles32(0, unit + 2);
  } else if constexpr (QT == kMXFP4) {  // e@0, qs[16]@1
    unit[0] = gu[f];
    nibbles32(0, unit + 1);
  } else if constexpr (QT == kQ4_1) {  // d@0, m@2, qs[16]@4
    std::memcpy(unit, gu + 2 * f, 2);
    std::memcpy(unit + 2, gu + kMinAt + 2 * f, 2);
    nibbles32(0, unit + 4);
  } else if constexpr (QT == kQ5_0 || QT == kQ5_1) {  // Q5_0: d@0, qh@2, qs@6; Q5_1: m@2 too
    uint8_t* qh = unit + (QT == kQ5_0 ? 2 : 4);
    if constexpr (QT == kQ5_0) {
      float_d(unit);
    } else {
      std::memcpy(unit, gu + 2 * f, 2);
      std::memcpy(unit + 2, gu + kMinAt + 2 * f, 2);
    }
    uint32_t bits = 0;
    for (int k = 0; k < kBlock; ++k) bits |= static_cast<uint32_t>(high_bit(0, k)) << k;
    std::memcpy(qh, &bits, 4);
    nibbles32(0, qh + 4);
  } else if constexpr (QT == kQ8_0) {  // d@0, qs[32]@2
    float_d(unit);
    for (int k = 0; k < kBlock; ++k)
      unit[2 + k] = gu[int_weights_offset(QT, 0) + (k / 4) * 64 + 4 * f + k % 4];
  } else if constexpr (two_bits(QT)) {
    // Q2_K: scales[16]@0, qs[64]@16, d@80, dmin@82; Q3_K: hmask[32]@0, qs[64]@32,
    // scales[12]@96, d@108.
    uint8_t* qs = unit + (QT == kQ2_K ? 16 : 32);
    for (int j = 0; j < 8; ++j)
      for (int k = 0; k < kBlock; ++k) {
        qs[32 * (j / 4) + k] |= static_cast<uint8_t>(two(j, k) << (2 * (j % 4)));
        if constexpr (QT == kQ3_K) unit[k] |= static_cast<uint8_t>(high_bit(j, k) << j);
      }
    if constexpr (QT == kQ2_K) {
      for (int i = 0; i < 16; ++i) unit[i] = gu[kScalesAt + 16 * i + f];
      std::memcpy(unit + 80, gu + 2 * f, 2);
      std::memcpy(unit + 82, gu + kMinAt + 2 * f, 2);
    } else {
      uint8_t* s = unit + 96;  // scale_q3_k's packing of the 16 6-bit scales
      for (int i = 0; i < 16; ++i) {
        const int sc = int8_scale(i) + 32;
        s[i % 8] |= static_cast<uint8_t>((sc & 15) << (4 * (i / 8)));
        s[8 + i % 4] |= static_cast<uint8_t>((sc >> 4) << (2 * (i / 4)));
      }
      float_d(unit + 108);
    }
  } else if constexpr (k4_scales(QT)) {
    // Q4_K: d@0, dmin@2, scales[12]@4, qs[128]@16; Q5_K: qh[32]@16, qs[128]@48.
    std::memcpy(unit, gu + 2 * f, 2);
    std::memcpy(unit + 2, gu + kMinAt + 2 * f, 2);
    uint8_t* s = unit + 4;  // scale_min_k4's packing
    for (int j = 0; j < 4; ++j) {
      const int sc = gu[kScalesAt + 16 * j + f], mn = gu[kMinsAt + 16 * j + f];
      const int sc_hi = gu[kScalesAt + 16 * (j + 4) + f], mn_hi = gu[kMinsAt + 16 * (j + 4) + f];
      s[j] = static_cast<uint8_t>(sc | (sc_hi >> 4) << 6);
      s[j + 4] = static_cast<uint8_t>(mn | (mn_hi >> 4) << 6);
      s[j + 8] = static_cast<uint8_t>((sc_hi & 15) | (mn_hi & 15) << 4);
    }
    uint8_t* qs = unit + (QT == kQ4_K ? 16 : 48);
    for (int j = 0; j < 8; ++j)
      for (int k = 0; k < kBlock; ++k) {
        qs[32 * (j / 2) + k] |= static_cast<uint8_t>(nibble(j, k) << (4 * (j % 2)));
        if constexpr (QT == kQ5_K) unit[16 + k] |= static_cast<uint8_t>(high_bit(j, k) << j);
      }
  } else if constexpr (QT == kIQ4_XS) {  // d@0, scales_h@2, scales_l[4]@4, qs[128]@8
    float_d(unit);
    uint16_t scales_h = 0;
    for (int j = 0; j < 8; ++j) {
      const int sc = int8_scale(j) + 32;
      unit[4 + j / 2] |= static_cast<uint8_t>((sc & 15) << (4 * (j % 2)));
      scales_h |= static_cast<uint16_t>((sc >> 4) << (2 * j));
      nibbles32(j, unit + 8 + 16 * j);
    }
    std::memcpy(unit + 2, &scales_h, 2);
  } else {  // Q6_K: ql[128]@0, qh[64]@128, int8 scales[16]@192, d@208
    static_assert(QT == kQ6_K);
    for (int i = 0; i < 16; ++i) unit[192 + i] = gu[kScalesAt + 16 * i + f];
    float_d(unit + 208);
    for (int j = 0; j < 8; ++j) {
      const int h = j / 4, c = j % 4;
      const uint8_t* w = gu + int_weights_offset(QT, j);
      for (int k = 0; k < kBlock; ++k) {
        const int high = (w[256 + (k / 16) * 64 + 4 * f + k % 4] >> (2 * ((k / 4) % 4))) & 3;
        unit[64 * h + 32 * (c % 2) + k] |= static_cast<uint8_t>(nibble(j, k) << (4 * (c / 2)));
        unit[128 + 32 * h + k] |= static_cast<uint8_t>(high << (2 * c));
      }
    }
  }
}

// Calls f with QT as a compile-time constant for the int24 types.
template <typename F>
void int_dispatch(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>{});
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kQ2_K: return f(std::integral_constant<int64_t, kQ2_K>{});
    case kQ3_K: return f(std::integral_constant<int64_t, kQ3_K>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>{});
    case kQ6_K: return f(std::integral_constant<int64_t, kQ6_K>{});
    case kIQ4_NL: return f(std::integral_constant<int64_t, kIQ4_NL>{});
    case kIQ4_XS: return f(std::integral_constant<int64_t, kIQ4_XS>{});
    case kMXFP4: return f(std::integral_constant<int64_t, kMXFP4>{});
    default: TORCH_CHECK(false, "the int24 kernel takes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, "
                                "Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS and MXFP4, not ggml type ",
                         qtype);
  }
}

// A weight's bytes a feature in this layout, for K inputs (K whole units).
int64_t int_row_bytes(int64_t qtype, int64_t k) {
  return k / kBlock / unit_blocks(qtype) * int_unit_bytes(qtype) / kIntGroup;
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

// The types whose linears run on AMX tiles from kAmxRows rows: all of them, or none where
// the build or the CPU has no AMX, Linux refuses the tile state or gguf_int_amx_allow(false)
// turned them off.
std::vector<int64_t> gguf_int_amx_types() {
  std::vector<int64_t> types;
#ifdef FREETOKEN_AMX
  if (amx_usable()) types.assign(std::begin(kIntTypes), std::end(kIntTypes));
#endif
  return types;
}

// Whether the AMX tiles may be used (where the build and the CPU have them); the VNNI path
// computes every row count otherwise (the same floats).
void gguf_int_amx_allow(bool allow) {
#ifdef FREETOKEN_AMX
  amx_allowed.store(allow, std::memory_order_relaxed);
#else
  (void)allow;
#endif
}

int64_t gguf_int_row_bytes(int64_t qtype, int64_t k) {
  TORCH_CHECK(int_type(qtype), "gguf_int_row_bytes: ggml type ", qtype,
              " is not a type of the int24 kernel");
  TORCH_CHECK(k > 0 && k % (kBlock * unit_blocks(qtype)) == 0, "gguf_int_row_bytes: K must be "
              "a positive multiple of ", kBlock * unit_blocks(qtype), " for ggml type ", qtype);
  return int_row_bytes(qtype, k);
}

// The layout of `blocks` (kernel blocks of type qtype) into `out`, [N, bytes a feature]
// uint8 (a group-unit's bytes are 16 features' share), or a new tensor where `out` is None.
at::Tensor int_blocks_into(const at::Tensor& blocks, int64_t qtype,
                           const std::optional<at::Tensor>& out) {
  TORCH_CHECK(int_type(qtype),
              "gguf_int_blocks: ggml type ", qtype, " is not a type of the int24 kernel");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              blocks.size(1) % kernel_unit_bytes(qtype) == 0,
              "gguf_int_blocks: blocks must be the kernel blocks, uint8 [N, K / unit weights * "
              "unit bytes]");
  const int64_t n = blocks.size(0), row_bytes = blocks.size(1);
  const int64_t num_units = row_bytes / kernel_unit_bytes(qtype);
  TORCH_CHECK(n % kIntGroup == 0, "gguf_int_blocks: the output features must be a multiple of ",
              kIntGroup, " (", n, ")");
  const int64_t out_row = num_units * int_unit_bytes(qtype) / kIntGroup;
  at::Tensor laid;
  if (out.has_value()) {
    laid = *out;
    TORCH_CHECK(laid.scalar_type() == at::kByte && laid.is_contiguous() && laid.dim() == 2 &&
                laid.size(0) == n && laid.size(1) == out_row,
                "gguf_int_blocks_into: out must be a contiguous uint8 [", n, ", ", out_row, "]");
  } else {
    laid = at::empty({n, out_row}, blocks.options());
  }
  int_dispatch(qtype, [&](auto qt) {
    make_int_blocks<decltype(qt)::value>(blocks.data_ptr<uint8_t>(), n, row_bytes, num_units,
                                         laid.data_ptr<uint8_t>());
  });
  return laid;
}

at::Tensor gguf_int_blocks(const at::Tensor& blocks, int64_t qtype) {
  return int_blocks_into(blocks, qtype, std::nullopt);
}

// gguf_int_blocks written into `out` (e.g. its place in the model's arena of blocks, so that
// a load makes no temporary of the new layout).
void gguf_int_blocks_into(const at::Tensor& blocks, int64_t qtype, at::Tensor out) {
  int_blocks_into(blocks, qtype, out);
}

// Rows `ids` of the weight whose blocks are in this layout (n features, K inputs), decoded
// as the file's units are (gguf_types.h, gguf-py's values bit for bit): a tied embedding
// reads the output head's int24 blocks instead of keeping the file's blocks a second time.
at::Tensor gguf_int_embedding(const at::Tensor& ids, const at::Tensor& blocks, int64_t qtype,
                              int64_t k) {
  TORCH_CHECK(int_type(qtype), "gguf_int_embedding: ggml type ", qtype,
              " is not a type of the int24 kernel");
  TORCH_CHECK(k > 0 && k % (kBlock * unit_blocks(qtype)) == 0, "gguf_int_embedding: K must be "
              "a positive multiple of ", kBlock * unit_blocks(qtype), " for ggml type ", qtype);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              blocks.size(0) % kIntGroup == 0 && blocks.size(1) == int_row_bytes(qtype, k),
              "gguf_int_embedding: blocks must be gguf_int_blocks [N, ",
              int_row_bytes(qtype, k), "] (N a multiple of 16)");
  const int64_t n = blocks.size(0), count = ids.size(0);
  const int64_t* ip = embedding_ids(ids, n, "gguf_int_embedding");
  at::Tensor out = at::empty({count, k}, ids.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  int_dispatch(qtype, [&](auto qt) {
    constexpr int64_t QT = decltype(qt)::value;
    using T = types::Type<QT>;
    const int64_t num_units = k / T::kWeights;
    at::parallel_for(0, count, 16, [&](int64_t t0, int64_t t1) {
      uint8_t unit[T::kBytes];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t g = ip[t] / kIntGroup;
        const int f = static_cast<int>(ip[t] % kIntGroup);
        for (int64_t u = 0; u < num_units; ++u) {
          file_unit<QT>(bp + (g * num_units + u) * int_unit_bytes(QT), f, unit);
          for (int sub = 0; sub < T::kSubs; ++sub)
            T::scalar(unit, sub, op + t * k + u * T::kWeights + sub * kBlock);
        }
      }
    });
  });
  return out;
}

// mode: 0 the CPU's paths (VNNI below kAmxRows rows, AMX tiles from there where the CPU and
// the kernel grant them), 1 the scalar reference, 2 VNNI at every row count (tests).
// qtype kParts: a linear of parts side by side in the output (linear.parts_blocks' header,
// each part's blocks in this layout), the digits made once for all of them.
void gguf_linear_int(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, at::Tensor out,
                     int64_t mode) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
              x.is_contiguous(), "gguf_linear_int: x must be a contiguous float32 [M, K] CPU tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "gguf_linear_int: K must be a multiple of 32");
  TORCH_CHECK(mode >= 0 && mode <= 2, "gguf_linear_int: mode 0, 1 or 2");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
              out.size(0) == x.size(0), "gguf_linear_int: out must be float32 [M, N]");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.dim() == 2,
              "gguf_linear_int: blocks must be a contiguous uint8 tensor");
  const int64_t k = x.size(1), ldo = out.size(1), rows = x.size(0);
  const std::vector<LinearPart> parts =
      qtype == kParts ? linear_parts(blocks, "gguf_linear_int")
                      : std::vector<LinearPart>{{qtype, blocks.size(0), blocks.size(1), 0}};
  int64_t col = 0;
  for (const LinearPart& p : parts) {
    TORCH_CHECK(int_type(p.type), "gguf_linear_int: ggml type ", p.type,
                " is not a type of the int24 kernel");
    TORCH_CHECK(k % (kBlock * unit_blocks(p.type)) == 0, "gguf_linear_int: K must be a multiple "
                "of ", kBlock * unit_blocks(p.type), " for ggml type ", p.type);
    TORCH_CHECK(p.n % kIntGroup == 0 && p.row_bytes == int_row_bytes(p.type, k),
                "gguf_linear_int: blocks must be gguf_int_blocks [N, ", int_row_bytes(p.type, k),
                "] (N a multiple of 16)");
    col += p.n;
  }
  TORCH_CHECK(col == ldo, "gguf_linear_int: the blocks' features (", col, ") are not out's ",
              ldo);
  if (rows == 0 || ldo == 0) return;
  // Reused across calls; one per thread, as a team's members each make the digits.
  thread_local Digits digits;
  make_digits(x.data_ptr<float>(), rows, k, digits, mode == 1);
  col = 0;
  for (const LinearPart& p : parts) {
    const uint8_t* bp = blocks.data_ptr<uint8_t>() + p.offset;
    float* op = out.data_ptr<float>() + col;
    int_dispatch(p.type, [&](auto qt) {
      constexpr int64_t QT = decltype(qt)::value;
      if (mode == 1) {
        rows_scalar<QT>(digits, rows, bp, ldo, op, 0, p.n / kIntGroup);
      } else {
        int_linear_impl<QT>(digits, rows, bp, p.n, ldo, op, mode == 0);
      }
    });
    col += p.n;
  }
}

}  // namespace freetoken

TORCH_LIBRARY_FRAGMENT(freetoken, m) {
  m.def("gguf_int_blocks(Tensor blocks, int qtype) -> Tensor", &freetoken::gguf_int_blocks);
  m.def("gguf_int_blocks_into(Tensor blocks, int qtype, Tensor(a!) out) -> ()",
        &freetoken::gguf_int_blocks_into);
  m.def("gguf_int_row_bytes(int qtype, int k) -> int", &freetoken::gguf_int_row_bytes);
  m.def("gguf_linear_int(Tensor x, Tensor blocks, int qtype, Tensor(a!) out, int mode=0) -> ()",
        &freetoken::gguf_linear_int);
  m.def("int_linear_available() -> bool", &freetoken::int_linear_available);
  m.def("gguf_int_embedding(Tensor ids, Tensor blocks, int qtype, int k) -> Tensor",
        &freetoken::gguf_int_embedding);
  m.def("gguf_int_amx_types() -> int[]", &freetoken::gguf_int_amx_types);
  m.def("gguf_int_amx_allow(bool allow) -> ()", &freetoken::gguf_int_amx_allow);
}
