/* Float linear (kvflow/kernels/cpu/float_linear.py, NativeFloatKernel): out = residual + W . pre(x)
 * + bias, pre as in linear_ops.h; float32 sums, the weight in float32 or bfloat16.
 *
 * Decode at small batch is bound by the bytes of weight read, batched decode by the multiply-adds.
 * The weight is packed once into panels of LANES_OUT output channels (FloatWeight in
 * float_linear.h), so a register tile of R rows x J panels loads J weight vectors per input
 * feature, broadcasts each row's input value, and accumulates R x J vectors of outputs: every
 * weight load serves R rows, nothing needs a horizontal sum, and a thread reads its panels as J
 * sequential streams. Rows beyond R reuse the same panels from L2, and meanwhile fetch the thread's
 * next group of panels into L2, so reading it from memory overlaps arithmetic (batched decode:
 * benchmarks/cpu_speed.py). A single row, bound by memory alone, instead reads three of the
 * thread's groups at once: three streams keep more of memory's bandwidth busy than one. This kernel
 * and the fused decode pass over it (decode_pass.cpp) are the autotune's native candidates
 * (kvflow/worker/autotune.py).
 *
 * float8 e4m3 weights (FP8 checkpoints): widened in registers through the CPU's half-to-float
 * conversion (simd.h), each output's sum scaled by its channel's scale afterwards; rows rounded to
 * e4m3 per token first where the checkpoint quantizes activations (ACT_FP8_TOKEN).
 *
 * bfloat16 weights: where the CPU has AVX512-BF16 each row's input is rounded to bf16 once per call
 * and pairs of features go through vdpbf16ps (two exact products per lane, summed in float32), as
 * a bf16 model's matmuls round their inputs; elsewhere the weights are widened to float32 in
 * registers (a shift) and meet float32 inputs.
 *
 * Each output's sum runs over the features in order, the same for any tile or number of rows, so
 * a token's result does not depend on its batch (this file is compiled without reassociation:
 * kvflow/kernels/cpu/native.py).
 */
#include "float_linear.h"
#include "amx.h"
#include "weight_memory.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#if defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvflow {
namespace {

// bf16 weights widened under AVX2: two panels' values for an input feature are stored so that one
// 256-bit load and two unpacks against zero (which put each bf16 in its float's upper half) give
// both panels' vectors, instead of a widening load and a shift per panel (packed_index).
#if defined(__AVX2__) && !defined(__AVX512F__)
#define KVFLOW_PAIRED_BF16 1
constexpr bool PAIRED_BF16 = true;
#else
constexpr bool PAIRED_BF16 = false;
#endif

// R x J accumulators and the J weight vectors fill the registers (the broadcast is an operand from
// memory): AVX-512's 32 take 7 rows x 4 panels + 4, faster at 32-64 rows than 4 rows (8 spill);
// under AVX2's 16, 3 rows ran faster than 2 or 4 at 8-64 rows (docs/benchmarks/results/).
constexpr int TILE_ROWS = LANES_OUT == 16 ? 7 : 3;
constexpr int GROUP = 4;  // panels per tile (J), stored interleaved
// A call of TILE_ROWS + 1 .. WIDE_ROWS rows (a MoE expert's share of a batch) takes each group in one
// pass of all its rows over half the group's panels at a time (R x 2 accumulators), instead of two
// passes over the whole group: the second pass re-read the group and cost as much as the first
// (docs/benchmarks/results/2026-12-06-epyc-avx512.md).
constexpr int WIDE_ROWS = LANES_OUT == 16 ? 12 : TILE_ROWS;

inline vfloat load(const float* p) { return *(const vfloat*)p; }
inline vfloat load(const uint16_t* p) { return widen_bf16(p); }
inline vfloat load(const uint8_t* p) { return widen_e4m3(p); }

inline int element_size(int type) { return type == W_F32 ? 4 : type == W_BF16 ? 2 : 1; }

/* The J panels' vectors of one input feature (or, bf16, its widened values), w at the feature. */
template <int J>
inline void load_panels(const float* w, vfloat (&wv)[J]) {
  for (int j = 0; j < J; j++) wv[j] = load(w + j * LANES_OUT);
}

template <int J>
inline void load_panels(const uint8_t* w, vfloat (&wv)[J]) {
  for (int j = 0; j < J; j++) wv[j] = load(w + j * LANES_OUT);
}

template <int J>
inline void load_panels(const uint16_t* w, vfloat (&wv)[J]) {
  int j = 0;
#ifdef KVFLOW_PAIRED_BF16
  const __m256i zero = _mm256_setzero_si256();
  for (; j + 1 < J; j += 2) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(w + j * LANES_OUT));
    wv[j] = (vfloat)_mm256_unpacklo_epi16(zero, v);
    wv[j + 1] = (vfloat)_mm256_unpackhi_epi16(zero, v);
  }
