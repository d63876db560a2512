/* Linear over block-quantized weights, read in GGUF's own layout (kvflow/kernels/cpu/block_linear.py,
 * BlockQuantKernel): out = residual + W . pre(x) + bias, pre as in linear_ops.h.
 *
 * Formats (GGML's; a block covers QK consecutive inputs of one output channel):
 *   Q8_0  32 values:  fp16 d, int8 q[32]                    w = d * q
 *   Q4_0  32 values:  fp16 d, 4-bit q[32]                   w = d * (q - 8)
 *   Q4_1  32 values:  fp16 d, fp16 m, 4-bit q[32]           w = d * q + m
 *   Q4_K  256 values: fp16 d, dmin, 6-bit (scale, min) per 32, 4-bit q   w = d * sc * q - dmin * mn
 *   Q6_K  256 values: 6-bit q (low 4 + high 2 bits), int8 scale per 16, fp16 d   w = d * sc * (q - 32)
 * (4-bit blocks of 32 hold values 0-15 in the low nibbles, 16-31 in the high ones.)
 *
 * As llama.cpp does, the activations are quantized too, per block of 32 to int8 with one float
 * scale (x ~= dx * qx), so a block's dot product is an exact integer one, scaled once:
 *   sum_i w_i x_i ~= d_w * dx * sum_i q_i qx_i  +  m_w * dx * sum_i qx_i
 * On AVX2 the integer products are vpmaddubsw (u8 x s8 -> s16 pairs, which cannot saturate with
 * these ranges: 15 * 127 * 2 or 127 * 127 * 2 < 2^15) and vpmaddwd; with AVX-VNNI / AVX512-VNNI
 * one vpdpbusd into the accumulator, and Q8_0's repacked tile multiplies the activations as
 * unsigned bytes (x + 128) by the signed weights, less 128 x the block's weight sum. The library
 * is built with -march=native on the machine that runs it (kvflow/kernels/cpu/native.py), so the
 * path is the CPU's own. Without AVX2 `kvflow_block_pack` returns null and the caller dequantizes
 * instead.
 *
 * Q4_0, Q4_1 and Q8_0 are repacked once at load (same bits, same size) with X8 = 8 output channels
 * interleaved, 4 bytes of each in turn: per block of 32 inputs, the 8 channels' fp16 scales (and
 * offsets) as one 16-byte vector, then the values, so that one 32-byte load holds 4 inputs of 8
 * channels, one broadcast 4-byte activation group multiplies all of them, and the 8 int32 lanes of
 * the result are the 8 channels' sums: no horizontal reduction, and the scales of 8 channels
 * applied with one vector op per block. (GGUF's own row layout spends about as many instructions on
 * one channel's scales and reduction as on its products.) With AVX-512 (and VNNI) the tiles take
 * two neighbouring groups at once in 512-bit registers (x16_tile): every broadcast activation and
 * every float operation then serves 16 channels, the scaling per block and row being about a third
 * of the tile's instructions; the two groups' blocks then alternate in memory (x8_group), so that
 * a pair is read as one stream. Q4_K is repacked too, into Q4_1's tiles with its
 * super-block's scales unpacked beside them (+2.8% bytes: Q4K_X8_BYTES), and with VNNI Q6_K, at
 * its own size, into 8-channel tiles of its own (x8_tile_q6k).
 *
 * A (row, channel) pair's sum runs in the same order whatever the tile or the number of rows, so a
 * token's result does not depend on its batch.
 */
#include "block_linear.h"

#include "amx.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define KVFLOW_BLOCK_SIMD 1
#include <immintrin.h>
#endif
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define KVFLOW_VNNI 1  // vpdpbusd: u8 x s8 sums of 4 into int32, no saturation
#endif

namespace kvflow {

void BlockWorkspace::reserve(int m, int k, int num_threads) {
  q.resize(std::max(q.size(), (size_t)m * k));
  qu.resize(std::max(qu.size(), (size_t)m * k));
  d.resize(std::max(d.size(), (size_t)m * k / QA));
  s.resize(std::max(s.size(), (size_t)m * k / QA));
  v.resize(std::max(v.size(), (size_t)num_threads * k));
}

#ifdef KVFLOW_BLOCK_SIMD
namespace {

inline float f16(const uint8_t* p) { return _cvtsh_ss(*(const uint16_t*)p); }

#ifdef KVFLOW_VNNI
// acc + the 8 int32 sums of 4 products u x x each: one vpdpbusd into the accumulator.
inline __m256i dot_u8_acc(__m256i acc, __m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, x);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, x);
#endif
}
#endif

inline __m256i dot_u8(__m256i u, __m256i x) {  // 8 int32 sums of 4 products each: lanes 0-3 = values 0-15
#ifdef KVFLOW_VNNI
  return dot_u8_acc(_mm256_setzero_si256(), u, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

inline __m256i dot_s8(__m256i w, __m256i x) { return dot_u8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }

inline __m256i nibbles16(const uint8_t* p) {  // 16 bytes -> 32 values: low nibbles, then high ones
  const __m128i raw = _mm_loadu_si128((const __m128i*)p);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

/* One 32-value sub-block g of a block: its values (unsigned for formats with an offset, signed
 * otherwise), the scale of each int32 lane of dot_u8 / dot_s8, and the offset m (w = scale * q + m). */
template <int T>
struct Fmt;

template <>
struct Fmt<Q4_0> {
  static constexpr int QK = 32, BYTES = 18, SIGNED = 0;
  static inline __m256i sub(const uint8_t* b, int, __m256& sc, float& m) {
    const float d = f16(b);
    sc = _mm256_set1_ps(d);
    m = -8.f * d;
    return nibbles16(b + 2);
  }
};

template <>
struct Fmt<Q4_1> {
  static constexpr int QK = 32, BYTES = 20, SIGNED = 0;
  static inline __m256i sub(const uint8_t* b, int, __m256& sc, float& m) {
    sc = _mm256_set1_ps(f16(b));
    m = f16(b + 2);
    return nibbles16(b + 4);
  }
};

template <>
struct Fmt<Q8_0> {
  static constexpr int QK = 32, BYTES = 34, SIGNED = 1;
  static inline __m256i sub(const uint8_t* b, int, __m256& sc, float& m) {
    sc = _mm256_set1_ps(f16(b));
    m = 0.f;
    return _mm256_loadu_si256((const __m256i*)(b + 2));
  }
};

/* Sub-block g's 6-bit scale and min of a Q4_K block: 8 pairs in the 12 bytes at s (ggml's
 * get_scale_min_k4). */
inline void q4k_scale_min(const uint8_t* s, int g, int& scale, int& min) {
  if (g < 4) {
    scale = s[g] & 63;
    min = s[g + 4] & 63;
  } else {
    scale = (s[g + 4] & 0x0F) | ((s[g - 4] >> 6) << 4);
    min = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
  }
}

template <>
struct Fmt<Q4_K> {
  static constexpr int QK = 256, BYTES = 144, SIGNED = 0;
  static inline __m256i sub(const uint8_t* b, int g, __m256& sc, float& m) {
    int scale, min;
    q4k_scale_min(b + 4, g, scale, min);
    sc = _mm256_set1_ps(f16(b) * (float)scale);
    m = -f16(b + 2) * (float)min;
    // 64 values per 32 bytes: sub-block 2j in the low nibbles, 2j + 1 in the high ones.
    const __m256i q = _mm256_loadu_si256((const __m256i*)(b + 16 + 32 * (g / 2)));
    return _mm256_and_si256(g & 1 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
  }
};

template <>
struct Fmt<Q6_K> {
  static constexpr int QK = 256, BYTES = 210, SIGNED = 1;
  static inline __m256i sub(const uint8_t* b, int g, __m256& sc, float& m) {
    // Halves of 128 values; in half h, quarter t is low (t < 2) or high nibbles of ql[64h + 32(t & 1)..]
    // with bits 2t, 2t + 1 of qh[32h..] on top; an int8 scale per 16 values.
    const int h = g / 4, t = g % 4;
    const __m256i mask4 = _mm256_set1_epi8(0x0F), mask2 = _mm256_set1_epi8(0x03);
    __m256i lo = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32 * (t & 1)));
    lo = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(lo, 4) : lo, mask4);
    __m256i hi = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
    hi = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * t)), mask2);
    const int8_t* scales = (const int8_t*)(b + 192) + 8 * h + 2 * t;
    const float d = f16(b + 208);
    sc = _mm256_setr_ps(d * scales[0], d * scales[0], d * scales[0], d * scales[0], d * scales[1], d * scales[1],
                        d * scales[1], d * scales[1]);
    m = 0.f;
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
  }
};

