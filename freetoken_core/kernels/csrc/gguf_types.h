// The GGUF block types a FreeToken kernel can read straight from a file, one traits struct per
// ggml type id: a unit's size (kWeights weights in kBytes bytes, as the file stores them), and
// two decoders of its 32-weight sub-blocks, a scalar one and one into vector registers, both
// giving gguf-py's gguf.quants.dequantize bit for bit (tests/test_gguf_types.py).
//
// Bit for bit means the float32 operations of gguf-py's numpy code in its order, each rounded
// (the kernels are built with -ffp-contract=off), e.g. Q4_K's (d * sc) * q - dmin * m: three
// products and a difference. The vector decoders fuse a product and a sum into one FMA only
// where the product is exact in float32, which leaves the one rounding of the sum: every
// scale here is a float16 value (11 significant bits) times small integers, so
//   Q4_1, Q5_1  d * q              11 + 5 bits  (q < 32)
//   Q2_K        (d * sc) * q       11 + 4 + 2   (sc < 16, q < 4)
//   Q4_K, Q5_K  (d * sc) * q       11 + 6 + 5   (sc < 64, q < 32)
// have at most 22 significant bits and exponents far from float32's limits (|d| <= 65504,
// the smallest float16 subnormal is a normal float32), so the products are exact. An exact
// product also carries the sign of a zero product into the sum as the rounded one does, so
// the fused result is the same float, signed zeros included. Nothing else is reordered:
// e.g. Q3_K's (d * sc) * q and d * (sc * q) are the same value but differ in the sign of a
// zero when sc < 0 and q = 0, and the decoders keep gguf-py's order everywhere.
//
// Units: 32 weights for the legacy types, IQ4_NL and MXFP4 (one block), 256 for the
// K-quants and the other i-quants (one super-block, 8 sub-blocks of 32; IQ1/IQ2/IQ3 in
// gguf_iq_types.h), and 32 for F32/F16/BF16 (32 consecutive values, 128/64/64 bytes). A
// row of ne[0] weights is ne[0] / kWeights units back to back.
//
// The vector decoders are a matmul's inner loop (one call per 32 weights of each output
// feature), where the shuffle port is what runs out first on Intel cores: widening bytes to
// lanes and permutes both go there. So the 4- and 5-bit types look their weights up in a
// table of the block's 16 or 32 possible values (one permute per 16 weights, with AVX-512;
// the table costs one FMA or product per sub-block and has gguf-py's roundings, value by
// value), scales come from float tables rather than int-to-float conversions, and bit
// positions that depend on the sub-block use shifts by counts read from memory. AVX2 (8
// lanes) converts the quants to float and scales them; the K-quants' scale bytes are
// unpacked per sub-block, in scalar code.
//
// Usage: types::dispatch(qtype, [&](auto t) { using T = types::Type<decltype(t)::value>; ...
// T::vec(unit, sub, w); }) with unit = row + u * T::kBytes, 0 <= sub < T::kSubs.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec.h"

