// GGUF Q4_1 / Q8_0 blocks as the linear kernels read them (gguf_linear.cpp, exact float32;
// q8_linear.cpp, 8-bit activations): the type ids, block sizes, the float16 scales, and the
// software prefetch both kernels use while streaming the blocks from memory.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace freetoken::gguf {

constexpr int64_t kQ4_1 = 3, kQ8_0 = 8;  // ggml type ids
constexpr int64_t kBlock = 32;           // weights per block

// A block as gguf_linear (exact) reads it. Q4_1: d, m as float32, 16 bytes of nibbles (24
// bytes: the file's float16 scales widened at load, models/block_layout.py
// widen_scales); Q8_0: d (float16), 32 int8, as in the file. With float32 scales each one is
// a broadcast load instead of a conversion and two shuffles on the vector pipes, which one
// row keeps busy: the 30 layers' linears at one row 8 % faster on two threads, 14 % on one,
// for 20 % more bytes (Zen 3 reference, paired). Whole decode steps, paired in one process:
// one sequence 0.914 / 0.958, four 0.997, sixteen 0.986 of the step with float16 scales.
constexpr int64_t block_bytes(int64_t qt) { return qt == kQ4_1 ? 24 : 34; }
// A block as the file stores it, which gguf_linear_q8 reads (bound by memory more than by
// its integer arithmetic: it keeps the 20-byte Q4_1 blocks).
constexpr int64_t file_block_bytes(int64_t qt) { return qt == kQ4_1 ? 20 : 34; }

inline float load_float(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// The kernels' layout of a weight's blocks (models/block_layout.py interleave_blocks makes it
// from the file's rows, kernel_blocks after widening the Q4_1 scales): the output
// features in groups of kGroup, the last group holding what is left (1 to kGroup), each
// group's blocks interleaved by block index, so that block b of the group's feature i lies
// at group start + (b * group size + i) * block bytes. A group starts where its first
// feature's row of blocks started in the file's layout (feature g0 at g0 * row bytes), and
// ends where its last one's ended.
//
// Why: the kernels read several features' blocks side by side (four at one row), and in the
// file's layout those are four streams a row apart (612 bytes for the tied head), which the
// hardware prefetcher follows poorly; interleaved, a pass over a group reads its bytes in
// address order, one stream. On the Zen 3 reference, exact kernel, one row, two threads,
// paired in one process (two runs; the same results bit for bit): the 49,152 x 576 Q8_0
// head 2.7 -> 1.7 and 4.7 -> 2.5 ms, the 30 layers' Q4_1 linears 9.2 -> 7.9 and 12.1 -> 11.5
// ms; at 16 and 64 rows (the panels) the same within the noise. Whole decode steps, paired
// against the previous layout and kernels in one process: one sequence 12.1 -> 9.7 ms, 16
// sequences 4-9 % slower (the panels' tile loop; docs/operations.md).
constexpr int64_t kGroup = 4;

// Feature f's blocks in the kernels' layout: block b at first + b * stride; feature f + 1 of
// the same group at first + block bytes.
struct FeatureBlocks {
  const uint8_t* first;
  int64_t stride;
};

inline FeatureBlocks feature_blocks(const uint8_t* blocks, int64_t features, int64_t row_bytes,
                                    int64_t block_bytes, int64_t f) {
  const int64_t g0 = f - f % kGroup;
  const int64_t size = std::min(kGroup, features - g0);
  return {blocks + g0 * row_bytes + (f - g0) * block_bytes, size * block_bytes};
}

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