/* f(std::integral_constant<int, T>) for the format `type`: the one switch over the formats.
 * False for a type the kernel does not know. */
template <class F>
inline bool with_format(int type, F&& f) {
  switch (type) {
    case Q4_0: f(std::integral_constant<int, Q4_0>{}); return true;
    case Q4_1: f(std::integral_constant<int, Q4_1>{}); return true;
    case Q8_0: f(std::integral_constant<int, Q8_0>{}); return true;
    case Q4_K: f(std::integral_constant<int, Q4_K>{}); return true;
    case Q6_K: f(std::integral_constant<int, Q6_K>{}); return true;
  }
  return false;
}

// The formats that have the repacked layout (below).
// (Q6_K's tile needs VNNI: without it, pairs of 6-bit products would overflow vpmaddubsw's int16 sums.)
constexpr bool has_x8(int type) {
#ifdef KVFLOW_VNNI
  if (type == Q6_K) return true;
#endif
  return type == Q4_0 || type == Q4_1 || type == Q8_0 || type == Q4_K;
}

inline float hsum(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // (0+4, 1+5, 2+6, 3+7)
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

struct Act {  // the quantized activations of a call
  const int8_t* q;
  const uint8_t* qu;  // q + 128
  const float *d, *s;
  int k, nb;  // values and 32-blocks per row
};

/* y[r * ldy + j] = W[j] . x[r] for R activation rows from r0 and J weight rows from w (rb bytes apart). */
template <int T, int R, int J>
inline void tile(const uint8_t* __restrict w, long rb, const Act& a, int r0, float* __restrict y, long ldy) {
  using F = Fmt<T>;
  constexpr int SUBS = F::QK / QA;
  __m256 acc[R][J];
  float off[R][J];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < J; j++) acc[r][j] = _mm256_setzero_ps(), off[r][j] = 0.f;
  const int blocks = a.k / F::QK;
  for (int blk = 0; blk < blocks; blk++) {
    for (int g = 0; g < SUBS; g++) {
      const int sb = blk * SUBS + g;
      for (int j = 0; j < J; j++) {
        __m256 sc;
        float m;
        const __m256i q = F::sub(w + j * rb + (long)blk * F::BYTES, g, sc, m);
        for (int r = 0; r < R; r++) {
          const long row = (long)(r0 + r);
          const __m256i xq = _mm256_loadu_si256((const __m256i*)(a.q + row * a.k + sb * QA));
          const __m256i dot = F::SIGNED ? dot_s8(q, xq) : dot_u8(q, xq);
          acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sc, _mm256_set1_ps(a.d[row * a.nb + sb])),
                                      acc[r][j]);
          if (!F::SIGNED) off[r][j] += m * a.s[row * a.nb + sb];
        }
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int j = 0; j < J; j++) y[r * ldy + j] = hsum(acc[r][j]) + off[r][j];
}


// ---- the repacked (X8) layout of Q4_0 / Q4_1 / Q8_0 ------------------------------------------------
// Per group of X8 channels and block of 32 inputs, `x8_block_bytes` bytes: fp16 d[8], (Q4_1: fp16
// m[8]), then the values. 4-bit: 4 chunks of 32 bytes; in chunk c, channel j's 4 bytes are its
// block's bytes 4c..4c+3, i.e. inputs 4c..4c+3 in the low nibbles and 16+4c.. in the high ones.
// 8-bit: 8 chunks; in chunk t, channel j's 4 bytes are inputs 4t..4t+3. A group's blocks follow
// each other (with AVX-512, alternating with those of its pair: x8_group), so a thread reads its
// channels as one stream.

//
// Q4_K's repacked group holds, per super-block of 256 inputs (Q4K_X8_BYTES): the X8 channels' fp16 d,
// then their fp16 dmin with the sign flipped, then the 6-bit scales and mins of the 8 sub-blocks
// unpacked to bytes ([sub-block][channel] each), then each sub-block's values as Q4_1's 4-bit
// chunks (GGUF keeps sub-blocks 2j and 2j + 1 in the low and high nibbles of the same 32 bytes;
// here a sub-block's 32 values are 16 bytes, value i and i + 16 in one byte, as Q4_1's are). A
// sub-block's weights are then Q4_1's, w = d' q + m', with d' = d * scale and m' = -dmin * min in
// float32 (exact: an fp16 times a 6-bit integer), and the Q4_1 tiles run it with those scales.
constexpr int Q4K_X8_BYTES = 16 + 16 + 64 + 64 + 8 * 128;
//
// Q6_K's, per super-block (Q6K_X8_BYTES, GGUF's size): the channels' fp16 d, their int8 scales (one
// per 16 values: [half block][channel]), then per sub-block of 32 values their low 4 bits as Q4_1's
// chunks and their top 2 bits in two 32-byte vectors (vector v holds chunks 2v and 2v + 1 in its
// low and high nibbles; in a nibble, bits 0-1 go with the chunk byte's low value, 2-3 with its high
// one). A value q (0..63) is w = d * scale * (q - 32).
constexpr int Q6K_X8_BYTES = 16 + 128 + 8 * (128 + 64);

// Bytes per X8 channels and 32 inputs (the K-quants: on average over their super-block).
constexpr int x8_block_bytes(int type) {
  return type == Q4_1   ? 160
         : type == Q4_0 ? 144
         : type == Q4_K ? Q4K_X8_BYTES / 8
         : type == Q6_K ? Q6K_X8_BYTES / 8
                        : 272;
}

// A group's unit: the bytes of X8 channels over one block of 32 inputs, or a K-quant's super-block.
constexpr int x8_unit_bytes(int type) {
  return type == Q4_K ? Q4K_X8_BYTES : type == Q6_K ? Q6K_X8_BYTES : x8_block_bytes(type);
}
constexpr int x8_units(int type, int nb) { return type == Q4_K || type == Q6_K ? nb / 8 : nb; }