#endif
  for (; j < J; j++) wv[j] = load(w + j * LANES_OUT);
}

/* Output vectors of R rows x J panels into y (rows ldy apart; the last panel may be partial: only
 * `valid` channels written). */
template <int R, int J>
inline void store(const vfloat (&acc)[R][J], float* y, long ldy, int valid) {
  for (int r = 0; r < R; r++)
    for (int j = 0; j < J; j++) {
      float* dst = y + r * ldy + j * LANES_OUT;
      const int cnt = std::min(LANES_OUT, valid - j * LANES_OUT);
      if (cnt == LANES_OUT)
        *(vfloat*)dst = acc[r][j];
      else if (cnt > 0)
        std::memcpy(dst, &acc[r][j], cnt * sizeof(float));
    }
}

/* The next group's weight, `lines` cache lines of it from `at`, fetched into L2 `per` lines per input
 * feature (or pair) while a tile computes from L2 (see group_rows). */
struct Prefetch {
  const char* at = nullptr;
  int lines = 0;
  int per = 1;

  inline void step(int c) const {
    for (int i = c * per, e = std::min(lines, i + per); i < e; i++) __builtin_prefetch(at + i * 64L, 0, 2);
  }
};

/* float32 (or widened bf16) weights: J panels of a group of `width` interleaved panels (width x
 * LANES_OUT elements from one input feature to the next, panel j at j * LANES_OUT); v: R input rows
 * ldv apart. */
template <int R, int J, class T>
inline void tile(const T* __restrict w, int k, const float* __restrict v, long ldv, float* y, long ldy, int valid,
                 Prefetch pf, int width) {
  vfloat acc[R][J];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < J; j++) acc[r][j] = vfloat{};
  for (int c = 0; c < k; c++) {
    pf.step(c);
    vfloat wv[J];
    load_panels<J>(w + (long)c * width * LANES_OUT, wv);
    for (int r = 0; r < R; r++) {
      const vfloat xs = vfloat{} + v[r * ldv + c];
      for (int j = 0; j < J; j++) acc[r][j] = fmadd(wv[j], xs, acc[r][j]);
    }
  }
  store<R, J>(acc, y, ldy, valid);
}

/* One row over S full groups at once (each J interleaved panels): S sequential streams per thread
 * keep more of memory's bandwidth busy than one. Each output's sum is the same as tile's. */
template <int S, int J, class T>
inline void tile_streams(const T* const (&w)[S], int k, const float* __restrict v, float* const (&y)[S]) {
  vfloat acc[S][J];
  for (int s = 0; s < S; s++)
    for (int j = 0; j < J; j++) acc[s][j] = vfloat{};
  for (int c = 0; c < k; c++) {
    const vfloat xs = vfloat{} + v[c];
    for (int s = 0; s < S; s++) {
      vfloat wv[J];
      load_panels<J>(w[s] + (long)c * J * LANES_OUT, wv);
      for (int j = 0; j < J; j++) acc[s][j] = fmadd(wv[j], xs, acc[s][j]);
    }
  }
  for (int s = 0; s < S; s++)
    for (int j = 0; j < J; j++) *(vfloat*)(y[s] + j * LANES_OUT) = acc[s][j];
}