namespace freetoken::gguf::types {

// ggml type ids (gguf-py GGMLQuantizationType, ggml.h enum ggml_type).
constexpr int64_t F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10,
                  Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23,
                  BF16 = 30, MXFP4 = 39;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(FREETOKEN_AVX2)
using vf = __m512;
constexpr int kLanes = 16;
#elif defined(FREETOKEN_AVX2)
using vf = __m256;
constexpr int kLanes = 8;
#endif
#ifdef FREETOKEN_AVX2
constexpr int kVecs = 32 / kLanes;  // vectors per 32-weight sub-block
#endif

namespace detail {

// A float16 (IEEE binary16, little-endian) at p as float32: exact, like numpy's astype.
inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// IQ4_NL's (and IQ4_XS's) 16 non-linear levels (gguf-py IQ4_NL.kvalues).
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

// MXFP4's 16 levels, the E2M1 values doubled (gguf-py MXFP4.kvalues).
constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// MXFP4's scale: the E8M0 exponent byte e as 2^(e - 128), float32 (ggml's
// GGML_E8M0_TO_FP32_HALF, gguf-py MXFP4.e8m0_to_fp32_half: the E8M0 value halved, for the
// doubled levels). e < 2 gives the subnormals 2^-128 and 2^-127; e = 255 gives 2^127, never
// a NaN.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float d;
  std::memcpy(&d, &bits, 4);
  return d;
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j < 8 from the 12 packed bytes s
// (ggml get_scale_min_k4; gguf-py Q4_K.get_scale_min).
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q3_K: the 6-bit scale i < 16 (before the -32) from its 12 packed bytes s.
inline int scale_q3_k(const uint8_t* s, int i) {
  const int lo = i < 8 ? s[i] & 15 : s[i - 8] >> 4;
  return lo | (((s[8 + i % 4] >> (2 * (i / 4))) & 3) << 4);
}

// IQ4_XS: the 6-bit scale of sub-block ib < 8 (before the -32).
inline int scale_iq4_xs(const uint8_t* unit, int ib) {
  uint16_t h;
  std::memcpy(&h, unit + 2, 2);
  return ((unit[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((h >> (2 * ib)) & 3) << 4);
}

// The integers -128..127 as float32 (exact): the vector decoders read a scale's float from
// here, one load, where an int-to-float conversion costs two uops, one of them on the
// shuffle port that the decoders' expansions and permutes already keep busy (Intel cores).
struct SmallFloats {
  float v[256];
  constexpr SmallFloats() : v() {
    for (int i = 0; i < 256; ++i) v[i] = static_cast<float>(i - 128);
  }
};
inline constexpr SmallFloats kSmallFloats{};
inline const float& small_float(int i) { return kSmallFloats.v[i + 128]; }  // -128 <= i < 128

#ifdef FREETOKEN_AVX2
// Shift counts n = 0..32 in all eight 32-bit lanes, for the shifts by a run-time count (a
// sub-block's bit position): vpsrlvd / vpsllvd with the counts read from memory are one uop,
// where a shift by a count in a register is two (one on the shuffle port) and a branch on
// the sub-block costs more still in a loop over them. 32 shifts everything out.
struct ShiftCounts {
  alignas(32) int32_t v[33][8];
  constexpr ShiftCounts() : v() {
    for (int n = 0; n < 33; ++n)
      for (int i = 0; i < 8; ++i) v[n][i] = n;
  }
};
inline constexpr ShiftCounts kShiftCounts{};
inline __m256i counts(int n) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(kShiftCounts.v[n]));
}

inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
// Bytes shifted by a run-time count 0 <= n <= 8, done on 32-bit lanes: the callers mask each
// byte afterwards, keeping only bits that stayed inside their byte (a right shift brings
// byte b's bit i + n to bit i, a left shift its bit i - n, for the bits the mask keeps).
inline __m256i srl(__m256i v, int n) { return _mm256_srlv_epi32(v, counts(n)); }
inline __m256i sll(__m256i v, int n) { return _mm256_sllv_epi32(v, counts(n)); }
// Bit `from` of each byte moved to bit `to` (0 <= both < 8; other bits as the shift leaves
// them, for the caller's mask): one rotation of the 32-bit lanes where AVX-512 VL has it (no
// branch on the sub-block), else a left or a right shift.
inline __m256i move_bit(__m256i v, int from, int to) {
#ifdef __AVX512VL__
  return _mm256_rorv_epi32(v, counts((from - to) & 31));
#else
  return to >= from ? sll(v, to - from) : srl(v, from - to);
#endif
}

// Four float16 at p (8 bytes, all inside the unit: the callers never read past a unit, which
// may end a mapped file) as float32: one conversion with its load folded in (no
// shuffle-port uop for the load, as a scalar conversion's move would take).
inline __m128 halves4(const uint8_t* p) {
#ifdef __F16C__
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  return _mm_setr_ps(half(p), half(p + 2), half(p + 4), half(p + 6));
#endif
}
inline __m256i bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }

// 16 bytes of packed nibbles as 32 bytes 0..15: the low nibbles (weights 0-15), then the high
// ones (16-31), the order of the legacy blocks, IQ4_NL, IQ4_XS and MXFP4.
inline __m256i nibbles(const uint8_t* p) {
  const __m128i q = load16(p);
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

// 32 bytes, as int8 (I8) or uint8, to 32 floats (exact).
template <bool I8>
inline void bytes_to_floats(__m256i b, vf w[kVecs]) {
  const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m128i parts[2] = {lo, hi};
  for (int v = 0; v < 2; ++v)
    w[v] = _mm512_cvtepi32_ps(I8 ? _mm512_cvtepi8_epi32(parts[v]) : _mm512_cvtepu8_epi32(parts[v]));
#else
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int v = 0; v < 4; ++v)
    w[v] = _mm256_cvtepi32_ps(I8 ? _mm256_cvtepi8_epi32(parts[v]) : _mm256_cvtepu8_epi32(parts[v]));
#endif
}

#if !(defined(__AVX512F__) && defined(__AVX512BW__))
// AVX2: 32 int8 to 32 floats through memory, one store and four widening loads, where
// bytes_to_floats splits the register with three more shuffles. Faster for IQ4's looked-up
// levels (one row of a 1B block's IQ4_XS linears 6.5 -> 5.7 ms, paired, Zen 3), slower for
// the K-quants' longer unrolled decoders (Q4_K 5.8 -> 6.6), which keep bytes_to_floats.
inline void int8_to_floats_via_memory(__m256i b, vf w[kVecs]) {
  alignas(32) int8_t tmp[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), b);
  for (int v = 0; v < 4; ++v)
    w[v] = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tmp + 8 * v))));
}

// AVX2: the 32 nibbles of the 16 bytes at p (low nibbles are weights 0-15, high 16-31) as
// 32-bit lanes, q[v] holding weights 8v..8v+7: two widening loads (the only shuffle-pipe
// uops), then masks and shifts.
inline void nibble_lanes(const uint8_t* p, __m256i q[4]) {
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b1 =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  const __m256i low4 = _mm256_set1_epi32(15);
  q[0] = _mm256_and_si256(b0, low4);
  q[1] = _mm256_and_si256(b1, low4);
  q[2] = _mm256_srli_epi32(b0, 4);
  q[3] = _mm256_srli_epi32(b1, 4);
}
// Q5_0 / Q5_1: where bit j of the 32 bits at qh is set, 16 added to weight j's lane in
// nibble_lanes' order (a mask and a comparison a vector: no shifts, which Zen 3 runs on one
// pipe only); kMinus16 (Q5_0's q - 16): 16 taken from the lanes whose bit is clear instead.
template <bool kMinus16>
inline void fifth_bits(const uint8_t* qh, __m256i q[4]) {
  alignas(32) static constexpr int32_t kBits[4][8] = {
      {1 << 0, 1 << 1, 1 << 2, 1 << 3, 1 << 4, 1 << 5, 1 << 6, 1 << 7},
      {1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14, 1 << 15},
      {1 << 16, 1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22, 1 << 23},
      {1 << 24, 1 << 25, 1 << 26, 1 << 27, 1 << 28, 1 << 29, 1 << 30,
       static_cast<int32_t>(1u << 31)}};
  const __m256i hv = _mm256_set1_epi32(static_cast<int>(load_u32(qh)));
  const __m256i add = _mm256_set1_epi32(kMinus16 ? -16 : 16);
  for (int v = 0; v < 4; ++v) {
    const __m256i bit = _mm256_load_si256(reinterpret_cast<const __m256i*>(kBits[v]));
    const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(hv, bit), bit);
    q[v] = _mm256_add_epi32(
        q[v], kMinus16 ? _mm256_andnot_si256(set, add) : _mm256_and_si256(set, add));
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Lane L of x in every lane.
template <int L>
inline vf lane(__m128 x) {
  if constexpr (L == 0) return _mm512_broadcastss_ps(x);
  else return _mm512_permutexvar_ps(_mm512_set1_epi32(L), _mm512_castps128_ps512(x));
}
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // exact a * b only
inline vf vfmsub(vf a, vf b, vf c) { return _mm512_fmsub_ps(a, b, c); }  // exact a * b only
inline vf iota(float first) {
  return _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                       _mm512_set1_ps(first));  // integers: exact
}
// The 32 weights of a sub-block looked up in a table of its 16 possible values by nibble:
// a permute reads only the low 4 bits of each index lane, so nothing needs masking; no
// integer-to-float conversion and no arithmetic is left per weight. p: the 16 bytes of
// packed nibbles, low nibbles first (the legacy order), widened once: the high nibbles are
// the same lanes shifted (no second expansion on the shuffle port).
inline void lookup16(const uint8_t* p, vf table, vf w[2]) {
  const __m512i q = _mm512_cvtepu8_epi32(load16(p));
  w[0] = _mm512_permutexvar_ps(q, table);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}