// With AVX-512, x16_tile reads two neighbouring groups in step; the layout then interleaves each
// even group with the next one unit by unit, so that the pair is one forward stream. (Read as two
// streams a group apart, the pair's reads from memory added to its tiles' arithmetic instead of
// overlapping it: the prefetchers follow one stream. Figures: benchmarks/block_linear_ab.py in
// docs/benchmarks/results/.)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVFLOW_X16 1
#endif
constexpr bool x8_paired(int type) {
#ifdef KVFLOW_X16
  return type != Q6_K;
#else
  (void)type;
  return false;
#endif
}

/* Where group g's units lie in a repacked segment of `groups` groups: unit u at at + u * stride. */
struct Group {
  const uint8_t* at;
  long stride;
};

inline long x8_group_offset(int type, int groups, int nb, int g, long& stride) {
  const long unit = x8_unit_bytes(type), span = (long)x8_units(type, nb) * unit;
  if (x8_paired(type) && g < groups - groups % 2) {
    stride = 2 * unit;
    return (long)(g / 2) * 2 * span + (g % 2) * unit;
  }
  stride = unit;
  return (long)g * span;
}

inline Group x8_group(const BlockSegment& seg, int nb, int g) {
  long stride;
  const long off = x8_group_offset(seg.type, seg.rows / X8, nb, g, stride);
  return {seg.data + off, stride};
}

inline __m256 u8x8_ps(const uint8_t* p) {  // 8 bytes as 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

inline __m256 i8x8_ps(const uint8_t* p) {  // 8 signed bytes as 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

/* Block b (32 inputs) of a repacked group: its X8 channels' scales `d` and, for the formats with
 * one, offsets `mn` (w = d q + mn); returns where its values start. */
template <int T>
inline const uint8_t* x8_block(Group grp, int b, __m256& d, __m256& mn) {
  if constexpr (T == Q4_K) {
    const uint8_t* h = grp.at + (long)(b / 8) * grp.stride;
    const int sub = b % 8;
    d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h)), u8x8_ps(h + 32 + 8 * sub));
    mn = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + 16))), u8x8_ps(h + 96 + 8 * sub));
    return h + 160 + 128 * sub;
  } else {
    const uint8_t* p = grp.at + (long)b * grp.stride;
    d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    mn = T == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16))) : _mm256_setzero_ps();
    return p + (T == Q4_1 ? 32 : 16);
  }
}

constexpr bool has_offset(int type) { return type == Q4_1 || type == Q4_K; }

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

#ifdef KVFLOW_VNNI
/* x8_tile for Q6_K (its layout: Q6K_X8_BYTES): each block's two halves have their own scales, so
 * their integer sums stay apart. The values go in signed (q - 32) against the activations as u8
 * (x + 128), as Q8_0's tile does: sum (x + 128) w - 128 sum w, the same integers as sum x w, the
 * weights' sums taken once for all rows. */
template <int R>
inline void x8_tile_q6k(Group grp, const Act& a, int r0, float* __restrict y, long ldy) {
  __m256 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), bias = _mm256_set1_epi8(32),
                ones = _mm256_set1_epi8(1);
  for (int b = 0; b < a.nb; b++) {
    const uint8_t* h = grp.at + (long)(b / 8) * grp.stride;
    const int sub = b % 8;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h));
    const __m256 d_lo = _mm256_mul_ps(d, i8x8_ps(h + 16 + 16 * sub));
    const __m256 d_hi = _mm256_mul_ps(d, i8x8_ps(h + 16 + 16 * sub + 8));
    const uint8_t* qs = h + 144 + 192 * sub;
    const uint8_t* xu[R];
    for (int r = 0; r < R; r++) xu[r] = a.qu + (long)(r0 + r) * a.k + b * QA;
    __m256i lo_sum[R], hi_sum[R], lo_w = _mm256_setzero_si256(), hi_w = _mm256_setzero_si256();
    for (int r = 0; r < R; r++) lo_sum[r] = hi_sum[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
      const __m256i raw = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
      __m256i top = _mm256_loadu_si256((const __m256i*)(qs + 128 + 32 * (c / 2)));
      if (c & 1) top = _mm256_srli_epi16(top, 4);
      const __m256i lo = _mm256_sub_epi8(
          _mm256_or_si256(_mm256_and_si256(raw, m4), _mm256_slli_epi16(_mm256_and_si256(top, m2), 4)), bias);
      const __m256i hi = _mm256_sub_epi8(
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(top, 2), m2), 4)),
          bias);
      lo_w = dot_u8_acc(lo_w, ones, lo);
      hi_w = dot_u8_acc(hi_w, ones, hi);
      for (int r = 0; r < R; r++) {
        lo_sum[r] = dot_u8_acc(lo_sum[r], bcast4((const int8_t*)xu[r] + 4 * c), lo);
        hi_sum[r] = dot_u8_acc(hi_sum[r], bcast4((const int8_t*)xu[r] + 16 + 4 * c), hi);
      }
    }
    lo_w = _mm256_slli_epi32(lo_w, 7), hi_w = _mm256_slli_epi32(hi_w, 7);
    for (int r = 0; r < R; r++) {
      const __m256 dx = _mm256_set1_ps(a.d[(long)(r0 + r) * a.nb + b]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(lo_sum[r], lo_w)), _mm256_mul_ps(d_lo, dx), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(hi_sum[r], hi_w)), _mm256_mul_ps(d_hi, dx), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * ldy, acc[r]);
}
#endif

/* y[r * ldy + j] = W[j] . x[r0 + r] for the group's X8 channels j and R activation rows. */
template <int T, int R>
inline void x8_tile(Group grp, const Act& a, int r0, float* __restrict y, long ldy) {
#ifdef KVFLOW_VNNI
  if constexpr (T == Q6_K) return x8_tile_q6k<R>(grp, a, r0, y, ldy);
#endif
  __m256 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int b = 0; b < a.nb; b++) {
    __m256 d, mn;
    const uint8_t* qs = x8_block<T>(grp, b, d, mn);
    const int8_t* xb[R];
    for (int r = 0; r < R; r++) xb[r] = a.q + (long)(r0 + r) * a.k + b * QA;
    __m256i isum[R];
    for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
    if constexpr (T == Q8_0) {
#ifdef KVFLOW_VNNI
      // The activations as u8 (x + 128) against the signed weights: sum (x + 128) w - 128 sum w,
      // the same integers as sum x w without a sign fix-up per row.
      const uint8_t* xu[R];
      for (int r = 0; r < R; r++) xu[r] = a.qu + (long)(r0 + r) * a.k + b * QA;
      __m256i wsum = _mm256_setzero_si256();
      for (int t = 0; t < 8; t++) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(qs + 32 * t));
        wsum = dot_u8_acc(wsum, _mm256_set1_epi8(1), w);
        for (int r = 0; r < R; r++) isum[r] = dot_u8_acc(isum[r], bcast4((const int8_t*)xu[r] + 4 * t), w);
      }
      const __m256i offset = _mm256_slli_epi32(wsum, 7);
      for (int r = 0; r < R; r++) isum[r] = _mm256_sub_epi32(isum[r], offset);
#else
      for (int t = 0; t < 8; t++) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(qs + 32 * t));
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int r = 0; r < R; r++)
          isum[r] = _mm256_add_epi32(isum[r], dot_u8(aw, _mm256_sign_epi8(bcast4(xb[r] + 4 * t), w)));
      }