/* The thread's `full` full groups from g0 for one row, S at a time from S separate parts of the range;
 * how many it took. */
template <int S, class T>
inline int one_row_streams(const FloatWeight& p, const float* v, float* out, int g0, int full) {
  const int len = full / S;
  for (int i = 0; i < len; i++) {
    const T* w[S];
    float* y[S];
    for (int s = 0; s < S; s++) {
      const long first = (long)(g0 + s * len + i) * GROUP * LANES_OUT;
      w[s] = static_cast<const T*>(p.w) + first * p.kp;
      y[s] = out + first;
    }
    tile_streams<S, GROUP>(w, p.k, v, y);
  }
  return S * len;
}

/* Three streams, then two over what remains; how many groups that took. */
template <class T>
inline int one_row(const FloatWeight& p, const float* v, float* out, int g0, int full) {
  const int three = one_row_streams<3, T>(p, v, out, g0, full);
  return three + one_row_streams<2, T>(p, v, out, g0 + three, full - three);
}

#ifdef __AVX512BF16__
/* bf16 pairs through vdpbf16ps: v holds each row's inputs as bf16 pairs (one uint32 per pair). */
template <int R, int J>
inline void tile_dot(const uint16_t* __restrict w, int pairs, const uint32_t* __restrict v, long ldv, float* y,
                     long ldy, int valid, Prefetch pf, int width) {
  __m512 acc[R][J];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_ps();
  for (int c = 0; c < pairs; c++) {
    pf.step(c);
    __m512bh wv[J];
    for (int j = 0; j < J; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + ((long)c * width + j) * 2 * LANES_OUT);
    for (int r = 0; r < R; r++) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)v[r * ldv + c]);
      for (int j = 0; j < J; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xb);
    }
  }
  vfloat out[R][J];
  std::memcpy(out, acc, sizeof out);
  store<R, J>(out, y, ldy, valid);
}
#endif

/* A call's input rows as the tiles read them: float32 (ldf apart), and as bf16 pairs for the dot
 * product (ldp apart). */
struct Rows {
  const float* f;
  long ldf;
  const uint32_t* pairs;
  long ldp;
};

/* Where W[row, c] lies in the packed weight: groups of GROUP panels (the last group may hold
 * fewer), each group's panels interleaved feature by feature (by pairs for the dot product), so a
 * tile over a group reads one sequential stream. */
inline long packed_index(const FloatWeight& p, int row, int c) {
  const int np = (p.n + LANES_OUT - 1) / LANES_OUT, pn = row / LANES_OUT, g = pn / GROUP;
  const int width = std::min(GROUP, np - g * GROUP);  // panels in this group
  const long base = (long)g * GROUP * LANES_OUT * p.kp;
  const int j = pn - g * GROUP, lane = row % LANES_OUT;
  if (p.type == W_BF16 && BF16_DOT) return base + (((long)(c / 2) * width + j) * LANES_OUT + lane) * 2 + c % 2;
  if (p.type == W_BF16 && PAIRED_BF16 && j < width / 2 * 2) {
    // Panels j, j + 1 (j even) of feature c in 16 values: the first's lanes 0-3, the second's 0-3,
    // the first's 4-7, the second's 4-7 (the 128-bit halves the unpacks take their words from).
    const long at = base + ((long)c * width + j - j % 2) * LANES_OUT;
    return at + (lane & 3) + (lane >= 4 ? 8 : 0) + (j % 2 ? 4 : 0);
  }
  return base + ((long)c * width + j) * LANES_OUT + lane;
}

/* Rows [r, r + R) x panels j0 .. j0 + J - 1 of group g (`width` panels: J, or GROUP when a tile
 * takes part of a group), the weight's type chosen here. */