// Q5_0 / Q5_1: the 32 5-bit indices of a block, nibble | bit j of qh << 4 for weight j, from
// its 16 bytes of nibbles at qs and its 32 bits at qh, in the low 5 bits of the lanes of two
// vectors: each lane rotates qh so that its bit lands on bit 4, and a bitwise select takes
// bits 0-3 from the nibble (a two-table permute ignores the bits above 4). All in the lanes:
// one widening, where bytes would take three (two and a lane extraction).
inline void indices5(const uint8_t* qs, const uint8_t* qh, __m512i idx[2]) {
  const __m512i q = _mm512_cvtepu8_epi32(load16(qs));
  const __m512i h = _mm512_set1_epi32(static_cast<int>(load_u32(qh)));
  // lane i of w[0] wants bit i, of w[1] bit 16 + i: rotate right by i - 4, i + 12 (mod 32)
  const __m512i r0 = _mm512_setr_epi32(28, 29, 30, 31, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11);
  const __m512i r1 = _mm512_add_epi32(r0, _mm512_set1_epi32(16));
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  idx[0] = _mm512_ternarylogic_epi32(low4, q, _mm512_rorv_epi32(h, r0), 0xCA);  // a ? b : c
  idx[1] = _mm512_ternarylogic_epi32(low4, _mm512_srli_epi32(q, 4), _mm512_rorv_epi32(h, r1),
                                     0xCA);
}
// Q5_K: the 32 weights looked up by 32 bytes of indices 0..31 (bits above 4 zero) in the
// tables lo (values 0-15) and hi (16-31), one two-table permute per 16 weights.
inline void lookup32(__m256i idx, vf lo, vf hi, vf w[2]) {
  w[0] = _mm512_permutex2var_ps(lo, _mm512_cvtepu8_epi32(_mm256_castsi256_si128(idx)), hi);
  w[1] = _mm512_permutex2var_ps(lo, _mm512_cvtepu8_epi32(_mm256_extracti128_si256(idx, 1)), hi);
}
#else
template <int L>
inline vf lane(__m128 x) {
  if constexpr (L == 0) return _mm256_broadcastss_ps(x);
  else return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(x), _mm256_set1_epi32(L));
}
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }  // exact a * b only
inline vf vfmsub(vf a, vf b, vf c) { return _mm256_fmsub_ps(a, b, c); }  // exact a * b only
#endif
#endif  // FREETOKEN_AVX2

}  // namespace detail

// Type<QT>: kWeights weights in kBytes bytes a unit, kSubs = kWeights / 32 sub-blocks;
// scalar(unit, sub, w) writes the 32 floats of sub-block sub to w[0..31], vec(unit, sub, w)
// the same floats into kVecs vectors (where FREETOKEN_AVX2). kSimd: whether vec() has vector
// code of its own (all types at present) rather than scalar() through memory.
template <int64_t QT>
struct Type;

template <>
struct Type<F32> {
  static constexpr int64_t kWeights = 32, kBytes = 128;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static void scalar(const uint8_t* unit, int, float* w) { std::memcpy(w, unit, 128); }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int, vf w[kVecs]) {
    const float* p = reinterpret_cast<const float*>(unit);
    for (int v = 0; v < kVecs; ++v)
#if defined(__AVX512F__) && defined(__AVX512BW__)
      w[v] = _mm512_loadu_ps(p + 16 * v);
#else
      w[v] = _mm256_loadu_ps(p + 8 * v);
#endif
  }
#endif
};

template <>
struct Type<F16> {
  static constexpr int64_t kWeights = 32, kBytes = 64;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static void scalar(const uint8_t* unit, int, float* w) {
    for (int j = 0; j < 32; ++j) w[j] = detail::half(unit + 2 * j);
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int sub, vf w[kVecs]) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (int v = 0; v < 2; ++v) w[v] = _mm512_cvtph_ps(detail::load32(unit + 32 * v));
#elif defined(__F16C__)
    for (int v = 0; v < 4; ++v) w[v] = _mm256_cvtph_ps(detail::load16(unit + 16 * v));
#else
    alignas(32) float tmp[32];
    scalar(unit, sub, tmp);
    for (int v = 0; v < 4; ++v) w[v] = _mm256_load_ps(tmp + 8 * v);
#endif
    (void)sub;
  }