#endif
    } else {
      for (int c = 0; c < 4; c++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
        const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        for (int r = 0; r < R; r++) {
#ifdef KVFLOW_VNNI
          isum[r] = dot_u8_acc(isum[r], lo, bcast4(xb[r] + 4 * c));
          isum[r] = dot_u8_acc(isum[r], hi, bcast4(xb[r] + 16 + 4 * c));
#else
          // int16 sums of products: 8 per lane of at most 2 * 15 * 127 each, < 2^15
          isum[r] = _mm256_add_epi16(isum[r], _mm256_maddubs_epi16(lo, bcast4(xb[r] + 4 * c)));
          isum[r] = _mm256_add_epi16(isum[r], _mm256_maddubs_epi16(hi, bcast4(xb[r] + 16 + 4 * c)));
#endif
        }
      }
#ifndef KVFLOW_VNNI
      for (int r = 0; r < R; r++) isum[r] = _mm256_madd_epi16(isum[r], _mm256_set1_epi16(1));
#endif
    }
    for (int r = 0; r < R; r++) {
      const long row = (long)(r0 + r) * a.nb + b;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(a.d[row])), acc[r]);
      if constexpr (has_offset(T)) acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.s[row]), acc[r]);
      if constexpr (T == Q4_0) acc[r] = _mm256_fmadd_ps(d, _mm256_set1_ps(-8.f * a.s[row]), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

#ifdef KVFLOW_X16
inline __m512i join(const uint8_t* a, const uint8_t* b) {  // 32 bytes of each group, one register
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                            _mm256_loadu_si256((const __m256i*)b), 1);
}

inline __m512 join(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }

/* One block of a row into its 16 channels' sums: acc + the block's integer sums x (d x the row's
 * dx), + the offset terms (Q4_1 / Q4_K: mn x s; Q4_0: d x -8 s). x16_tile and the AMX tiles both
 * scale through here, so their rows are the same bits. */
template <int T>
inline __m512 scale_block(__m512 acc, __m512i isum, __m512 d, __m512 mn, float dx, float s) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc);
  if constexpr (has_offset(T)) acc = _mm512_fmadd_ps(mn, _mm512_set1_ps(s), acc);
  if constexpr (T == Q4_0) acc = _mm512_fmadd_ps(d, _mm512_set1_ps(-8.f * s), acc);
  return acc;
}

/* x8_tile over both groups of a pair at once (16 channels: the even group's 8, then the odd one's;
 * `pair` is where the even group starts, see x8_group), with AVX-512's
 * 16 lanes: each activation broadcast and each float operation serves twice the channels. Lane by
 * lane the same integer sums and float operations in the same order as x8_tile, so a channel's
 * result is the same bits whichever tile computed it. */
template <int T, int R>
inline void x16_tile(const uint8_t* __restrict pair, const Act& a, int r0, float* __restrict y, long ldy,
                     const uint8_t* fetch = nullptr) {
  constexpr long unit = x8_unit_bytes(T);  // (a constant stride: the compiler's to fold)
  const Group g0{pair, 2 * unit}, g1{pair + unit, 2 * unit};
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int b = 0; b < a.nb; b++) {
    if (fetch) {  // a pair's share for this block (see x8_segment), into L1 while this tile computes
      constexpr int share = 2 * x8_block_bytes(T);
      for (int at = 0; at < share; at += 64) _mm_prefetch((const char*)fetch + (long)b * share + at, _MM_HINT_T0);
    }
    __m256 d0, d1, mn0, mn1;
    const uint8_t* q0 = x8_block<T>(g0, b, d0, mn0);
    const uint8_t* q1 = x8_block<T>(g1, b, d1, mn1);
    const __m512 d = join(d0, d1);
    __m512i isum[R];
    for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
    if constexpr (T == Q8_0) {
      const uint8_t* xu[R];
      for (int r = 0; r < R; r++) xu[r] = a.qu + (long)(r0 + r) * a.k + b * QA;
      __m512i wsum = _mm512_setzero_si512();
      for (int t = 0; t < 8; t++) {
        const __m512i w = join(q0 + 32 * t, q1 + 32 * t);
        wsum = _mm512_dpbusd_epi32(wsum, _mm512_set1_epi8(1), w);
        for (int r = 0; r < R; r++) {
          int32_t v;
          __builtin_memcpy(&v, xu[r] + 4 * t, 4);
          isum[r] = _mm512_dpbusd_epi32(isum[r], _mm512_set1_epi32(v), w);
        }
      }
      const __m512i offset = _mm512_slli_epi32(wsum, 7);
      for (int r = 0; r < R; r++) isum[r] = _mm512_sub_epi32(isum[r], offset);
    } else {
      const int8_t* xb[R];
      for (int r = 0; r < R; r++) xb[r] = a.q + (long)(r0 + r) * a.k + b * QA;
      for (int c = 0; c < 4; c++) {
        const __m512i raw = join(q0 + 32 * c, q1 + 32 * c);
        const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        for (int r = 0; r < R; r++) {
          int32_t vl, vh;
          __builtin_memcpy(&vl, xb[r] + 4 * c, 4);
          __builtin_memcpy(&vh, xb[r] + 16 + 4 * c, 4);
          isum[r] = _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(vl));
          isum[r] = _mm512_dpbusd_epi32(isum[r], hi, _mm512_set1_epi32(vh));
        }
      }
    }
    const __m512 mn = join(mn0, mn1);
    for (int r = 0; r < R; r++) {
      const long row = (long)(r0 + r) * a.nb + b;
      acc[r] = scale_block<T>(acc[r], isum[r], d, mn, a.d[row], a.s[row]);
    }
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
#endif

// Rows per x8_tile: with AVX-512's 32 vector registers 8 rows' int and float sums stay in registers,
// so a group's unpacked weights serve twice the rows; AVX2's 16 hold 4.
#if defined(__AVX512VL__)
constexpr int X8_ROWS = 8;
#else
constexpr int X8_ROWS = 4;
#endif

/* The last `rows` (1 .. R) rows in one tile: one pass over the group's weights, which each pass
 * unpacks anew (5 rows -- a token verifying 4 drafts -- as 4 + 1 cost ~1.4x one tile of 5). */
template <int T, int R = X8_ROWS - 1>
inline void x8_rest(int rows, Group g, const Act& a, int r, float* y, long ldy) {
  if (rows == R)
    x8_tile<T, R>(g, a, r, y, ldy);
  else if constexpr (R > 1)
    x8_rest<T, R - 1>(rows, g, a, r, y, ldy);
}

#ifdef KVFLOW_X16
/* x8_rest for the two groups of a pair: one pass over the pair's stream (two one-group passes would
 * each read every line of it). */
template <int T, int R = X8_ROWS - 1>
inline void x16_rest(int rows, const uint8_t* pair, const Act& a, int r, float* y, long ldy, const uint8_t* fetch) {
  if (rows == R)
    x16_tile<T, R>(pair, a, r, y, ldy, fetch);
  else if constexpr (R > 1)
    x16_rest<T, R - 1>(rows, pair, a, r, y, ldy, fetch);
}
#endif

#ifdef KVFLOW_X16
constexpr int FETCH_AHEAD = 8;  // blocks of 32 inputs a pair's first tile fetches ahead (Q4_1: 8 x 320 bytes)
#endif