template <int R, int J>
inline void run(const FloatWeight& p, const Rows& in, int r, int g, float* out, Prefetch pf, int j0 = 0,
                int width = J) {
  const long n = p.n, group = (long)g * GROUP * LANES_OUT, first = group + j0 * LANES_OUT;
  // The group's packed weight, then panel j0 within each input feature's run (or pair's, for the
  // bf16 dot product).
  const long at = group * p.kp, panel = (long)j0 * LANES_OUT;
  const int valid = (int)std::min<long>(J * LANES_OUT, n - first);
  float* y = out + r * n + first;
  if (p.type == W_F32) {
    tile<R, J>(static_cast<const float*>(p.w) + at + panel, p.k, in.f + r * in.ldf, in.ldf, y, n, valid, pf, width);
    return;
  }
  if (p.type == W_FP8) {
    tile<R, J>(static_cast<const uint8_t*>(p.w) + at + panel, p.k, in.f + r * in.ldf, in.ldf, y, n, valid, pf,
               width);
    return;
  }
  const uint16_t* w = static_cast<const uint16_t*>(p.w) + at;
#ifdef __AVX512BF16__
  tile_dot<R, J>(w + 2 * panel, p.kp / 2, in.pairs + r * in.ldp, in.ldp, y, n, valid, pf, width);
#else
  // (under AVX2 the paired layout keeps panels j, j + 1 together: j0 is 0 here, WIDE_ROWS being TILE_ROWS)
  tile<R, J>(w + panel, p.k, in.f + r * in.ldf, in.ldf, y, n, valid, pf, width);
#endif
}

/* `rows` (1..R) rows from r: the tile of that many rows. */
template <int J, int R = TILE_ROWS>
inline void run_rows(int rows, const FloatWeight& p, const Rows& in, int r, int g, float* out, Prefetch pf,
                     int j0 = 0, int width = J) {
  if (rows == R)
    run<R, J>(p, in, r, g, out, pf, j0, width);
  else if constexpr (R > 1)
    run_rows<J, R - 1>(rows, p, in, r, g, out, pf, j0, width);
}

/* Bytes of group g's packed weight, and where it starts. */
inline long group_bytes(const FloatWeight& p, int g) {
  const int np = (p.n + LANES_OUT - 1) / LANES_OUT;
  return (long)std::min(GROUP, np - g * GROUP) * LANES_OUT * p.kp * element_size(p.type);
}

inline const char* group_start(const FloatWeight& p, int g) {
  return static_cast<const char*>(p.w) + (long)g * GROUP * LANES_OUT * p.kp * element_size(p.type);
}

/* What pass t of `passes` over a group fetches of the thread's next group `next` (-1: none) into L2,
 * spread over the pass's `steps` loop steps: an even share of it for each pass after the first,
 * which reads its own group from memory. */
inline Prefetch next_group_share(const FloatWeight& p, int next, int passes, int t, int steps) {
  if (t == 0 || next < 0 || passes < 2) return {};
  const int lines = (int)((group_bytes(p, next) + 63) / 64), share = (lines + passes - 2) / (passes - 1);
  const int first = std::min(lines, (t - 1) * share), count = std::min(share, lines - first);
  return Prefetch{group_start(p, next) + first * 64L, count, (count + steps - 1) / steps};
}

/* Group g (of `width` panels) for all m rows, TILE_ROWS at a time: the first pass reads the group
 * from memory, the next ones from L2 and meanwhile fetch group `next` (the thread's next one; -1:
 * none) into L2, a share per pass, so its first pass does not wait on memory. */