#endif
};

template <>
struct Type<BF16> {
  static constexpr int64_t kWeights = 32, kBytes = 64;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static void scalar(const uint8_t* unit, int, float* w) {
    for (int j = 0; j < 32; ++j) {
      uint16_t h;
      std::memcpy(&h, unit + 2 * j, 2);
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      std::memcpy(w + j, &bits, 4);
    }
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int, vf w[kVecs]) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (int v = 0; v < 2; ++v)
      w[v] = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(detail::load32(unit + 32 * v)), 16));
#else
    for (int v = 0; v < 4; ++v)
      w[v] = _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(detail::load16(unit + 16 * v)), 16));
#endif
  }
#endif
};

// Q4_0: d@0, qs[16]@2; w = d * (q - 8).
template <>
struct Type<Q4_0> {
  static constexpr int64_t kWeights = 32, kBytes = 18;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static void scalar(const uint8_t* unit, int, float* w) {
    const float d = detail::half(unit);
    const uint8_t* qs = unit + 2;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>((qs[j] & 15) - 8);
      w[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
    }
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int, vf w[kVecs]) {
    using namespace detail;
    const vf d = lane<0>(halves4(unit));
#if defined(__AVX512F__) && defined(__AVX512BW__)
    lookup16(unit + 2, vmul(d, iota(-8)), w);  // the products d * (i - 8)
#else
    __m256i q[4];
    nibble_lanes(unit + 2, q);
    for (int v = 0; v < 4; ++v)
      w[v] = vmul(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[v], _mm256_set1_epi32(8))));
#endif
  }
#endif
};

// Q4_1: d@0, m@2, qs[16]@4; w = d * q + m (d * q exact: one FMA).
template <>
struct Type<Q4_1> {
  static constexpr int64_t kWeights = 32, kBytes = 20;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static void scalar(const uint8_t* unit, int, float* w) {
    const float d = detail::half(unit), m = detail::half(unit + 2);
    const uint8_t* qs = unit + 4;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(qs[j] & 15) + m;
      w[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int, vf w[kVecs]) {
    using namespace detail;
    const __m128 dm = halves4(unit);
    const vf d = lane<0>(dm), m = lane<1>(dm);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    lookup16(unit + 4, vfmadd(d, iota(0), m), w);
#else
    __m256i q[4];
    nibble_lanes(unit + 4, q);
    for (int v = 0; v < 4; ++v) w[v] = vfmadd(d, _mm256_cvtepi32_ps(q[v]), m);
#endif
  }
#endif
};

// Q5_0: d@0, qh[4]@2, qs[16]@6; q = nibble | bit j of qh << 4; w = d * (q - 16).
template <>
struct Type<Q5_0> {
  static constexpr int64_t kWeights = 32, kBytes = 22;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static void scalar(const uint8_t* unit, int, float* w) {
    const float d = detail::half(unit);
    const uint32_t qh = detail::load_u32(unit + 2);
    const uint8_t* qs = unit + 6;
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 15) | (((qh >> j) & 1) << 4);
      const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      w[j] = d * static_cast<float>(lo - 16);
      w[j + 16] = d * static_cast<float>(hi - 16);
    }
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int, vf w[kVecs]) {
    using namespace detail;
    const vf d = lane<0>(halves4(unit));
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // The 32 values d * (i - 16), looked up by the 5-bit q.
    __m512i idx[2];
    indices5(unit + 6, unit + 2, idx);
    const vf lo = vmul(d, iota(-16)), hi = vmul(d, iota(0));
    for (int v = 0; v < 2; ++v) w[v] = _mm512_permutex2var_ps(lo, idx[v], hi);
#else
    __m256i q[4];
    nibble_lanes(unit + 6, q);
    fifth_bits<true>(unit + 2, q);
    for (int v = 0; v < 4; ++v) w[v] = vmul(d, _mm256_cvtepi32_ps(q[v]));
#endif
  }
#endif
};

// Q5_1: d@0, m@2, qh[4]@4, qs[16]@8; w = d * q + m (d * q exact: one FMA).
template <>
struct Type<Q5_1> {
  static constexpr int64_t kWeights = 32, kBytes = 24;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static void scalar(const uint8_t* unit, int, float* w) {
    const float d = detail::half(unit), m = detail::half(unit + 2);
    const uint32_t qh = detail::load_u32(unit + 4);
    const uint8_t* qs = unit + 8;
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 15) | (((qh >> j) & 1) << 4);
      const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      w[j] = d * static_cast<float>(lo) + m;
      w[j + 16] = d * static_cast<float>(hi) + m;
    }
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int, vf w[kVecs]) {
    using namespace detail;
    const __m128 dm = halves4(unit);
    const vf d = lane<0>(dm), m = lane<1>(dm);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512i idx[2];
    indices5(unit + 8, unit + 4, idx);
    const vf lo = vfmadd(d, iota(0), m), hi = vfmadd(d, iota(16), m);
    for (int v = 0; v < 2; ++v) w[v] = _mm512_permutex2var_ps(lo, idx[v], hi);
#else
    __m256i q[4];
    nibble_lanes(unit + 8, q);
    fifth_bits<false>(unit + 4, q);
    for (int v = 0; v < 4; ++v) w[v] = vfmadd(d, _mm256_cvtepi32_ps(q[v]), m);
#endif
  }
#endif
};