#if defined(KVFLOW_AMX_INT8) && defined(KVFLOW_X16)
#define KVFLOW_BLOCK_AMX 1
/* AMX-INT8 (Xeons since Sapphire Rapids): 16 rows at a time, a pair's block of 32 inputs is one
 * tile product -- C (16 rows x 16 channels, int32) = A (the rows' int8 activations of the block,
 * 16 x 32 bytes, read where they lie) . B (the block's 32 x 16 weights, 4 inputs of each channel
 * per 64-byte row: exactly a joined chunk of the paired layout, so staging B is x16_tile's own
 * unpacking, stored once per pair and call instead of redone per tile of rows). One instruction
 * replaces x16_tile's 8 vpdpbusd per row; each block's scaling stays x16_tile's (scale_block). The
 * integer sums are exact either way, so a row's result is the same bits on either path: it does
 * not depend on whether its call went on the tiles (tests/kernels/test_block_linear.py). A call's
 * last 8-15 rows (all of a call of 8-15: a batch of 8 decoding, or a few verifying drafts) are one
 * block of that many rows on tiles of their own; fewer than 8 take the vector tiles. */
constexpr int AMX_M = 16;
constexpr int AMX_MIN = 8;  // rows a block needs to go on the tiles (fewer: the vector tiles)
constexpr int AMX_STAGE = 10;  // 64-byte vectors staged per block: B's 8 rows, then d and mn

std::atomic<int> block_amx_enabled{1};  // kvflow_block_amx (tests and benchmarks turn it off)

inline bool block_amx_on() { return block_amx_enabled.load(std::memory_order_relaxed) && amx_permitted(); }

// Tile 0: the sums of a block of 16 rows; 1: its rows' activations; 2: the weights; 3, 4: the sums
// and activations of the call's last block of `last` (8-15) rows, if it has one.
inline void block_amx_configure(int last) {
  TileConfig cfg;
  cfg.rows[0] = AMX_M, cfg.colsb[0] = 64;
  cfg.rows[1] = AMX_M, cfg.colsb[1] = QA;
  cfg.rows[2] = QA / 4, cfg.colsb[2] = 64;
  if (last) {
    cfg.rows[3] = last, cfg.colsb[3] = 64;
    cfg.rows[4] = last, cfg.colsb[4] = QA;
  }
  _tile_loadconfig(&cfg);
}

/* The pair at `pair` for the tiles: per block, B (unpacked as x16_tile unpacks: the low nibbles of
 * chunks 0-3 are inputs 0-15, the high ones 16-31; Q8_0's 8 chunks as they are), then the 16
 * channels' scales and offsets as x16_tile joins them. */
template <int T>
inline void amx_stage(const uint8_t* pair, int nb, __m512i* st) {
  constexpr long unit = x8_unit_bytes(T);
  const Group g0{pair, 2 * unit}, g1{pair + unit, 2 * unit};
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int b = 0; b < nb; b++) {
    __m256 d0, d1, mn0, mn1;
    const uint8_t* q0 = x8_block<T>(g0, b, d0, mn0);
    const uint8_t* q1 = x8_block<T>(g1, b, d1, mn1);
    __m512i* u = st + (long)b * AMX_STAGE;
    if constexpr (T == Q8_0) {
      for (int t = 0; t < 8; t++) _mm512_store_si512(u + t, join(q0 + 32 * t, q1 + 32 * t));
    } else {
      for (int c = 0; c < 4; c++) {
        const __m512i raw = join(q0 + 32 * c, q1 + 32 * c);
        _mm512_store_si512(u + c, _mm512_and_si512(raw, m4));
        _mm512_store_si512(u + 4 + c, _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4));
      }
    }
    _mm512_store_si512(u + 8, _mm512_castps_si512(join(d0, d1)));
    _mm512_store_si512(u + 9, _mm512_castps_si512(join(mn0, mn1)));
  }
}

/* One block's int32 sums into `sums` (64 bytes a row): activations at `x` (rows lda apart) times the
 * staged weights `u`, on tiles 0 and 1 (16 rows) or, `Last`, 3 and 4. (The tile numbers are
 * literals: GCC's tile intrinsics paste them into the instruction's text.) */
template <int T, bool Last>
inline void amx_sums(const int8_t* x, long lda, const __m512i* u, int32_t* sums) {
  _tile_loadd(2, u, 64);
  if constexpr (Last) {
    _tile_zero(3);
    _tile_loadd(4, x, lda);
    if constexpr (T == Q8_0)
      _tile_dpbssd(3, 4, 2);  // signed weights
    else
      _tile_dpbsud(3, 4, 2);  // the 4-bit values, 0..15
    _tile_stored(3, sums, 64);
  } else {
    _tile_zero(0);
    _tile_loadd(1, x, lda);
    if constexpr (T == Q8_0)
      _tile_dpbssd(0, 1, 2);
    else
      _tile_dpbsud(0, 1, 2);
    _tile_stored(0, sums, 64);
  }
}

/* Rows r0 .. r0 + R - 1 x the staged pair's 16 channels into y (rows ldy apart): R = 16 on tiles 0
 * and 1, or the last block's R rows on tiles 3 and 4. */
