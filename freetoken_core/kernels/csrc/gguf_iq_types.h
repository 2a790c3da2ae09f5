// The i-quants of llama.cpp's low-bit mixes (IQ3_M / IQ3_XS / IQ3_XXS / IQ2_M / IQ2_S /
// IQ2_XS / IQ2_XXS / IQ1_M / IQ1_S files): Type<QT> for IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
// IQ3_S, IQ1_S and IQ1_M, as gguf_types.h's other types (a scalar and a vector decoder of a
// super-block's 32-weight sub-blocks, gguf-py's gguf.quants.dequantize bit for bit). Part of
// gguf_types.h, which includes it after its own types (it uses their helpers and template).
//
// Each weight is a grid point's level (a byte of a grid entry, gguf_iq_grids.h) times a
// scale, then signed, in gguf-py's float32 operations and order:
//   IQ2_XXS, IQ2_XS, IQ2_S   db = (d * (0.5 + ls)) * 0.25,  w = +-(db * level)
//   IQ3_XXS                  db = (d * (0.5 + ls)) * 0.5,   w = +-(db * level)
//   IQ3_S                    db = d * (1 + 2 ls),           w = +-(db * level)
//   IQ1_S, IQ1_M             dl = d * (2 ls + 1),           w = dl * (level + delta)
// (+- a sign bit per weight: gguf-py multiplies by -1, which is the negation, signed zeros
// included; level + delta, delta = +-0.125, is exact). A decoder first gathers what a
// sub-block needs (parts(): its scales, the grid entries of its groups of 8 or 4 weights,
// its 32 sign bits or IQ1's deltas), then both decoders compute the same floats from it; the
// vector one converts each group's level bytes to float lanes and flips the sign bits of the
// negated lanes.
#pragma once

#include "gguf_iq_grids.h"

namespace freetoken::gguf::types {

constexpr int64_t IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ3_S = 21, IQ2_S = 22,
                  IQ1_M = 29;

namespace detail {

inline float half_bits(uint16_t bits) {
  uint8_t p[2];
  std::memcpy(p, &bits, 2);
  return half(p);
}
inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
// An IQ1 delta: 0.125 with sign bit 31 of `sign` (the other bits zero), its bits formed
// without a comparison, which GCC turns into a branch (a branch a group of 8 weights, on
// random bits, made IQ1_M's direct path ~3x IQ1_S's).
inline float delta_of(uint32_t sign) {
  const uint32_t bits = 0x3E000000u | sign;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// A sub-block of a signed-grid type: db[h] scales weights 16h..16h+15; W-byte grid entries
// g[0..32/W) hold its levels in order; bit i of signs negates weight i.
template <int W>
struct SignedParts {
  float db[2];
  const uint8_t* g[32 / W];
  uint32_t signs;
};

template <int W>
inline void signed_scalar(const SignedParts<W>& p, float* w) {
  for (int i = 0; i < 32; ++i) {
    const float v = p.db[i / 16] * static_cast<float>(p.g[i / W][i % W]);
    w[i] = (p.signs >> i) & 1 ? -v : v;
  }
}

// An IQ1 sub-block: dl[h] scales weights 16h..16h+15; grid entry g[l] (int8 levels) and
// delta[l] are weights 8l..8l+7's.
struct DeltaParts {
  float dl[2];
  float delta[4];
  const uint8_t* g[4];
};

inline void delta_scalar(const DeltaParts& p, float* w) {
  for (int i = 0; i < 32; ++i) {
    const float level = static_cast<float>(static_cast<int8_t>(p.g[i / 8][i % 8]));
    w[i] = p.dl[i / 16] * (level + p.delta[i / 8]);
  }
}

#ifdef FREETOKEN_AVX2
// kLanes levels as floats: the 8-byte grid entries g[0..kLanes / 8), uint8 or (I8) int8.
template <bool I8>
inline vf levels8(const uint8_t* const* g) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(g[0])),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(g[1])));
  return _mm512_cvtepi32_ps(I8 ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#else
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(g[0]));
  return _mm256_cvtepi32_ps(I8 ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#endif
}
// kLanes levels as floats: the 4-byte grid entries g[0..kLanes / 4) (uint8).
inline vf levels4(const uint8_t* const* g) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m128i b = _mm_setr_epi32(
      static_cast<int>(load_u32(g[0])), static_cast<int>(load_u32(g[1])),
      static_cast<int>(load_u32(g[2])), static_cast<int>(load_u32(g[3])));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
