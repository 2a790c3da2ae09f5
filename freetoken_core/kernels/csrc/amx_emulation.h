// AMX tile instructions computed in software, for the tests of int_linear.cpp's AMX path on
// CPUs that have no AMX (built with -DFREETOKEN_AMX_EMULATE; never in the product's build).
//
// The path's code is the same in both builds: it calls the FT_TILE_* macros, which are the
// AMX intrinsics where the compiler targets AMX, else the emulations below. Each follows the
// instruction's definition in Intel's SDM (palette 1: eight tiles of up to 16 rows of 64
// bytes): TDPB[SU][SU]D adds to C[m][n] (int32) the sum over k < colsb(A) / 4 and i < 4 of
// A[m][4k + i] * B[k][4n + i], A's and B's bytes signed or unsigned as the instruction's
// letters say, wrapping as int32 arithmetic does; loads, stores and zeroing take the
// configured rows and bytes of a row. A shape the hardware would refuse (#UD: B's rows not
// A's bytes / 4, C's rows not A's, C's bytes not B's, more than 16 rows or 64 bytes) throws
// here, so that the tests catch what a real AMX run would fault on.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>

namespace freetoken::amx_emulation {

struct Tiles {
  int rows[8] = {};
  int colsb[8] = {};
  alignas(64) uint8_t data[8][16][64] = {};
};

inline Tiles& tiles() {
  thread_local Tiles t;
  return t;
}

// A 64-byte palette-1 configuration: palette@0, colsb (uint16)[16]@16, rows (uint8)[16]@48.
inline void loadconfig(const void* config) {
  const uint8_t* c = static_cast<const uint8_t*>(config);
  TORCH_CHECK(c[0] == 1, "amx emulation: palette 1 only");
  Tiles& t = tiles();
  for (int i = 0; i < 8; ++i) {
    uint16_t colsb;
    std::memcpy(&colsb, c + 16 + 2 * i, 2);
    TORCH_CHECK(colsb <= 64 && c[48 + i] <= 16, "amx emulation: tile ", i,
                " configured past 16 rows of 64 bytes");
    t.colsb[i] = colsb;
    t.rows[i] = c[48 + i];
  }
}

inline void loadd(int tile, const void* base, int64_t stride) {
  Tiles& t = tiles();
  for (int r = 0; r < t.rows[tile]; ++r)
    std::memcpy(t.data[tile][r], static_cast<const uint8_t*>(base) + r * stride,
                t.colsb[tile]);
}

inline void stored(int tile, void* base, int64_t stride) {
  Tiles& t = tiles();
  for (int r = 0; r < t.rows[tile]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, t.data[tile][r], t.colsb[tile]);
}

inline void zero(int tile) { std::memset(tiles().data[tile], 0, sizeof tiles().data[tile]); }

template <bool SignedA, bool SignedB>
void dot(int c, int a, int b) {
  Tiles& t = tiles();
  TORCH_CHECK(t.rows[b] == t.colsb[a] / 4 && t.rows[c] == t.rows[a] &&
                  t.colsb[c] == t.colsb[b] && t.colsb[a] % 4 == 0 && t.colsb[c] % 4 == 0,
              "amx emulation: tile shapes that TDPB*D refuses (C ", t.rows[c], "x", t.colsb[c],
              ", A ", t.rows[a], "x", t.colsb[a], ", B ", t.rows[b], "x", t.colsb[b], ")");
  for (int m = 0; m < t.rows[c]; ++m)
    for (int n = 0; n < t.colsb[c] / 4; ++n) {
      uint32_t acc;
      std::memcpy(&acc, &t.data[c][m][4 * n], 4);
      for (int k = 0; k < t.colsb[a] / 4; ++k)
        for (int i = 0; i < 4; ++i) {
          const uint8_t x = t.data[a][m][4 * k + i], y = t.data[b][k][4 * n + i];
          const int32_t xv = SignedA ? static_cast<int8_t>(x) : x;
          const int32_t yv = SignedB ? static_cast<int8_t>(y) : y;
          acc += static_cast<uint32_t>(xv * yv);  // int32 wrap-around, as the hardware's
        }
      std::memcpy(&t.data[c][m][4 * n], &acc, 4);
    }
}

}  // namespace freetoken::amx_emulation

// Tile numbers must be literals, as the intrinsics' are (they name the register in their
// assembly): FT_TILE_NUMBER(3) is 3, and a variable fails to compile here as it would there.
#define FT_TILE_NUMBER(tile) (tile##0 / 10)
#define FT_TILE_LOADCONFIG(config) ::freetoken::amx_emulation::loadconfig(config)
#define FT_TILE_RELEASE() ((void)0)
#define FT_TILE_LOADD(tile, base, stride) \
  ::freetoken::amx_emulation::loadd(FT_TILE_NUMBER(tile), base, stride)
#define FT_TILE_STORED(tile, base, stride) \
  ::freetoken::amx_emulation::stored(FT_TILE_NUMBER(tile), base, stride)
#define FT_TILE_ZERO(tile) ::freetoken::amx_emulation::zero(FT_TILE_NUMBER(tile))
#define FT_TILE_DPBSSD(c, a, b) \
  ::freetoken::amx_emulation::dot<true, true>(FT_TILE_NUMBER(c), FT_TILE_NUMBER(a), FT_TILE_NUMBER(b))
#define FT_TILE_DPBSUD(c, a, b) \
  ::freetoken::amx_emulation::dot<true, false>(FT_TILE_NUMBER(c), FT_TILE_NUMBER(a), FT_TILE_NUMBER(b))
#define FT_TILE_DPBUSD(c, a, b) \
  ::freetoken::amx_emulation::dot<false, true>(FT_TILE_NUMBER(c), FT_TILE_NUMBER(a), FT_TILE_NUMBER(b))
#define FT_TILE_DPBUUD(c, a, b) \
  ::freetoken::amx_emulation::dot<false, false>(FT_TILE_NUMBER(c), FT_TILE_NUMBER(a), FT_TILE_NUMBER(b))