template <int T, int R>
inline void amx_rows(const __m512i* st, const Act& a, int r0, float* __restrict y, long ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  alignas(64) int32_t sums[R][16];
  for (int b = 0; b < a.nb; b++) {
    const __m512i* u = st + (long)b * AMX_STAGE;
    amx_sums<T, R != AMX_M>(a.q + (long)r0 * a.k + b * QA, a.k, u, &sums[0][0]);
    const __m512 d = _mm512_castsi512_ps(_mm512_load_si512(u + 8)), mn = _mm512_castsi512_ps(_mm512_load_si512(u + 9));
    for (int r = 0; r < R; r++) {
      const long row = (long)(r0 + r) * a.nb + b;
      acc[r] = scale_block<T>(acc[r], _mm512_load_si512(sums[r]), d, mn, a.d[row], a.s[row]);
    }
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

/* The call's last block of `rows` (AMX_MIN .. AMX_M - 1) rows, on tiles 3 and 4. */
template <int T, int R = AMX_M - 1>
inline void amx_last(int rows, const __m512i* st, const Act& a, int r0, float* y, long ldy) {
  if (rows == R)
    amx_rows<T, R>(st, a, r0, y, ldy);
  else if constexpr (R > AMX_MIN)
    amx_last<T, R - 1>(rows, st, a, r0, y, ldy);
}

struct alignas(64) Line {
  uint8_t bytes[64];
};
thread_local std::vector<Line> t_amx_stage;  // a thread's staged pair (as __m512i: aligned lines)
#endif

template <int T>
void x8_segment(const BlockSegment& seg, const Act& a, int c0, int c1, int r0, int r1, float* y, long ldy) {
#ifdef KVFLOW_BLOCK_AMX
  const int last = (r1 - r0) % AMX_M >= AMX_MIN ? (r1 - r0) % AMX_M : 0;
  const bool amx = x8_paired(T) && r1 - r0 >= AMX_MIN && block_amx_on();
  if (amx) {
    block_amx_configure(last);
    t_amx_stage.resize((size_t)a.nb * AMX_STAGE);
  }
#endif
  for (int c = c0; c < c1; c += X8) {
    const int grp = c / X8;
    const Group g = x8_group(seg, a.nb, grp);
    int r = r0;
#ifdef KVFLOW_X16
    if (x8_paired(T) && grp % 2 == 0 && c + 2 * X8 <= c1) {  // both groups of a pair: 16 channels at once
#ifdef KVFLOW_BLOCK_AMX
      if (amx) {  // 16 rows at a time and a last 8-15 on the tiles, under 8 on the vector tiles (the pair in cache)
        __m512i* st = reinterpret_cast<__m512i*>(t_amx_stage.data());
        amx_stage<T>(g.at, a.nb, st);
        for (; r + AMX_M <= r1; r += AMX_M) amx_rows<T, AMX_M>(st, a, r, y + r * ldy + c, ldy);
        if (last) {
          amx_last<T>(last, st, a, r, y + r * ldy + c, ldy);
          r += last;
        }
        if (r < r1) x16_rest<T>(r1 - r, g.at, a, r, y + r * ldy + c, ldy, nullptr);
        c += X8;
        continue;
      }
#endif
      // The first tile streams the pair from memory, fetching its own stream FETCH_AHEAD blocks on
      // (into the next pair at its end: a segment's pairs are contiguous); with the hardware's
      // prefetch alone 8 rows' matmuls were slower (block_linear_ab.py; docs/benchmarks/results/). The
      // second tile fetches the next pair meanwhile (the memory would idle through the tiles that
      // find this pair in cache).
      const uint8_t* ahead = g.at + FETCH_AHEAD * 2 * x8_block_bytes(T);
      const uint8_t* next = c + 4 * X8 <= c1 ? x8_group(seg, a.nb, grp + 2).at : nullptr;
      auto fetch = [&](int row) { return row == r0 ? ahead : row == r0 + X8_ROWS ? next : nullptr; };
      for (; r + X8_ROWS <= r1; r += X8_ROWS) x16_tile<T, X8_ROWS>(g.at, a, r, y + r * ldy + c, ldy, fetch(r));
      if (r < r1) x16_rest<T>(r1 - r, g.at, a, r, y + r * ldy + c, ldy, fetch(r));
      c += X8;
      continue;
    }
#endif
    for (; r + X8_ROWS <= r1; r += X8_ROWS) x8_tile<T, X8_ROWS>(g, a, r, y + r * ldy + c, ldy);
    if (r < r1) x8_rest<T>(r1 - r, g, a, r, y + r * ldy + c, ldy);
  }
#ifdef KVFLOW_BLOCK_AMX
  if (amx) _tile_release();
#endif
}

/* A K-quant segment repacked: `fill(dst, j, src)` writes channel j's super-block `src` (GGUF's
 * `src_bytes`) into its group's super-block `dst` (x8_unit_bytes, zeroed first; where x8_group
 * puts it). */
template <class Fill>
void repack_super_blocks(BlockSegment& seg, int k, int src_bytes, Fill&& fill) {
  const int nsb = k / 256, groups = seg.rows / X8;
  seg.packed.assign((size_t)groups * nsb * x8_unit_bytes(seg.type), 0);
  for (int g = 0; g < groups; g++) {
    long stride;
    const long at = x8_group_offset(seg.type, groups, k / QA, g, stride);
    for (int sb = 0; sb < nsb; sb++)
      for (int j = 0; j < X8; j++)
        fill(seg.packed.data() + at + sb * stride, j, seg.data + (long)(g * X8 + j) * seg.row_bytes + (long)sb * src_bytes);
  }
  seg.data = seg.packed.data();
  seg.x8 = true;
}

/* Q4_K to its repacked layout (see Q4K_X8_BYTES). */
void repack_q4k_x8(BlockSegment& seg, int k) {
  repack_super_blocks(seg, k, 144, [](uint8_t* dst, int j, const uint8_t* src) {
    dst[2 * j] = src[0], dst[2 * j + 1] = src[1];
    dst[16 + 2 * j] = src[2], dst[16 + 2 * j + 1] = src[3] ^ 0x80;  // -dmin: the sign bit flipped
    for (int sub = 0; sub < 8; sub++) {
      int scale, min;
      q4k_scale_min(src + 4, sub, scale, min);
      dst[32 + 8 * sub + j] = (uint8_t)scale, dst[96 + 8 * sub + j] = (uint8_t)min;
      const uint8_t* pair = src + 16 + 32 * (sub / 2);  // sub-blocks 2i (low nibbles), 2i + 1 (high)
      uint8_t v[32];
      for (int i = 0; i < 32; i++) v[i] = sub & 1 ? pair[i] >> 4 : pair[i] & 0x0F;
      uint8_t* qs = dst + 160 + 128 * sub;
      for (int c = 0; c < 4; c++)
        for (int i = 0; i < 4; i++) qs[32 * c + 4 * j + i] = (uint8_t)(v[4 * c + i] | v[16 + 4 * c + i] << 4);
    }
  });
}

/* Q6_K to its repacked layout (see Q6K_X8_BYTES). */
void repack_q6k_x8(BlockSegment& seg, int k) {
  repack_super_blocks(seg, k, 210, [](uint8_t* dst, int j, const uint8_t* src) {
    dst[2 * j] = src[208], dst[2 * j + 1] = src[209];
    for (int sub = 0; sub < 8; sub++) {
      const int half = sub / 4, t = sub % 4;  // (GGUF's layout: Fmt<Q6_K>)
      const uint8_t* scales = src + 192 + 8 * half + 2 * t;
      dst[16 + 16 * sub + j] = scales[0], dst[16 + 16 * sub + 8 + j] = scales[1];
      uint8_t v[32];  // the sub-block's values, 0..63
      for (int i = 0; i < 32; i++) {
        const uint8_t low = src[64 * half + 32 * (t & 1) + i];
        v[i] = (uint8_t)((t >= 2 ? low >> 4 : low & 0x0F) | ((src[128 + 32 * half + i] >> (2 * t)) & 3) << 4);
      }
      uint8_t* qs = dst + 144 + 192 * sub;
      for (int c = 0; c < 4; c++)
        for (int i = 0; i < 4; i++) {
          const int pos = 4 * j + i, lo = v[4 * c + i], hi = v[16 + 4 * c + i];
          qs[32 * c + pos] = (uint8_t)((lo & 0x0F) | (hi & 0x0F) << 4);
          qs[128 + 32 * (c / 2) + pos] |= (uint8_t)(((lo >> 4) | (hi >> 4) << 2) << (4 * (c & 1)));
        }
    }
  });
}

template <int T>
void repack_x8(BlockSegment& seg, int k) {
  static_assert(has_x8(T) && T != Q4_K && T != Q6_K);
  constexpr int gb = x8_block_bytes(T), rb = Fmt<T>::BYTES, head = T == Q4_1 ? 4 : 2, qbytes = T == Q8_0 ? 32 : 16;
  const int nb = k / QA, groups = seg.rows / X8;
  seg.packed.assign((size_t)groups * nb * gb, 0);
  for (int g = 0; g < groups; g++) {
    long stride;
    const long at = x8_group_offset(T, groups, nb, g, stride);
    for (int b = 0; b < nb; b++) {
      uint8_t* dst = seg.packed.data() + at + b * stride;
      uint8_t* qs = dst + (T == Q4_1 ? 32 : 16);
      for (int j = 0; j < X8; j++) {
        const uint8_t* src = seg.data + (long)(g * X8 + j) * seg.row_bytes + (long)b * rb;
        dst[2 * j] = src[0], dst[2 * j + 1] = src[1];
        if (T == Q4_1) dst[16 + 2 * j] = src[2], dst[16 + 2 * j + 1] = src[3];
        for (int c = 0; c < qbytes / 4; c++)
          for (int i = 0; i < 4; i++) qs[32 * c + 4 * j + i] = src[head + 4 * c + i];
      }
    }
  }
  seg.data = seg.packed.data();
  seg.x8 = true;
}

/* Channel `j` of the segment as float32 (k values), from whichever layout it holds. */
void dequantize_channel(const BlockSegment& seg, int j, int k, float* out) {
  if (seg.x8) {
    const int nb = k / QA, jj = j % X8;
    const Group grp = x8_group(seg, nb, j / X8);
    for (int b = 0; b < nb; b++) {
      float d = 0.f, m = 0.f;
      const uint8_t* qs = nullptr;
      if (seg.type == Q6_K) {  // (the same float32 products as the row layout's)
        const uint8_t* h = grp.at + (long)(b / 8) * grp.stride;
        const int sub = b % 8;
        qs = h + 144 + 192 * sub;
        for (int i = 0; i < QA; i++) {
          const int c = (i % 16) / 4, pos = 4 * jj + i % 4, byte = qs[32 * c + pos];
          const int top = (qs[128 + 32 * (c / 2) + pos] >> (4 * (c & 1) + (i < 16 ? 0 : 2))) & 3;
          const int q = (i < 16 ? byte & 0x0F : byte >> 4) | top << 4;
          const float scale = f16(h + 2 * jj) * (float)(int8_t)h[16 + 16 * sub + 8 * (i / 16) + jj];
          out[b * QA + i] = scale * (float)(q - 32);
        }
        continue;
      }
      with_format(seg.type, [&](auto t) {  // the block's scales as the tiles take them
        constexpr int T = decltype(t)::value;
        if constexpr (has_x8(T) && T != Q6_K) {
          __m256 dv, mv;
          qs = x8_block<T>(grp, b, dv, mv);
          alignas(32) float dl[8], ml[8];
          _mm256_store_ps(dl, dv), _mm256_store_ps(ml, mv);
          d = dl[jj], m = ml[jj];
        }
      });
      for (int i = 0; i < QA; i++) {
        float v;
        if (seg.type == Q8_0) {
          v = d * (float)(int8_t)qs[32 * (i / 4) + 4 * jj + i % 4];
        } else {
          const int byte = qs[32 * ((i % 16) / 4) + 4 * jj + i % 4], q = i < 16 ? byte & 0x0F : byte >> 4;
          v = seg.type == Q4_0 ? d * (float)(q - 8) : d * (float)q + m;
        }
        out[b * QA + i] = v;
      }
    }
    return;
  }
  // GGUF's row layout: through the kernel's own unpacking of each 32-value sub-block.
  const uint8_t* row = seg.data + (long)j * seg.row_bytes;
  for (int sb = 0; sb < k / QA; sb++) {
    with_format(seg.type, [&](auto t) {
      using F = Fmt<decltype(t)::value>;
      constexpr int SUBS = F::QK / QA;
      __m256 sc;
      float m;
      alignas(32) int8_t qv[32];
      alignas(32) float scale[8];
      _mm256_store_si256((__m256i*)qv, F::sub(row + (long)(sb / SUBS) * F::BYTES, sb % SUBS, sc, m));
      _mm256_store_ps(scale, sc);
      for (int i = 0; i < QA; i++) {
        const int v = F::SIGNED ? (int)qv[i] : (int)(uint8_t)qv[i];
        out[sb * QA + i] = scale[i / 4] * (float)v + m;
      }
    });
  }
}

// Rows of activations per pass over a thread's weight rows: their int8 values stay in L2 while the
// weights stream through (64 x 4k values = 256 KiB at most for this model family's widths).
constexpr int ROW_CHUNK = 64;

/* Channels [c0, c1) of the segment (local indices) for rows [r0, r1) into y (row stride ldy,
 * column 0 = the segment's channel 0). */
template <int T>
void segment(const BlockSegment& seg, const Act& a, int c0, int c1, int r0, int r1, float* y, long ldy) {
  const long rb = seg.row_bytes;
  int c = c0;
  for (; c + 4 <= c1; c += 4) {
    const uint8_t* w = seg.data + c * rb;
    int r = r0;
    for (; r + 2 <= r1; r += 2) tile<T, 2, 4>(w, rb, a, r, y + r * ldy + c, ldy);
    if (r < r1) tile<T, 1, 4>(w, rb, a, r, y + r * ldy + c, ldy);
  }
  for (; c < c1; c++) {
    const uint8_t* w = seg.data + c * rb;
    int r = r0;
    for (; r + 2 <= r1; r += 2) tile<T, 2, 1>(w, rb, a, r, y + r * ldy + c, ldy);
    if (r < r1) tile<T, 1, 1>(w, rb, a, r, y + r * ldy + c, ldy);
  }
}

void segment_any(const BlockSegment& seg, const Act& a, int c0, int c1, int r0, int r1, float* y, long ldy) {
  with_format(seg.type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    if constexpr (has_x8(T)) {
      if (seg.x8) return x8_segment<T>(seg, a, c0, c1, r0, r1, y, ldy);
    }
    segment<T>(seg, a, c0, c1, r0, r1, y, ldy);
  });
}

/* One row to int8 blocks of QA: dx = max|v| / 127, q = round(v / dx) (to nearest, ties to even: the
 * default rounding of vcvtps2dq, as nearbyint), s = dx * sum(q). Vectorised a block at a time: a
 * scalar loop here cost as much as a 576 x 576 product's tiles at 32 rows. */
inline void quantize_row(const float* __restrict v, int k, int8_t* __restrict q, uint8_t* __restrict qu,
                         float* __restrict d, float* __restrict s) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), flip = _mm256_set1_epi8((char)0x80);
  for (int b = 0; b < k / QA; b++) {
    const float* x = v + b * QA;
    __m256 xv[4];
    for (int i = 0; i < 4; i++) xv[i] = _mm256_loadu_ps(x + 8 * i);
    const __m256 m01 = _mm256_max_ps(_mm256_and_ps(xv[0], abs_mask), _mm256_and_ps(xv[1], abs_mask));
    const __m256 m23 = _mm256_max_ps(_mm256_and_ps(xv[2], abs_mask), _mm256_and_ps(xv[3], abs_mask));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(_mm256_max_ps(m01, m23)), _mm256_extractf128_ps(_mm256_max_ps(m01, m23), 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
    const float dx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    __m256i qi[4];
    for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(xv[i], _mm256_set1_ps(inv)));
    // |q| <= 127: the saturating packs are exact; they interleave 4-value runs, `order` undoes it.
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    const __m256i bytes = _mm256_permutevar8x32_epi32(packed, order);
    _mm256_storeu_si256((__m256i*)(q + b * QA), bytes);
    _mm256_storeu_si256((__m256i*)(qu + b * QA), _mm256_xor_si256(bytes, flip));
    const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    d[b] = dx;
    s[b] = dx * (float)_mm_cvtsi128_si32(t);
  }
}