// Q8_0: d@0, int8 qs[32]@2; w = q * d.
template <>
struct Type<Q8_0> {
  static constexpr int64_t kWeights = 32, kBytes = 34;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static void scalar(const uint8_t* unit, int, float* w) {
    const float d = detail::half(unit);
    const int8_t* qs = reinterpret_cast<const int8_t*>(unit + 2);
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(qs[j]) * d;
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int, vf w[kVecs]) {
    using namespace detail;
    const vf d = lane<0>(halves4(unit));
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (int v = 0; v < 2; ++v)
      w[v] = vmul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(unit + 2 + 16 * v))), d);
#else
    for (int v = 0; v < 4; ++v)
      w[v] = vmul(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit + 2 + 8 * v)))),
                  d);
#endif
  }
#endif
};

// Q2_K: scales[16]@0, qs[64]@16, d@80, dmin@82; 16 groups of 16 weights. Sub-block
// sub = 4h + k holds (qs[32h + l] >> 2k) & 3 for l < 32, in groups 2 sub and 2 sub + 1;
// w = (d * sc) * q - dmin * mn ((d * sc) * q exact: one FMA).
template <>
struct Type<Q2_K> {
  static constexpr int64_t kWeights = 256, kBytes = 84;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static void scalar(const uint8_t* unit, int sub, float* w) {
    const float d = detail::half(unit + 80), dmin = detail::half(unit + 82);
    const uint8_t* qs = unit + 16 + 32 * (sub / 4);
    const int shift = 2 * (sub % 4);
    for (int g = 0; g < 2; ++g) {
      const uint8_t s = unit[2 * sub + g];
      const float dl = d * static_cast<float>(s & 15), ml = dmin * static_cast<float>(s >> 4);
      for (int l = 16 * g; l < 16 * g + 16; ++l)
        w[l] = dl * static_cast<float>((qs[l] >> shift) & 3) - ml;
    }
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int sub, vf w[kVecs]) {
    using namespace detail;
    const __m128 h = halves4(unit + 76);  // the unit's last 8 bytes: d, dmin in lanes 2, 3
    const vf d = lane<2>(h), dmin = lane<3>(h);
    bytes_to_floats<false>(
        _mm256_and_si256(srl(load32(unit + 16 + 32 * (sub / 4)), 2 * (sub % 4)), bytes(3)), w);
    for (int g = 0; g < 2; ++g) {
      const uint8_t s = unit[2 * sub + g];
      const vf dl = vmul(d, set1(small_float(s & 15))), ml = vmul(dmin, set1(small_float(s >> 4)));
      for (int v = g * kVecs / 2; v < (g + 1) * kVecs / 2; ++v) w[v] = vfmsub(dl, w[v], ml);
    }
  }
#endif
};

// Q3_K: hmask[32]@0, qs[64]@32, scales[12]@96, d@108; 16 groups of 16 weights. Sub-block
// sub = 4h + k: q = ((qs[32h + l] >> 2k) & 3) - (bit sub of hmask[l] ? 0 : 4), l < 32;
// w = (d * (s - 32)) * q.
template <>
struct Type<Q3_K> {
  static constexpr int64_t kWeights = 256, kBytes = 110;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static void scalar(const uint8_t* unit, int sub, float* w) {
    const float d = detail::half(unit + 108);
    const uint8_t* qs = unit + 32 + 32 * (sub / 4);
    const int shift = 2 * (sub % 4);
    for (int g = 0; g < 2; ++g) {
      const float dl =
          d * static_cast<float>(detail::scale_q3_k(unit + 96, 2 * sub + g) - 32);
      for (int l = 16 * g; l < 16 * g + 16; ++l) {
        const int q = ((qs[l] >> shift) & 3) - (((unit[l] >> sub) & 1) ? 0 : 4);
        w[l] = dl * static_cast<float>(q);
      }
    }
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int sub, vf w[kVecs]) {
    using namespace detail;
    const vf d = lane<3>(halves4(unit + 102));  // the unit's last 8 bytes: d in lane 3
    const __m256i q2 =
        _mm256_and_si256(srl(load32(unit + 32 + 32 * (sub / 4)), 2 * (sub % 4)), bytes(3));
    // bit sub of hmask[l] at bit 2: q2 | that - 4 = q2 - (bit set ? 0 : 4)
    const __m256i h4 = _mm256_and_si256(move_bit(load32(unit), sub, 2), bytes(4));
    bytes_to_floats<true>(_mm256_sub_epi8(_mm256_or_si256(q2, h4), bytes(4)), w);
    for (int g = 0; g < 2; ++g) {
      const vf dl = vmul(d, set1(small_float(scale_q3_k(unit + 96, 2 * sub + g) - 32)));
      for (int v = g * kVecs / 2; v < (g + 1) * kVecs / 2; ++v) w[v] = vmul(dl, w[v]);
    }
  }
#endif
};

// Q4_K: d@0, dmin@2, scales[12]@4, qs[128]@16. Sub-block j: nibble (j odd: high) of
// qs[32 (j / 2) + l]; w = (d * sc) * q - dmin * m ((d * sc) * q exact: one FMA).
template <>
struct Type<Q4_K> {
  static constexpr int64_t kWeights = 256, kBytes = 144;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static void scalar(const uint8_t* unit, int sub, float* w) {
    int sc, m;
    detail::scale_min_k4(unit + 4, sub, sc, m);
    const float ds = detail::half(unit) * static_cast<float>(sc);
    const float dm = detail::half(unit + 2) * static_cast<float>(m);
    const uint8_t* qs = unit + 16 + 32 * (sub >> 1);
    const int shift = 4 * (sub % 2);
    for (int l = 0; l < 32; ++l) w[l] = ds * static_cast<float>((qs[l] >> shift) & 15) - dm;
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int sub, vf w[kVecs]) {
    using namespace detail;
    int sc, m;
    scale_min_k4(unit + 4, sub, sc, m);
    const __m128 h = halves4(unit);
    const vf ds = vmul(lane<0>(h), set1(small_float(sc)));
    const vf dm = vmul(lane<1>(h), set1(small_float(m)));
    const uint8_t* qs = unit + 16 + 32 * (sub >> 1);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // The 16 values ds * i - dm, looked up by nibble (a permute reads the low 4 bits).
    const vf table = vfmsub(ds, iota(0), dm);
    const __m512i shift = _mm512_broadcast_i32x8(counts(4 * (sub & 1)));  // odd: high nibbles
    for (int v = 0; v < 2; ++v)
      w[v] = _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(load16(qs + 16 * v)),
                                                     shift),
                                   table);