#else
  const __m128i b = _mm_setr_epi32(static_cast<int>(load_u32(g[0])),
                                   static_cast<int>(load_u32(g[1])), 0, 0);
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
#endif
}
// v with lane j negated (its sign bit flipped) where bit j of s is set, j < kLanes.
inline vf negate_where(vf v, uint32_t s) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512i i = _mm512_castps_si512(v);
  return _mm512_castsi512_ps(_mm512_mask_xor_epi32(i, static_cast<__mmask16>(s), i,
                                                   _mm512_set1_epi32(INT32_MIN)));
#else
  // bit j of s to bit 31 of lane j
  const __m256i bits = _mm256_sllv_epi32(_mm256_set1_epi32(static_cast<int>(s)),
                                         _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24));
  return _mm256_xor_ps(
      v, _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN))));
#endif
}
inline vf vadd(vf a, vf b) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return _mm512_add_ps(a, b);
#else
  return _mm256_add_ps(a, b);
#endif
}
// kLanes lanes, 8 a value: lanes 8l..8l+7 get x[l].
inline vf per8(const float* x) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(x[0]), _mm512_set1_ps(x[1]));
#else
  return _mm256_set1_ps(x[0]);
#endif
}

template <int W>
inline void signed_vec(const SignedParts<W>& p, vf w[kVecs]) {
  for (int v = 0; v < kVecs; ++v) {
    const int first = v * kLanes;  // the vector's first weight
    const vf level = W == 8 ? levels8<false>(p.g + first / 8) : levels4(p.g + first / 4);
    w[v] = negate_where(vmul(set1(p.db[first / 16]), level), p.signs >> first);
  }
}

inline void delta_vec(const DeltaParts& p, vf w[kVecs]) {
  for (int v = 0; v < kVecs; ++v) {
    const int first = v * kLanes;
    const vf level = vadd(levels8<true>(p.g + first / 8), per8(p.delta + first / 8));
    w[v] = vmul(set1(p.dl[first / 16]), level);
  }
}
#endif

}  // namespace detail

// Each type: parts() (a sub-block's scales, grid entries and signs or deltas, from its
// bytes), and gguf_types.h's two decoders on them. A unit is a super-block of 256 weights.
struct IQUnit {
  static constexpr int64_t kWeights = 256;
  static constexpr int kSubs = kWeights / 32;
  static constexpr bool kSimd = true;
};

// IQ2_XXS: d@0, then per sub-block ib 8 bytes at 2 + 8 ib: 4 grid indices (iq2xxs_grid),
// and a u32 of 4 7-bit sign indices (ksigns) and ls in its top 4 bits.
template <>
struct Type<IQ2_XXS> : IQUnit {
  static constexpr int64_t kBytes = 66;
  static detail::SignedParts<8> parts(const uint8_t* unit, int sub) {
    using namespace detail;
    const uint32_t idx = load_u32(unit + 2 + 8 * sub), aux = load_u32(unit + 6 + 8 * sub);
    const float db = half(unit) * (0.5f + static_cast<float>(aux >> 28)) * 0.25f;
    SignedParts<8> p{{db, db}, {}, 0};
    for (int l = 0; l < 4; ++l) {
      p.g[l] = iq::kIQ2XXSGrid.v[(idx >> (8 * l)) & 255];
      p.signs |= static_cast<uint32_t>(iq::kSigns.v[(aux >> (7 * l)) & 127]) << (8 * l);
    }
    return p;
  }
  static void scalar(const uint8_t* unit, int sub, float* w) {
    detail::signed_scalar(parts(unit, sub), w);
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int sub, vf w[kVecs]) {
    detail::signed_vec(parts(unit, sub), w);
  }
#endif
};

// IQ2_XS: d@0, u16 qs[32]@2 (a grid index in the low 9 bits, a sign index in the high 7),
// scales[8]@66 (two 4-bit ls a sub-block, one per 16 weights).
template <>
struct Type<IQ2_XS> : IQUnit {
  static constexpr int64_t kBytes = 74;
  static detail::SignedParts<8> parts(const uint8_t* unit, int sub) {
    using namespace detail;
    const float d = half(unit);
    const int sc = unit[66 + sub];
    SignedParts<8> p{{d * (0.5f + static_cast<float>(sc & 15)) * 0.25f,
                      d * (0.5f + static_cast<float>(sc >> 4)) * 0.25f},
                     {},
                     0};
    for (int l = 0; l < 4; ++l) {
      const uint16_t q = load_u16(unit + 2 + 8 * sub + 2 * l);
      p.g[l] = iq::kIQ2XSGrid.v[q & 511];
      p.signs |= static_cast<uint32_t>(iq::kSigns.v[q >> 9]) << (8 * l);
    }
    return p;
  }
  static void scalar(const uint8_t* unit, int sub, float* w) {
    detail::signed_scalar(parts(unit, sub), w);
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int sub, vf w[kVecs]) {
    detail::signed_vec(parts(unit, sub), w);
  }
#endif
};