thread_local BlockWorkspace t_work;

}  // namespace

void block_linear_team(const BlockWeight& p, const float* x, long ldx, int m, int kind, const float* norm_w,
                       float eps, const float* bias, const float* residual, long ld_res, float* out,
                       BlockWorkspace& w) {
  const int n = p.n, k = p.k, nb = k / QA;
  const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#pragma omp for schedule(static)
  for (int i = 0; i < m; i++) {
    float* v = w.v.data() + (long)tid * k;
    prologue(kind, x + i * ldx, k, norm_w, eps, v);
    quantize_row(v, k, w.q.data() + (long)i * k, w.qu.data() + (long)i * k, w.d.data() + (long)i * nb,
                 w.s.data() + (long)i * nb);
  }
  const Act a{w.q.data(), w.qu.data(), w.d.data(), w.s.data(), k, nb};
  // Each thread takes a contiguous run of output channels, in groups of X8 (the repacked layout's).
  // (A run that starts or ends inside a pair of the paired layout takes that group alone.)
  const int groups = (n + X8 - 1) / X8, per = (groups + nth - 1) / nth;
  const int j0 = std::min(n, tid * per * X8), j1 = std::min(n, j0 + per * X8);
  for (int r0 = 0; r0 < m; r0 += ROW_CHUNK) {
    const int r1 = std::min(m, r0 + ROW_CHUNK);
    int base = 0;
    for (const BlockSegment& seg : p.segs) {
      const int c0 = std::max(j0, base), c1 = std::min(j1, base + seg.rows);
      if (c0 < c1) segment_any(seg, a, c0 - base, c1 - base, r0, r1, out + base, n);
      base += seg.rows;
    }
    for (int r = r0; r < r1; r++)
      for (int j = j0; j < j1; j++) {
        float o = out[(long)r * n + j];
        if (bias) o += bias[j];
        if (residual) o = residual[(long)r * ld_res + j] + o;
        out[(long)r * n + j] = o;
      }
  }
#pragma omp barrier
}

