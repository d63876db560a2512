/* What the AMX paths (float_linear.cpp's bf16 tiles, block_linear.cpp's int8 tiles) share: the
 * process's permission to use the tiles, their configuration, and -- for a build with
 * KVFLOW_AMX_EMULATE on a CPU without AMX -- the int8 tile instructions in plain C++, so that the
 * block kernels' AMX path (its layouts, its row blocks, its float epilogue) is tested on any CPU
 * against their vector path (tests/kernels/test_block_linear.py). Where the CPU has AMX the real instructions
 * run and the same test compares them. */
#ifndef KVFLOW_AMX_H
#define KVFLOW_AMX_H

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <immintrin.h>
#define KVFLOW_AMX_INT8 1
#elif defined(KVFLOW_AMX_EMULATE)
#define KVFLOW_AMX_INT8 1
#define KVFLOW_AMX_EMULATED 1
#endif

namespace kvflow {

// Linux gives a process the tiles' register state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); KVFLOW_AMX=0 turns every AMX path off (benchmarks).
inline bool amx_permitted() {
  static const bool ok = [] {
    const char* env = std::getenv("KVFLOW_AMX");
    if (env && env[0] == '0') return false;
#ifdef KVFLOW_AMX_EMULATED
    return true;
#else
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#endif
  }();
  return ok;
}

/* The tile configuration (palette 1): each tile's rows and bytes per row. */
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#ifdef KVFLOW_AMX_EMULATED
/* Eight tiles of at most 16 rows x 64 bytes per thread, as the configuration last loaded shapes
 * them; the int8 products as the ISA defines them: C[m][n] (int32) += sum over K/4 steps k and
 * i < 4 of A[m][4k + i] x B[k][4n + i], wrapping, A and B signed or unsigned as named. */
namespace amx_emulated {
struct Tiles {
  uint8_t data[8][16][64];
  int rows[8], colsb[8];
};
inline thread_local Tiles tiles;

inline void loadconfig(const void* p) {
  const auto* c = static_cast<const TileConfig*>(p);
  for (int t = 0; t < 8; t++) tiles.rows[t] = c->rows[t], tiles.colsb[t] = c->colsb[t];
}
inline void zero(int t) { std::memset(tiles.data[t], 0, sizeof tiles.data[t]); }
inline void load(int t, const void* base, long stride) {
  for (int r = 0; r < tiles.rows[t]; r++)
    std::memcpy(tiles.data[t][r], static_cast<const uint8_t*>(base) + r * stride, tiles.colsb[t]);
}
inline void store(int t, void* base, long stride) {
  for (int r = 0; r < tiles.rows[t]; r++)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, tiles.data[t][r], tiles.colsb[t]);
}
template <bool ASigned, bool BSigned>
inline void dp(int c, int a, int b) {
  for (int m = 0; m < tiles.rows[c]; m++)
    for (int n = 0; n < tiles.colsb[c] / 4; n++) {
      uint32_t sum;  // (wrapping, as the instruction's int32 sums do)
      std::memcpy(&sum, tiles.data[c][m] + 4 * n, 4);
      for (int k = 0; k < tiles.colsb[a] / 4; k++)
        for (int i = 0; i < 4; i++) {
          const uint8_t x = tiles.data[a][m][4 * k + i], w = tiles.data[b][k][4 * n + i];
          const int32_t xv = ASigned ? (int32_t)(int8_t)x : (int32_t)x, wv = BSigned ? (int32_t)(int8_t)w : (int32_t)w;
          sum += (uint32_t)(xv * wv);
        }
      std::memcpy(tiles.data[c][m] + 4 * n, &sum, 4);
    }
}
}  // namespace amx_emulated

// (GCC's immintrin.h defines these whatever the target: its inline assembly would not run here)
#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_dpbssd
#undef _tile_dpbsud
#define _tile_loadconfig(p) kvflow::amx_emulated::loadconfig(p)
#define _tile_release() ((void)0)
#define _tile_zero(t) kvflow::amx_emulated::zero(t)
#define _tile_loadd(t, base, stride) kvflow::amx_emulated::load(t, base, stride)
#define _tile_stream_loadd(t, base, stride) kvflow::amx_emulated::load(t, base, stride)
#define _tile_stored(t, base, stride) kvflow::amx_emulated::store(t, base, stride)
#define _tile_dpbssd(c, a, b) kvflow::amx_emulated::dp<true, true>(c, a, b)
#define _tile_dpbsud(c, a, b) kvflow::amx_emulated::dp<true, false>(c, a, b)
#endif

}  // namespace kvflow

#endif