// IQ2_S: d@0, qs[32]@2 (grid indices' low 8 bits), signs[32]@34 (a bit a weight), qh[8]@66
// (the indices' 2 high bits, 4 groups a byte), scales[8]@74 (as IQ2_XS's).
template <>
struct Type<IQ2_S> : IQUnit {
  static constexpr int64_t kBytes = 82;
  static detail::SignedParts<8> parts(const uint8_t* unit, int sub) {
    using namespace detail;
    const float d = half(unit);
    const int sc = unit[74 + sub], qh = unit[66 + sub];
    SignedParts<8> p{{d * (0.5f + static_cast<float>(sc & 15)) * 0.25f,
                      d * (0.5f + static_cast<float>(sc >> 4)) * 0.25f},
                     {},
                     load_u32(unit + 34 + 4 * sub)};
    for (int l = 0; l < 4; ++l)
      p.g[l] = iq::kIQ2SGrid.v[unit[2 + 4 * sub + l] | ((qh >> (2 * l)) & 3) << 8];
    return p;
  }
  static void scalar(const uint8_t* unit, int sub, float* w) {
    detail::signed_scalar(parts(unit, sub), w);
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int sub, vf w[kVecs]) {
    detail::signed_vec(parts(unit, sub), w);
  }
#endif
};

// IQ3_XXS: d@0, qs[64]@2 (grid indices, iq3xxs_grid's 4 levels each, 8 a sub-block), then a
// u32 per sub-block@66 + 4 ib: 4 7-bit sign indices and ls in its top 4 bits.
template <>
struct Type<IQ3_XXS> : IQUnit {
  static constexpr int64_t kBytes = 98;
  static detail::SignedParts<4> parts(const uint8_t* unit, int sub) {
    using namespace detail;
    const uint32_t aux = load_u32(unit + 66 + 4 * sub);
    const float db = half(unit) * (0.5f + static_cast<float>(aux >> 28)) * 0.5f;
    SignedParts<4> p{{db, db}, {}, 0};
    for (int k = 0; k < 8; ++k) p.g[k] = iq::kIQ3XXSGrid.v[unit[2 + 8 * sub + k]];
    for (int l = 0; l < 4; ++l)
      p.signs |= static_cast<uint32_t>(iq::kSigns.v[(aux >> (7 * l)) & 127]) << (8 * l);
    return p;
  }
  static void scalar(const uint8_t* unit, int sub, float* w) {
    detail::signed_scalar(parts(unit, sub), w);
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int sub, vf w[kVecs]) {
    detail::signed_vec(parts(unit, sub), w);
  }
#endif
};

// IQ3_S: d@0, qs[64]@2 (grid indices' low 8 bits, iq3s_grid), qh[8]@66 (their ninth bits,
// a byte a sub-block), signs[32]@74 (a bit a weight), scales[4]@106 (a 4-bit ls a sub-block).
template <>
struct Type<IQ3_S> : IQUnit {
  static constexpr int64_t kBytes = 110;
  static detail::SignedParts<4> parts(const uint8_t* unit, int sub) {
    using namespace detail;
    const int ls = (unit[106 + sub / 2] >> (4 * (sub % 2))) & 15, qh = unit[66 + sub];
    const float db = half(unit) * static_cast<float>(1 + 2 * ls);
    SignedParts<4> p{{db, db}, {}, load_u32(unit + 74 + 4 * sub)};
    for (int k = 0; k < 8; ++k)
      p.g[k] = iq::kIQ3SGrid.v[unit[2 + 8 * sub + k] | ((qh >> k) & 1) << 8];
    return p;
  }
  static void scalar(const uint8_t* unit, int sub, float* w) {
    detail::signed_scalar(parts(unit, sub), w);
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int sub, vf w[kVecs]) {
    detail::signed_vec(parts(unit, sub), w);
  }
#endif
};