void block_linear(const BlockWeight& p, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                  const float* bias, const float* residual, long ld_res, float* out, int num_threads) {
  if (m <= 0) return;
  BlockWorkspace& work = t_work;  // the calling thread's, named before the region (see int8_linear.cpp)
  work.reserve(m, p.k, num_threads);
#pragma omp parallel num_threads(num_threads)
  block_linear_team(p, x, ldx, m, kind, norm_w, eps, bias, residual, ld_res, out, work);
}

#else  // no AVX2: kvflow_block_pack refuses, so these are never reached

void block_linear_team(const BlockWeight&, const float*, long, int, int, const float*, float, const float*,
                       const float*, long, float*, BlockWorkspace&) {}
void block_linear(const BlockWeight&, const float*, long, int, int, const float*, float, const float*, const float*,
                  long, float*, int) {}

#endif

}  // namespace kvflow

extern "C" {

/* A weight [n, k] of `nseg` segments: segment i has `rows[i]` output channels of format
 * `types[i]`, `row_bytes[i]` bytes each, at `data[i]` (kept alive by the caller). Returns a handle,
 * or null when this CPU has no kernel (no AVX2) or a format is unknown or k does not fit its blocks. */
void* kvflow_block_pack(int n, int k, int nseg, const int* types, const int* rows, const long* row_bytes,
                        const uint8_t* const* data) {
#ifdef KVFLOW_BLOCK_SIMD
  auto* p = new kvflow::BlockWeight{n, k, {}};
  int total = 0;
  for (int i = 0; i < nseg; i++) {
    p->segs.push_back({types[i], rows[i], row_bytes[i], data[i], false, {}});
    kvflow::BlockSegment& seg = p->segs.back();
    bool fits = false;
    const bool known = kvflow::with_format(types[i], [&](auto t) {
      constexpr int T = decltype(t)::value;
      fits = k % kvflow::Fmt<T>::QK == 0;
      if constexpr (kvflow::has_x8(T)) {
        if (fits && rows[i] % kvflow::X8 == 0 && total % kvflow::X8 == 0) {
          if constexpr (T == kvflow::Q4_K)
            kvflow::repack_q4k_x8(seg, k);
          else if constexpr (T == kvflow::Q6_K)
            kvflow::repack_q6k_x8(seg, k);
          else
            kvflow::repack_x8<T>(seg, k);
        }
      }
    });
    if (!known || !fits) {
      delete p;
      return nullptr;
    }
    total += rows[i];
  }
  if (total != n) {
    delete p;
    return nullptr;
  }
  return p;
#else
  (void)n, (void)k, (void)nseg, (void)types, (void)rows, (void)row_bytes, (void)data;
  return nullptr;
#endif
}

void kvflow_block_free(void* handle) { delete static_cast<kvflow::BlockWeight*>(handle); }

/* The weight's bytes as the kernel reads them (repacked segments: its own copies). */
long kvflow_block_nbytes(void* handle) {
  long total = 0;
  for (const auto& seg : static_cast<kvflow::BlockWeight*>(handle)->segs)
    total += seg.x8 ? (long)seg.packed.size() : seg.rows * seg.row_bytes;
  return total;
}

/* The rows one pass over the weight computes together (its register tile; 0: no kernel here): a
 * call of more rows reads every weight once more per further tile, which a step's cost shows
 * (kvflow.core.step_cost). */
int kvflow_block_tile_rows(void* handle) {
#ifdef KVFLOW_BLOCK_SIMD
  for (const auto& seg : static_cast<kvflow::BlockWeight*>(handle)->segs)
    if (!seg.x8) return 2;  // the row layout's tiles (segment<T>)
  return kvflow::X8_ROWS;
#else
  (void)handle;
  return 0;
#endif
}

/* Whether the AMX-INT8 path runs here for calls of 8 rows and more (1) or not (0); enable 0 or 1 first turns
 * it off or on (tests and benchmarks compare the two paths; -1 only asks). */
int kvflow_block_amx(int enable) {
#ifdef KVFLOW_BLOCK_AMX
  if (enable >= 0) kvflow::block_amx_enabled.store(enable ? 1 : 0);
  return kvflow::block_amx_on() ? 1 : 0;
#else
  (void)enable;
  return 0;
#endif
}

/* Whether segment i was repacked (the kernel holds its own copy; the caller's bytes may go). */
int kvflow_block_repacked(void* handle, int i) { return static_cast<kvflow::BlockWeight*>(handle)->segs[i].x8; }

/* out[i, :] = output channel ids[i] of W as float32 (an embedding lookup, tests). */
void kvflow_block_rows(void* handle, const int64_t* ids, int count, float* out) {
#ifdef KVFLOW_BLOCK_SIMD
  const auto& p = *static_cast<kvflow::BlockWeight*>(handle);
  for (int i = 0; i < count; i++) {
    int j = (int)ids[i];
    for (const auto& seg : p.segs) {
      if (j < seg.rows) {
        kvflow::dequantize_channel(seg, j, p.k, out + (long)i * p.k);
        break;
      }
      j -= seg.rows;
    }
  }
#else
  (void)handle, (void)ids, (void)count, (void)out;
#endif
}

/* out[m, n] = residual + W . pre(x) + bias: the signature of kvflow_int8_linear. */
void kvflow_block_linear(void* handle, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                         const float* bias, const float* residual, long ld_res, float* out, int num_threads) {
  kvflow::block_linear(*static_cast<kvflow::BlockWeight*>(handle), x, ldx, m, kind, norm_w, eps, bias, residual,
                       ld_res, out, num_threads);
}

}  // extern "C"