#else
    nibbles_scaled(qs, sub, ds, dm, w);
#endif
  }

  // The linear kernels' decoder (gguf_linear.cpp's Unit::head): a super-block's eight
  // d * sc and dmin * m, the products vec forms for each sub-block, formed once for its
  // eight sub-blocks (one scalar unpacking of the 12 packed bytes, ggml's, and one product
  // of eight lanes each), then each sub-block from them: the same floats as vec, and per
  // sub-block only the table (or the conversions) and the weights are left. One row of a 1B
  // block's Q4_K linears 1.13 -> 0.94 ms (bench/gguf_types.py, Zen 5, AVX-512, paired);
  // Q6_K's sixteen d * sc formed the same way measured no gain, so it keeps vec alone.
  struct Head {
    alignas(32) float ds[8];
    alignas(32) float dm[8];
  };
  static void head(const uint8_t* unit, Head& h) {
    uint32_t u[3];
    std::memcpy(u, unit + 4, 12);
    const uint32_t sc_lo = u[0] & 0x3f3f3f3fu, m_lo = u[1] & 0x3f3f3f3fu;
    const uint32_t sc_hi = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    const uint32_t m_hi = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const __m128i packed = _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi),
                                          static_cast<int>(m_lo), static_cast<int>(m_hi));
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8)));
    const __m128 dd = detail::halves4(unit);  // d, dmin
    _mm256_store_ps(h.ds, _mm256_mul_ps(_mm256_broadcastss_ps(dd), sc));
    _mm256_store_ps(h.dm, _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), m));
  }
  static void vec(const uint8_t* unit, int sub, const Head& h, vf w[kVecs]) {
    using namespace detail;
    const vf ds = set1(h.ds[sub]), dm = set1(h.dm[sub]);
    const uint8_t* qs = unit + 16 + 32 * (sub >> 1);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const vf table = vfmsub(ds, iota(0), dm);
    for (int v = 0; v < 2; ++v) {
      __m512i q = _mm512_cvtepu8_epi32(load16(qs + 16 * v));
      if (sub & 1) q = _mm512_srli_epi32(q, 4);  // a permute reads the low 4 bits only
      w[v] = _mm512_permutexvar_ps(q, table);
    }
#else
    nibbles_scaled(qs, sub, ds, dm, w);
#endif
  }

 private:
#if !(defined(__AVX512F__) && defined(__AVX512BW__))
  // Weights 8v..8v+7 from bytes qs[8v..8v+7] widened straight into lanes (four shuffle-pipe
  // uops where splitting 32 bytes takes seven), then their nibble: the sub-blocks are
  // unrolled in the kernels' loops, so sub & 1 is a constant there.
  static void nibbles_scaled(const uint8_t* qs, int sub, vf ds, vf dm, vf w[kVecs]) {
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int v = 0; v < 4; ++v) {
      __m256i b =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * v)));
      b = (sub & 1) ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, low4);
      w[v] = detail::vfmsub(ds, _mm256_cvtepi32_ps(b), dm);
    }
  }
#endif
#endif
};

// Q5_K: d@0, dmin@2, scales[12]@4, qh[32]@16, qs[128]@48. Sub-block j: Q4_K's nibble plus
// bit j of qh[l] << 4; w = (d * sc) * q - dmin * m ((d * sc) * q exact: one FMA).
template <>
struct Type<Q5_K> {
  static constexpr int64_t kWeights = 256, kBytes = 176;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static void scalar(const uint8_t* unit, int sub, float* w) {
    int sc, m;
    detail::scale_min_k4(unit + 4, sub, sc, m);
    const float ds = detail::half(unit) * static_cast<float>(sc);
    const float dm = detail::half(unit + 2) * static_cast<float>(m);
    const uint8_t* qh = unit + 16;
    const uint8_t* qs = unit + 48 + 32 * (sub / 2);
    const int shift = 4 * (sub % 2);
    for (int l = 0; l < 32; ++l) {
      const int q = ((qs[l] >> shift) & 15) | (((qh[l] >> sub) & 1) << 4);
      w[l] = ds * static_cast<float>(q) - dm;
    }
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int sub, vf w[kVecs]) {
    using namespace detail;
    int sc, m;
    scale_min_k4(unit + 4, sub, sc, m);
    const __m128 dd = halves4(unit);
    const vf ds = vmul(lane<0>(dd), set1(small_float(sc)));
    const vf dm = vmul(lane<1>(dd), set1(small_float(m)));
    const __m256i nib = srl(load32(unit + 48 + 32 * (sub >> 1)), 4 * (sub & 1));
    const __m256i h = move_bit(load32(unit + 16), sub, 4);  // bit sub of qh[l] at bit 4
    const __m256i q =
        _mm256_or_si256(_mm256_and_si256(nib, bytes(15)), _mm256_and_si256(h, bytes(16)));
#if defined(__AVX512F__) && defined(__AVX512BW__)
    lookup32(q, vfmsub(ds, iota(0), dm), vfmsub(ds, iota(16), dm), w);
#else
    bytes_to_floats<false>(q, w);
    for (int v = 0; v < 4; ++v) w[v] = vfmsub(ds, w[v], dm);
#endif
  }
#endif
};

