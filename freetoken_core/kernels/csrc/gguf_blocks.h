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
#endif

}  // namespace freetoken::gguf
