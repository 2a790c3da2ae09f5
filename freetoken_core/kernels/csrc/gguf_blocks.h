// GGUF Q4_1 / Q8_0 blocks as the linear kernels read them (gguf_linear.cpp, exact float32;
// q8_linear.cpp, 8-bit activations): the type ids, block sizes, the float16 scales, and the
// software prefetch both kernels use while streaming the blocks from memory.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace freetoken::gguf {

constexpr int64_t kQ4_1 = 3, kQ8_0 = 8;  // ggml type ids
constexpr int64_t kBlock = 32;           // weights per block

// Q4_1: d, m (float16), 16 bytes of nibbles; Q8_0: d (float16), 32 int8.
constexpr int64_t block_bytes(int64_t qt) { return qt == kQ4_1 ? 20 : 34; }

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction; the same IEEE value as the portable path
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

#ifdef FREETOKEN_AVX2
// Software prefetch distance, in bytes ahead of the block being read. A decode step streams
// ~96 MB of blocks from DRAM in short calls (one linear of one layer, split over the
// threads); the hardware prefetchers do not ramp up on such short, interleaved streams, and
// with 8 blocks (160-272 bytes) ahead the kernels waited on memory: a step's linears at one
// row took 18 ms where 4 KB ahead takes 12 (exact) and 9 ms -> 6 ms (q8), on the Zen 3
// reference (8 KB and 16 KB measure the same).
constexpr int64_t kPrefetchBytes = 4096;

// Prefetch [p, p + bytes), a cache line at a time (Hint: _MM_HINT_T0 into L1, _T1 into L2).
template <int Hint = _MM_HINT_T0>
inline void prefetch_range(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + i), static_cast<_mm_hint>(Hint));
}

constexpr int64_t kScaleChunk = 32;  // blocks whose scales are converted at once

// The float32 scales (d, and m for Q4_1) of blocks [b0, b0 + count) of one feature's row,
// eight blocks per gather and conversion instead of a scalar conversion per block (which
// costs a third of a row's time). The same IEEE values as half_to_float. q8_linear's
// kernels use it; gguf_linear converts each block's scales with one F16C conversion as it
// reads the block (block_dm), which measured faster there.
template <int64_t QT>
inline void block_scales(const uint8_t* row, int64_t b0, int64_t count, float* d, float* m) {
  const __m256i offsets =
      _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                         _mm256_set1_epi32(static_cast<int>(block_bytes(QT))));
  const __m256i low = _mm256_set1_epi32(0xFFFF);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    // 4 bytes at the start of each block: d, then m (Q4_1) or the first quants (Q8_0).
    const __m256i head = _mm256_i32gather_epi32(
        reinterpret_cast<const int*>(row + (b0 + i) * block_bytes(QT)), offsets, 1);
    const __m256i ds = _mm256_and_si256(head, low);
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_packus_epi32(
        _mm256_castsi256_si128(ds), _mm256_extracti128_si256(ds, 1))));
    if constexpr (QT == kQ4_1) {
      const __m256i ms = _mm256_srli_epi32(head, 16);
      _mm256_storeu_ps(m + i, _mm256_cvtph_ps(_mm_packus_epi32(
          _mm256_castsi256_si128(ms), _mm256_extracti128_si256(ms, 1))));
    }
  }
  for (; i < count; ++i) {
    const uint8_t* block = row + (b0 + i) * block_bytes(QT);
    d[i] = half_to_float(block);
    if constexpr (QT == kQ4_1) m[i] = half_to_float(block + 2);
  }
}
#endif

}  // namespace freetoken::gguf