// Q6_K: ql[128]@0, qh[64]@128, int8 scales[16]@192, d@208; 16 groups of 16 weights.
// Sub-block sub = 4h + k, l < 32: the nibble (k >= 2: high) of ql[64h + 32 (k % 2) + l] |
// ((qh[32h + l] >> 2k) & 3) << 4, minus 32; w = (d * scale) * q, scale of group 2 sub + l / 16.
template <>
struct Type<Q6_K> {
  static constexpr int64_t kWeights = 256, kBytes = 210;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static void scalar(const uint8_t* unit, int sub, float* w) {
    const float d = detail::half(unit + 208);
    const int h = sub / 4, k = sub % 4;
    const uint8_t* ql = unit + 64 * h + 32 * (k % 2);
    const uint8_t* qh = unit + 128 + 32 * h;
    const int8_t* scales = reinterpret_cast<const int8_t*>(unit + 192);
    for (int g = 0; g < 2; ++g) {
      const float ds = d * static_cast<float>(scales[2 * sub + g]);
      for (int l = 16 * g; l < 16 * g + 16; ++l) {
        const int q = ((ql[l] >> (4 * (k / 2))) & 15) | (((qh[l] >> (2 * k)) & 3) << 4);
        w[l] = ds * static_cast<float>(q - 32);
      }
    }
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int sub, vf w[kVecs]) {
    using namespace detail;
    const vf d = lane<3>(halves4(unit + 202));  // the unit's last 8 bytes: d in lane 3
    const int h = sub / 4, k = sub % 4;
    const __m256i lo = srl(load32(unit + 64 * h + 32 * (k & 1)), 4 * (k >> 1));
    // Bits 2k, 2k + 1 of each qh byte moved to bits 4, 5 (masked: what crossed a byte goes).
    const __m256i hi = move_bit(load32(unit + 128 + 32 * h), 2 * k, 4);
    const __m256i q = _mm256_or_si256(_mm256_and_si256(lo, bytes(15)),
                                      _mm256_and_si256(hi, bytes(0x30)));
    bytes_to_floats<true>(_mm256_sub_epi8(q, bytes(32)), w);
    const int8_t* scales = reinterpret_cast<const int8_t*>(unit + 192);
    for (int g = 0; g < 2; ++g) {
      const vf ds = vmul(d, set1(small_float(scales[2 * sub + g])));
      for (int v = g * kVecs / 2; v < (g + 1) * kVecs / 2; ++v) w[v] = vmul(ds, w[v]);
    }
  }
#endif
};

// IQ4_NL: d@0, qs[16]@2 (Q4_0's nibble order); w = d * kvalues[nibble].
template <>
struct Type<IQ4_NL> {
  static constexpr int64_t kWeights = 32, kBytes = 18;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static void scalar(const uint8_t* unit, int, float* w) {
    const float d = detail::half(unit);
    const uint8_t* qs = unit + 2;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(detail::kIQ4Values[qs[j] & 15]);
      w[j + 16] = d * static_cast<float>(detail::kIQ4Values[qs[j] >> 4]);
    }
  }
#ifdef FREETOKEN_AVX2
  // The 16 levels as floats (AVX-512 table) or int8 (AVX2 byte shuffle), and the decoder
  // IQ4_XS shares: w = dl * level[nibble] from the 16 packed bytes at qs.
  static void levels(const uint8_t* qs, vf d, vf w[kVecs]) {
    using namespace detail;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const vf values = _mm512_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38,
                                     53, 69, 89, 113);
    lookup16(qs, vmul(d, values), w);
#else
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
    int8_to_floats_via_memory(_mm256_shuffle_epi8(table, nibbles(qs)), w);
    for (int v = 0; v < 4; ++v) w[v] = vmul(d, w[v]);
#endif
  }
  static void vec(const uint8_t* unit, int, vf w[kVecs]) {
    levels(unit + 2, detail::lane<0>(detail::halves4(unit)), w);
  }
#endif
};

// IQ4_XS: d@0, u16 scales_h@2, scales_l[4]@4, qs[128]@8. Sub-block ib: IQ4_NL's block at
// qs[16 ib] with dl = d * (ls - 32) for its 6-bit scale ls.
template <>
struct Type<IQ4_XS> {
  static constexpr int64_t kWeights = 256, kBytes = 136;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static float dl(const uint8_t* unit, int sub) {
    return detail::half(unit) * static_cast<float>(detail::scale_iq4_xs(unit, sub) - 32);
  }
  static void scalar(const uint8_t* unit, int sub, float* w) {
    const float d = dl(unit, sub);
    const uint8_t* qs = unit + 8 + 16 * sub;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(detail::kIQ4Values[qs[j] & 15]);
      w[j + 16] = d * static_cast<float>(detail::kIQ4Values[qs[j] >> 4]);
    }
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int sub, vf w[kVecs]) {
    using namespace detail;
    const vf d = vmul(lane<0>(halves4(unit)), set1(small_float(scale_iq4_xs(unit, sub) - 32)));
    Type<IQ4_NL>::levels(unit + 8 + 16 * sub, d, w);
  }
#endif
};