template <int J = GROUP>
inline void group_rows(int width, const FloatWeight& p, const Rows& in, int m, int g, int next, float* out) {
  if (width == J) {
    const int passes = (m + TILE_ROWS - 1) / TILE_ROWS, steps = p.type == W_BF16 && BF16_DOT ? p.kp / 2 : p.k;
    if constexpr (J == GROUP && WIDE_ROWS > TILE_ROWS) {
      if (m > TILE_ROWS && m <= WIDE_ROWS) {  // one pass of all rows, two panels at a time
        // (each half fetches half of the thread's next group into L2)
        run_rows<2, WIDE_ROWS>(m, p, in, 0, g, out, next_group_share(p, next, 3, 1, steps), 0, GROUP);
        run_rows<2, WIDE_ROWS>(m, p, in, 0, g, out, next_group_share(p, next, 3, 2, steps), 2, GROUP);
        return;
      }
    }
    // The passes split the rows evenly (8 rows: 4 + 4, not 7 + 1, whose second pass would read the
    // group again for one row).
    for (int r = 0, t = 0, rows = 0; r < m; r += rows, t++) {
      rows = (m - r + passes - t - 1) / (passes - t);
      run_rows<J>(rows, p, in, r, g, out, next_group_share(p, next, passes, t, steps));
    }
  } else if constexpr (J > 1) {
    group_rows<J - 1>(width, p, in, m, g, next, out);
  }
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define KVFLOW_AMX 1
/* AMX (Xeons since Sapphire Rapids): where the CPU has its bf16 tiles, bf16 weights in the
 * vdpbf16ps layout go through TDPBF16PS instead -- a B tile is 16 pairs of features x 16 output
 * channels, exactly one panel's 16 consecutive pairs, so the packed weight loads as it is (rows
 * GROUP panels apart). A 16 x 16 x 32 tile product is 16 cycles where vdpbf16ps takes 32
 * instructions for the same products, so batched decode and prefill are no longer bound by the
 * multiply-adds but by reading the weight. The sums are float32 as with vdpbf16ps (in a different
 * order within a pair of features), each output row from its own input row only. */

// Tiles 0-3: the accumulators of a row block x a group's panels; 4: the rows' inputs; 5, 6: weights.
// Every tile 16 rows of 64 bytes; a call's last row block is computed whole from padded input rows.
constexpr int AMX_ROWS = 16, AMX_PAIRS = 16;

inline void amx_configure() {
  TileConfig c;
  for (int t = 0; t < 7; t++) {
    c.colsb[t] = 64;
    c.rows[t] = AMX_ROWS;
  }
  _tile_loadconfig(&c);
}

/* One row block (16 input rows from a, lda bytes apart, as bf16 pairs) x the W panels of a group
 * (w: the group's packed weight) over `chunks` chunks of 16 pairs; the sums into tmp [16][W * 16]. */
template <int W>
inline void amx_block(const uint16_t* w, int chunks, const uint32_t* a, long lda, float* tmp, Prefetch pf) {
  constexpr long ldw = W * 2 * LANES_OUT * 2;  // bytes from one pair's panel row to the next
  _tile_zero(0);
  if constexpr (W > 1) _tile_zero(1);
  if constexpr (W > 2) _tile_zero(2);
  if constexpr (W > 3) _tile_zero(3);
  for (int c = 0; c < chunks; c++) {
    const uint16_t* b = w + (long)c * AMX_PAIRS * W * 2 * LANES_OUT;
    pf.step(c);
    _tile_loadd(4, a + c * AMX_PAIRS, lda);
    _tile_loadd(5, b, ldw);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (W > 1) {
      _tile_loadd(6, b + 2 * LANES_OUT, ldw);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (W > 2) {
      _tile_loadd(5, b + 4 * LANES_OUT, ldw);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (W > 3) {
      _tile_loadd(6, b + 6 * LANES_OUT, ldw);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  constexpr long ldt = W * LANES_OUT * 4;
  _tile_stored(0, tmp, ldt);
  if constexpr (W > 1) _tile_stored(1, tmp + LANES_OUT, ldt);
  if constexpr (W > 2) _tile_stored(2, tmp + 2 * LANES_OUT, ldt);
  if constexpr (W > 3) _tile_stored(3, tmp + 3 * LANES_OUT, ldt);
}

/* Groups [g0, g1) for all m rows (pairs: m rows rounded up to 16, ldp apart). A group's first row
 * block reads its weight from memory, the later ones from L2 -- and meanwhile fetch the next group
 * into L2, a share each, so memory stays busy while they compute (as group_rows does). */
inline void amx_groups(const FloatWeight& p, const uint32_t* pairs, long ldp, int m, int g0, int g1, float* out) {
  static_assert(LANES_OUT == 16 && GROUP == 4, "AMX tiles hold 16 channels; amx_block takes up to 4 panels");
  amx_configure();
  alignas(64) float tmp[AMX_ROWS * GROUP * LANES_OUT];
  const int np = (p.n + LANES_OUT - 1) / LANES_OUT, chunks = p.kp / 2 / AMX_PAIRS;
  for (int g = g0; g < g1; g++) {
    const int width = std::min(GROUP, np - g * GROUP);
    const long first = (long)g * GROUP * LANES_OUT;
    const int valid = (int)std::min<long>(width * LANES_OUT, p.n - first);
    const uint16_t* w = static_cast<const uint16_t*>(p.w) + first * p.kp;
    const int passes = (m + AMX_ROWS - 1) / AMX_ROWS;
    for (int r = 0, t = 0; r < m; r += AMX_ROWS, t++) {
      const uint32_t* a = pairs + r * ldp;
      const Prefetch pf = next_group_share(p, g + 1 < g1 ? g + 1 : -1, passes, t, chunks);
      switch (width) {
        case 4: amx_block<4>(w, chunks, a, ldp * 4, tmp, pf); break;
        case 3: amx_block<3>(w, chunks, a, ldp * 4, tmp, pf); break;
        case 2: amx_block<2>(w, chunks, a, ldp * 4, tmp, pf); break;
        default: amx_block<1>(w, chunks, a, ldp * 4, tmp, pf); break;
      }
      for (int i = 0; i < std::min(AMX_ROWS, m - r); i++)
        std::memcpy(out + (long)(r + i) * p.n + first, tmp + i * width * LANES_OUT, valid * sizeof(float));
    }
  }
  _tile_release();
}

inline bool use_amx(const FloatWeight& p) {
  return p.type == W_BF16 && p.kp % (2 * AMX_PAIRS) == 0 && amx_permitted();
}
#else
inline bool use_amx(const FloatWeight&) { return false; }
#endif

template <class T>
void pack(const T* src, const FloatWeight& p, T* dst) {
  const long total = (long)(p.n + LANES_OUT - 1) / LANES_OUT * LANES_OUT * p.kp;
  std::fill(dst, dst + total, T{});
  for (int row = 0; row < p.n; row++)
    for (int c = 0; c < p.k; c++) dst[packed_index(p, row, c)] = src[(long)row * p.k + c];
}

template <class T>
void unpack(const FloatWeight& p, T* dst) {
  const T* w = static_cast<const T*>(p.w);
  for (int row = 0; row < p.n; row++)
    for (int c = 0; c < p.k; c++) dst[(long)row * p.k + c] = w[packed_index(p, row, c)];
}

/* uint32 pairs from one input row to the next in the workspace: whole cache lines plus one, so a
 * tile's rows fall in different L1 sets (2^k-byte strides put them all in a few sets). */
inline long pair_stride(int kp) { return ((kp + 1) / 2 + 15) / 16 * 16 + 16; }

thread_local FloatWorkspace t_work;  // per calling thread (the engine's), reused across calls

}  // namespace

FloatWeight* float_pack(const void* w, int n, int k, int type) {
  const int kp = type == W_BF16 && BF16_DOT ? (k + 1) / 2 * 2 : k;
  const int np = (n + LANES_OUT - 1) / LANES_OUT;
  const size_t size = element_size(type);
  const size_t bytes = ((size_t)np * LANES_OUT * kp * size + 63) / 64 * 64;
  void* buf = alloc_weights(bytes);
  if (!buf) return nullptr;
  auto* p = new FloatWeight{buf, n, k, kp, type, bytes};
  if (type == W_BF16)
    pack(static_cast<const uint16_t*>(w), *p, static_cast<uint16_t*>(p->w));
  else if (type == W_FP8)
    pack(static_cast<const uint8_t*>(w), *p, static_cast<uint8_t*>(p->w));
  else
    pack(static_cast<const float*>(w), *p, static_cast<float*>(p->w));
  return p;
}

FloatWeight* float_pack_fp8(const uint8_t* w, int n, int k, const float* scale, int act) {
  FloatWeight* p = float_pack(w, n, k, W_FP8);
  if (!p) return nullptr;
  p->channel_scale = new float[n];
  for (int i = 0; i < n; i++) p->channel_scale[i] = scale[i] * 256.f;  // (widen_e4m3's 2^-8 back)
  p->act = act;
  return p;
}

void float_free(FloatWeight* p) {
  delete[] p->channel_scale;
  free_weights(p->w, p->bytes);
  delete p;
}

void FloatWorkspace::reserve(int m, int kp) {
  v.resize(std::max(v.size(), (size_t)m * kp));
  // (rows rounded up to whole AMX row blocks: their tiles load 16 rows; what the extra ones hold is
  // never stored)
  if (BF16_DOT) pairs.resize(std::max(pairs.size(), (size_t)(m + 15) / 16 * 16 * pair_stride(kp)));
}

void float_linear_team(const FloatWeight& p, const float* x, long ldx, int m, int kind, const float* norm_w,
                       float eps, const float* bias, const float* residual, long ld_res, float* out,
                       FloatWorkspace& w) {
  const int n = p.n, k = p.k;
  const bool dot = p.type == W_BF16 && BF16_DOT;
  Rows in{x, ldx, nullptr, 0};
  if (kind != NONE || dot || p.act != ACT_NONE) {
    float* rows = w.v.data();
    uint32_t* pairs = w.pairs.data();
    const int np = p.kp / 2;
    const long ldp = pair_stride(p.kp);
#pragma omp for schedule(static)
    for (int i = 0; i < m; i++) {
      const float* src = x + i * ldx;
      if (kind != NONE) {
        prologue(kind, src, k, norm_w, eps, rows + (long)i * k);
        src = rows + (long)i * k;
      }
      if (p.act == ACT_FP8_TOKEN) {
        // scale = max|x| / 448 (a zero row keeps scale 0 and stays zero), x -> e4m3(x / scale) * scale
        float* dst = rows + (long)i * k;
        float amax = 0.f;
        for (int c = 0; c < k; c++) amax = std::max(amax, std::fabs(src[c]));
        const float scale = amax / 448.f;
        for (int c = 0; c < k; c++) dst[c] = scale > 0.f ? round_e4m3(src[c] / scale) * scale : 0.f;
        src = dst;
      }
      if (dot)
        for (int c = 0; c < np; c++) {
          const uint32_t lo = f32_to_bf16(src[2 * c]), hi = 2 * c + 1 < k ? f32_to_bf16(src[2 * c + 1]) : 0u;
          pairs[i * ldp + c] = lo | hi << 16;
        }
    }
    const bool own = kind != NONE || p.act != ACT_NONE;  // rows rewritten into the workspace
    in = Rows{own ? rows : x, own ? (long)k : ldx, pairs, ldp};
  }
  const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
  // Contiguous ranges of panel groups, one per thread.
  const int np = (n + LANES_OUT - 1) / LANES_OUT, ng = (np + GROUP - 1) / GROUP, per = (ng + nth - 1) / nth;
  const int g0 = std::min(ng, tid * per), g1 = std::min(ng, g0 + per);
  int g = g0;
#ifdef KVFLOW_AMX
  if (dot && use_amx(p)) {
    amx_groups(p, in.pairs, in.ldp, m, g0, g1, out);
    g = g1;
  }
#endif
  if (m == 1 && (p.type != W_BF16 || !BF16_DOT)) {
    // One row: the thread's full groups three (then two) at a time, from separate parts of its range.
    const int full = std::max(0, std::min(g1, np / GROUP) - g0);
    g += p.type == W_F32   ? one_row<float>(p, in.f, out, g0, full)
         : p.type == W_FP8 ? one_row<uint8_t>(p, in.f, out, g0, full)
                           : one_row<uint16_t>(p, in.f, out, g0, full);
  }
  for (; g < g1; g++) group_rows(std::min(GROUP, np - g * GROUP), p, in, m, g, g + 1 < g1 ? g + 1 : -1, out);
  const int j0 = std::min(n, g0 * GROUP * LANES_OUT), j1 = std::min(n, g1 * GROUP * LANES_OUT);
  if (p.channel_scale)  // (before the bias and the residual)
    for (int i = 0; i < m; i++)
      for (int j = j0; j < j1; j++) out[(long)i * n + j] *= p.channel_scale[j];
  for (int i = 0; i < m; i++)  // (a scale of 1 leaves every sum as it is)
    epilogue(out + (long)i * n, j0, j1, 1.f, bias, residual ? residual + i * ld_res : nullptr);
#pragma omp barrier
}

void float_linear(const FloatWeight& p, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                  const float* bias, const float* residual, long ld_res, float* out, int num_threads) {
  if (m <= 0) return;
  // The calling thread's workspace, named before the region: inside it `t_work` is each thread's own.
  FloatWorkspace& work = t_work;
  work.reserve(m, p.kp);
#pragma omp parallel num_threads(num_threads)
  float_linear_team(p, x, ldx, m, kind, norm_w, eps, bias, residual, ld_res, out, work);
}

}  // namespace kvflow

extern "C" {

/* The weight w [n, k] (row-major; float32, or bfloat16 when type is 1) packed into the kernel's
 * layout (a copy); a handle. */
void* kvflow_float_pack(const void* w, int n, int k, int type) { return kvflow::float_pack(w, n, k, type); }

/* float8 e4m3 weights w [n, k] (bytes) with per-output-channel scales [n], packed; `act` 1 rounds
 * each input row to e4m3 per token first (ActQuant). A handle. */
void* kvflow_float_pack_fp8(const uint8_t* w, int n, int k, const float* scale, int act) {
  return kvflow::float_pack_fp8(w, n, k, scale, act);
}

void kvflow_float_free(void* handle) { kvflow::float_free(static_cast<kvflow::FloatWeight*>(handle)); }

/* The packed weight back, in its own type, [n, k]. */
void kvflow_float_unpack(void* handle, void* w) {
  const auto& p = *static_cast<kvflow::FloatWeight*>(handle);
  if (p.type == kvflow::W_BF16)
    kvflow::unpack(p, static_cast<uint16_t*>(w));
  else if (p.type == kvflow::W_FP8)
    kvflow::unpack(p, static_cast<uint8_t*>(w));
  else
    kvflow::unpack(p, static_cast<float*>(w));
}

/* 1 when bf16 weights meet bf16-rounded inputs (the CPU's bf16 dot product), 0 when float32 ones. */
int kvflow_float_bf16_dot(void) { return kvflow::BF16_DOT ? 1 : 0; }

/* 1 when those products run on AMX tiles (for in_features a multiple of 32), else 0. */
int kvflow_float_amx(void) {
#ifdef KVFLOW_AMX
  return kvflow::amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

/* out[m, n] = residual + W . pre(x) + bias (see the top of the file). x rows are ldx apart and hold
 * k values (2k for SILU_MUL: gate then up); residual (or null) rows are ld_res apart; out is dense. */
void kvflow_float_linear(void* handle, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                         const float* bias, const float* residual, long ld_res, float* out, int num_threads) {
  kvflow::float_linear(*static_cast<kvflow::FloatWeight*>(handle), x, ldx, m, kind, norm_w, eps, bias, residual,
                       ld_res, out, num_threads);
}

}  // extern "C"