// IQ1_S: d@0, qs[32]@2 (grid indices' low 8 bits, iq1s_grid), u16 qh[8]@34, one a sub-block:
// the indices' 3 high bits for its 4 groups (bits 3l..3l+2), ls (bits 12-14) and the sign of
// its delta (bit 15).
template <>
struct Type<IQ1_S> : IQUnit {
  static constexpr int64_t kBytes = 50;
  static detail::DeltaParts parts(const uint8_t* unit, int sub) {
    using namespace detail;
    const int qh = load_u16(unit + 34 + 2 * sub);
    const float dl = half(unit) * static_cast<float>(2 * ((qh >> 12) & 7) + 1);
    const float delta = detail::delta_of(static_cast<uint32_t>(qh & 0x8000) << 16);
    DeltaParts p{{dl, dl}, {delta, delta, delta, delta}, {}};
    for (int l = 0; l < 4; ++l)
      p.g[l] = iq::kIQ1SGrid.v[unit[2 + 4 * sub + l] | ((qh >> (3 * l)) & 7) << 8];
    return p;
  }
  static void scalar(const uint8_t* unit, int sub, float* w) {
    detail::delta_scalar(parts(unit, sub), w);
  }
#ifdef FREETOKEN_AVX2
  static void vec(const uint8_t* unit, int sub, vf w[kVecs]) {
    detail::delta_vec(parts(unit, sub), w);
  }
#endif
};

// IQ1_M: qs[32]@0 (grid indices' low 8 bits, iq1s_grid), qh[16]@32 (a nibble a group of 8:
// the index's 3 high bits and its delta's sign), u16 scales[4]@48: a 3-bit ls per 16
// weights in bits 0-11 of each, and d, a float16, in their top 4 bits (d's lowest first).
template <>
struct Type<IQ1_M> : IQUnit {
  static constexpr int64_t kBytes = 56;
  // The unit's scale d, a float16 in the top 4 bits of its four u16 scales (d's lowest
  // first), and its sixteen dl = d (2 ls + 1), one per 16 weights (ls: 3 bits, four a u16).
  static float unit_d(const uint16_t sc[4]) {
    return detail::half_bits(static_cast<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) |
                                                   ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000)));
  }
  static float dl(const uint16_t sc[4], float d, int i) {
    return d * static_cast<float>(2 * ((sc[i / 4] >> (3 * (i % 4))) & 7) + 1);
  }
  // A sub-block's grid entries and deltas (dl left to the caller).
  static detail::DeltaParts groups(const uint8_t* unit, int sub) {
    detail::DeltaParts p{};
    for (int l = 0; l < 4; ++l) {
      const int nib = (unit[32 + 2 * sub + l / 2] >> (4 * (l % 2))) & 15;
      p.g[l] = iq::kIQ1SGrid.v[unit[4 * sub + l] | (nib & 7) << 8];
      p.delta[l] = detail::delta_of(static_cast<uint32_t>(nib & 8) << 28);
    }
    return p;
  }
  static detail::DeltaParts parts(const uint8_t* unit, int sub) {
    uint16_t sc[4];
    std::memcpy(sc, unit + 48, 8);
    const float d = unit_d(sc);
    detail::DeltaParts p = groups(unit, sub);
    for (int h = 0; h < 2; ++h) p.dl[h] = dl(sc, d, 2 * sub + h);
    return p;
  }
  static void scalar(const uint8_t* unit, int sub, float* w) {
    detail::delta_scalar(parts(unit, sub), w);
  }
#ifdef FREETOKEN_AVX2
  // The unit's sixteen dl, worked out once for its eight sub-blocks (the same products): d,
  // spread over four u16, is not formed again a sub-block (one row, a 4096 x 4096 linear on
  // one thread: 10.5 -> 9.1 ms, this VM's Zen 4).
  struct Head {
    float dl[16];
  };
  static void head(const uint8_t* unit, Head& h) {
    uint16_t sc[4];
    std::memcpy(sc, unit + 48, 8);
    const float d = unit_d(sc);
    for (int i = 0; i < 16; ++i) h.dl[i] = dl(sc, d, i);
  }
  static void vec(const uint8_t* unit, int sub, const Head& h, vf w[kVecs]) {
    detail::DeltaParts p = groups(unit, sub);
    p.dl[0] = h.dl[2 * sub];
    p.dl[1] = h.dl[2 * sub + 1];
    detail::delta_vec(p, w);
  }
  static void vec(const uint8_t* unit, int sub, vf w[kVecs]) {
    detail::delta_vec(parts(unit, sub), w);
  }
#endif
};

}  // namespace freetoken::gguf::types