// MXFP4: e@0 (an E8M0 exponent), qs[16]@1 (Q4_0's nibble order); w = d * kvalues[nibble],
// d = 2^(e - 128) (e8m0_half): IQ4_NL's decoders with a power-of-two scale and other
// levels. Each weight is one float32 product, d * level, as gguf-py forms it (exact: a
// subnormal at the smallest scales, inf past float32's range at the largest).
template <>
struct Type<MXFP4> {
  static constexpr int64_t kWeights = 32, kBytes = 17;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
  static void scalar(const uint8_t* unit, int, float* w) {
    const float d = detail::e8m0_half(unit[0]);
    const uint8_t* qs = unit + 1;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(detail::kMXFP4Values[qs[j] & 15]);
      w[j + 16] = d * static_cast<float>(detail::kMXFP4Values[qs[j] >> 4]);
    }
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int, vf w[kVecs]) {
    using namespace detail;
    const vf d = set1(e8m0_half(unit[0]));
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const vf values = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    lookup16(unit + 1, vmul(d, values), w);
#else
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMXFP4Values)));
    int8_to_floats_via_memory(_mm256_shuffle_epi8(table, nibbles(unit + 1)), w);
    for (int v = 0; v < 4; ++v) w[v] = vmul(d, w[v]);
#endif
  }
#endif
};

}  // namespace freetoken::gguf::types

// IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (with the grids they look up).
#include "gguf_iq_types.h"

namespace freetoken::gguf::types {

// A name for a ggml type id, for messages (the ids gguf-py knows; "?" otherwise).
inline const char* type_name(int64_t qtype) {
  switch (qtype) {
    case 0: return "F32";
    case 1: return "F16";
    case 2: return "Q4_0";
    case 3: return "Q4_1";
    case 6: return "Q5_0";
    case 7: return "Q5_1";
    case 8: return "Q8_0";
    case 9: return "Q8_1";
    case 10: return "Q2_K";
    case 11: return "Q3_K";
    case 12: return "Q4_K";
    case 13: return "Q5_K";
    case 14: return "Q6_K";
    case 15: return "Q8_K";
    case 16: return "IQ2_XXS";
    case 17: return "IQ2_XS";
    case 18: return "IQ3_XXS";
    case 19: return "IQ1_S";
    case 20: return "IQ4_NL";
    case 21: return "IQ3_S";
    case 22: return "IQ2_S";
    case 23: return "IQ4_XS";
    case 24: return "I8";
    case 25: return "I16";
    case 26: return "I32";
    case 27: return "I64";
    case 28: return "F64";
    case 29: return "IQ1_M";
    case 30: return "BF16";
    case 34: return "TQ1_0";
    case 35: return "TQ2_0";
    case 39: return "MXFP4";
    default: return "?";
  }
}

// f(std::integral_constant<int64_t, QT>{}) for the type id qtype; an unsupported id fails
// with a TORCH_CHECK naming it.
template <class F>
void dispatch(int64_t qtype, F&& f) {
#define FREETOKEN_GGUF_TYPE_CASE(QT)        \
  case QT:                                  \
    f(std::integral_constant<int64_t, QT>{}); \
    return;
  switch (qtype) {
    FREETOKEN_GGUF_TYPE_CASE(F32)
    FREETOKEN_GGUF_TYPE_CASE(F16)
    FREETOKEN_GGUF_TYPE_CASE(BF16)
    FREETOKEN_GGUF_TYPE_CASE(Q4_0)
    FREETOKEN_GGUF_TYPE_CASE(Q4_1)
    FREETOKEN_GGUF_TYPE_CASE(Q5_0)
    FREETOKEN_GGUF_TYPE_CASE(Q5_1)
    FREETOKEN_GGUF_TYPE_CASE(Q8_0)
    FREETOKEN_GGUF_TYPE_CASE(Q2_K)
    FREETOKEN_GGUF_TYPE_CASE(Q3_K)
    FREETOKEN_GGUF_TYPE_CASE(Q4_K)
    FREETOKEN_GGUF_TYPE_CASE(Q5_K)
    FREETOKEN_GGUF_TYPE_CASE(Q6_K)
    FREETOKEN_GGUF_TYPE_CASE(IQ4_NL)
    FREETOKEN_GGUF_TYPE_CASE(IQ4_XS)
    FREETOKEN_GGUF_TYPE_CASE(MXFP4)
    FREETOKEN_GGUF_TYPE_CASE(IQ2_XXS)
    FREETOKEN_GGUF_TYPE_CASE(IQ2_XS)
    FREETOKEN_GGUF_TYPE_CASE(IQ2_S)
    FREETOKEN_GGUF_TYPE_CASE(IQ3_XXS)
    FREETOKEN_GGUF_TYPE_CASE(IQ3_S)
    FREETOKEN_GGUF_TYPE_CASE(IQ1_S)
    FREETOKEN_GGUF_TYPE_CASE(IQ1_M)
    default:
      break;
  }
#undef FREETOKEN_GGUF_TYPE_CASE
  TORCH_CHECK(false, "GGUF type ", qtype, " (", type_name(qtype),
              ") has no decoder; supported: F32 0, F16 1, BF16 30, Q4_0 2, Q4_1 3, Q5_0 6, "
              "Q5_1 7, Q8_0 8, Q2_K 10, Q3_K 11, Q4_K 12, Q5_K 13, Q6_K 14, IQ4_NL 20, "
              "IQ4_XS 23, MXFP4 39, IQ2_XXS 16, IQ2_XS 17, IQ2_S 22, IQ3_XXS 18, IQ3_S 21, "
              "IQ1_S 19, IQ1_M 29");
}

// Weights and bytes per unit of a type id, at run time (TORCH_CHECK for an unsupported id).
inline int64_t unit_weights(int64_t qtype) {
  int64_t n = 0;
  dispatch(qtype, [&](auto t) { n = Type<decltype(t)::value>::kWeights; });
  return n;
}
inline int64_t unit_bytes(int64_t qtype) {
  int64_t n = 0;
  dispatch(qtype, [&](auto t) { n = Type<decltype(t)::value>::kBytes; });
  return n;
}

}  // namespace freetoken::gguf::types
