/* Attention kernels shared by the attention library (paged_attention.cpp) and the decode pass
 * (decode_pass.cpp): static inline, compiled into each, so both compute bit for bit the same.
 * See paged_attention.cpp for the cache layout. C++17.
 */
#ifndef KVFLOW_ATTENTION_H
#define KVFLOW_ATTENTION_H

#define restrict __restrict__

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include <algorithm>
#include <utility>

#include "simd.h"

using kvflow::bf16_to_f32;
using kvflow::f32_to_bf16;
using kvflow::VEC;
using kvflow::vfloat;

#define MAX_HEAD_DIM 256
#define MAX_GROUP 32
#define CHUNK 32 /* keys scored per online-softmax update */
#define MAX_SWEEP_HEADS 8 /* kv heads a row task sweeps together (attend_fixed) */
#define KEY_SEGMENT 512 /* keys per softmax segment of the fixed-shape path (attend_fixed) */
#define KEY_CHUNK 32 /* keys per online-softmax update of the fixed-shape path, at most (see attend_fixed) */
#define PARALLEL_MIN 65536 /* elements below which rotary / cache writes stay on one thread */
#define MIN_KV_SCALE 1e-12f /* as kvflow.quantization.int8: an all-zero vector quantizes to zeros */

/* Element types of a KV cache (`fmt` below; kvflow.kernels.cpu.paged_attention.KV_FORMATS). The
 * quantized ones (int8, fp8 e4m3 / e5m2, int4) keep one float32 scale per (token, K/V, kv head):
 * amax / the format's largest magnitude (kvflow/attention/kv_formats.py). int4 packs two values a
 * byte (q + 8 in a nibble, even elements in the low nibble), so its rows are head_dim / 2 bytes. */
enum { KV_F32 = 0, KV_INT8 = 1, KV_BF16 = 2, KV_FP8_E4M3 = 3, KV_FP8_E5M2 = 4, KV_INT4 = 5 };

/* fp8 with E exponent bits, M mantissa bits and exponent bias B (e4m3fn: 4, 3, 7; e5m2: 5, 2, 15).
 * Encoding: round to nearest even (torch's .to(float8_*)), |x| <= the format's max (callers clamp). */
template <int M, int B>
static inline uint8_t f32_to_fp8(float x) {
    const uint8_t sign = x < 0.f ? 0x80 : 0;
    const float a = fabsf(x);
    uint32_t bits;
    memcpy(&bits, &a, 4);
    /* a's unbiased exponent from its bits (frexpf leaves it unset for 0 under -ffast-math); a
     * float32 zero or subnormal reads as -127, clamped just below */
    int ue = (int)(bits >> 23) - 127;
    if (ue < 1 - B) ue = 1 - B;  /* subnormals: the smallest normal exponent's step */
    float q = nearbyintf(ldexpf(a, M - ue)); /* the mantissa with its implicit bit, in units of the step */
    if (ue == 1 - B && q < (float)(1 << M)) return sign | (uint8_t)q; /* subnormal (or zero) */
    if (q >= (float)(2 << M)) { /* rounded up into the next binade */
        q = (float)(1 << M);
        ue++;
    }
    return sign | (uint8_t)((ue + B) << M) | (uint8_t)((int)q - (1 << M));
}

template <int M, int B>
static inline float fp8_to_f32(uint8_t c) {
    const int mag = c & 0x7F, ex = mag >> M, man = mag & ((1 << M) - 1);
    const float a = ex == 0 ? ldexpf((float)man, 1 - B - M) : ldexpf((float)((1 << M) + man), ex - B - M);
    return c & 0x80 ? -a : a;
}

/* fp8 code -> float, 256 entries per format, filled once. */
struct Fp8Tables {
    float e4m3[256], e5m2[256];
    Fp8Tables() {
        for (int c = 0; c < 256; c++) {
            e4m3[c] = fp8_to_f32<3, 7>((uint8_t)c);
            e5m2[c] = fp8_to_f32<2, 15>((uint8_t)c);
        }
    }
};

static inline const float *fp8_table(int fmt) {
    static const Fp8Tables tables;
    return fmt == KV_FP8_E4M3 ? tables.e4m3 : tables.e5m2;
}

/* The largest magnitude of a quantized format's codes (the scale is amax / it). */
static inline float kv_qmax(int fmt) {
    return fmt == KV_INT8 ? 127.f : fmt == KV_FP8_E4M3 ? 448.f : fmt == KV_FP8_E5M2 ? 57344.f : 7.f;
}

/* One head's row of a quantized cache (fmt KV_FP8_* or KV_INT4; `base`: its first value's index as
 * if one value were one byte) widened to floats, the scale not applied. */
static inline void widen_codes(int fmt, const void *kv, long base, int head_dim, const float *restrict lut,
                               float *restrict dst) {
    if (fmt == KV_INT4) {
        const uint8_t *p = (const uint8_t *)kv + base / 2;
        for (int d = 0; d < head_dim / 2; d++) {
            dst[2 * d] = (float)((int)(p[d] & 0xF) - 8);
            dst[2 * d + 1] = (float)((int)(p[d] >> 4) - 8);
        }
        return;
    }
    const uint8_t *p = (const uint8_t *)kv + base;
    for (int d = 0; d < head_dim; d++) dst[d] = lut[p[d]];
}


/* Rotary in place on `heads` contiguous head vectors, rotate-half layout:
 * x = x * cos + roll(x, D/2) * sin_signed (sin_signed: sin with its first half negated). */
static inline void rotary_heads(float *x, int heads, int head_dim, const float *restrict c,
                                const float *restrict s) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; h++) {
        float *restrict v = x + (long)h * head_dim;
        float lo[MAX_HEAD_DIM / 2], hi[MAX_HEAD_DIM / 2];
        for (int d = 0; d < half; d++) {
            lo[d] = v[d];
            hi[d] = v[half + d];
        }
        for (int d = 0; d < half; d++) {
            v[d] = lo[d] * c[d] + hi[d] * s[d];
            v[half + d] = hi[d] * c[half + d] + lo[d] * s[half + d];
        }
    }
}

/* One token's new k and v (kv: 2 * kv_heads * head_dim floats, k heads then v heads) into cache slot
 * `slot`; quantized caches get one scale per (k/v, head): max|x| / qmax (int8 127, fp8 e4m3 448,
 * e5m2 57344, int4 7); bf16 ones are rounded to nearest. */
static inline void write_kv(const float *restrict kv, long slot, void *cache, float *scales, int fmt,
                            int kv_heads, int head_dim) {
    const long n = 2L * kv_heads * head_dim;
    if (fmt == KV_F32) {
        float *restrict dst = (float *)cache + slot * n;
        for (long i = 0; i < n; i++) dst[i] = kv[i];
        return;
    }
    if (fmt == KV_BF16) {
        uint16_t *restrict dst = (uint16_t *)cache + slot * n;
        for (long i = 0; i < n; i++) dst[i] = f32_to_bf16(kv[i]);
        return;
    }
    if (fmt == KV_INT8) {
        int8_t *restrict dst = (int8_t *)cache + slot * n;
        for (int v = 0; v < 2 * kv_heads; v++) {
            const float *restrict x = kv + (long)v * head_dim;
            float mx = 0.f;
            for (int d = 0; d < head_dim; d++) mx = fmaxf(mx, fabsf(x[d]));
            const float sc = fmaxf(mx * (1.f / 127.f), MIN_KV_SCALE);
            scales[slot * 2 * kv_heads + v] = sc;
            for (int d = 0; d < head_dim; d++) dst[(long)v * head_dim + d] = (int8_t)nearbyintf(x[d] / sc);
        }
        return;
    }
    const float qmax = kv_qmax(fmt);
    for (int v = 0; v < 2 * kv_heads; v++) {
        const float *restrict x = kv + (long)v * head_dim;
        float mx = 0.f;
        for (int d = 0; d < head_dim; d++) mx = fmaxf(mx, fabsf(x[d]));
        const float sc = fmaxf(mx * (1.f / qmax), MIN_KV_SCALE);
        scales[slot * 2 * kv_heads + v] = sc;
        if (fmt == KV_INT4) {
            uint8_t *restrict dst = (uint8_t *)cache + (slot * n + (long)v * head_dim) / 2;
            for (int d = 0; d < head_dim / 2; d++) {
                const int lo = (int)fminf(fmaxf(nearbyintf(x[2 * d] / sc), -7.f), 7.f) + 8;
                const int hi = (int)fminf(fmaxf(nearbyintf(x[2 * d + 1] / sc), -7.f), 7.f) + 8;
                dst[d] = (uint8_t)(lo | (hi << 4));
            }
        } else {
            uint8_t *restrict dst = (uint8_t *)cache + slot * n + (long)v * head_dim;
            for (int d = 0; d < head_dim; d++) {
                const float y = fminf(fmaxf(x[d] / sc, -qmax), qmax);
                dst[d] = fmt == KV_FP8_E4M3 ? f32_to_fp8<3, 7>(y) : f32_to_fp8<2, 15>(y);
            }
        }
    }
}

static inline float dot_f32(const float *restrict a, const float *restrict b, int n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float dot_bf16(const float *restrict a, const uint16_t *restrict b, int n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * bf16_to_f32(b[i]);
    return s;
}

static inline float dot_i8(const float *restrict a, const int8_t *restrict b, int n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * (float)b[i];
    return s;
}

/* One online-softmax step over a chunk's n scores s (in place: their exponentials, relative to the
 * running max); m, l: the running max and sum, updated. Returns the factor the accumulator takes. */
static inline float softmax_chunk(float *restrict s, int n, float *m, float *l) {
    float mx = *m;
    for (int j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    const float corr = expf(*m - mx);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < n; j++) {
        s[j] = expf(s[j] - mx);
        sum += s[j];
    }
    *l = *l * corr + sum;
    *m = mx;
    return corr;
}

/* always_inline: attend_rows instantiates it with head_dim as a constant (see there). */
static inline __attribute__((always_inline)) void attend(const float *restrict q, const void *kv, const float *scales, int fmt,
                   const int32_t *restrict table, int begin, int end, int kv_heads, int head_dim,
                   int block_size, int group, int h, float scale, float *restrict out, float softcap = 0.f) {
    float qs[MAX_GROUP][MAX_HEAD_DIM];
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float m[MAX_GROUP], l[MAX_GROUP];
    float s[MAX_GROUP][CHUNK];
    const long tok_stride = 2L * kv_heads * head_dim; /* elements from one slot to the next */
    const long v_off = (long)kv_heads * head_dim;
    const float *lut = fmt == KV_FP8_E4M3 || fmt == KV_FP8_E5M2 ? fp8_table(fmt) : nullptr;

    for (int g = 0; g < group; g++) {
        for (int d = 0; d < head_dim; d++) {
            qs[g][d] = q[g * head_dim + d] * scale;
            acc[g][d] = 0.f;
        }
        m[g] = -1e30f;
        l[g] = 0.f;
    }
    int t = begin;
    while (t < end) {
        const int off = t % block_size;
        int n = block_size - off;
        if (n > CHUNK) n = CHUNK;
        if (n > end - t) n = end - t;
        const long slot0 = (long)table[t / block_size] * block_size + off;

        for (int j = 0; j < n; j++) {
            const long base = (slot0 + j) * tok_stride + (long)h * head_dim;
            if (fmt == KV_INT8) {
                const float ks = scales[(slot0 + j) * 2 * kv_heads + h];
                const int8_t *k = (const int8_t *)kv + base;
                for (int g = 0; g < group; g++) s[g][j] = ks * dot_i8(qs[g], k, head_dim);
            } else if (fmt == KV_FP8_E4M3 || fmt == KV_FP8_E5M2 || fmt == KV_INT4) {
                /* widened to floats once for the group, the scale applied to the dot */
                const float ks = scales[(slot0 + j) * 2 * kv_heads + h];
                float kf[MAX_HEAD_DIM];
                widen_codes(fmt, kv, base, head_dim, lut, kf);
                for (int g = 0; g < group; g++) s[g][j] = ks * dot_f32(qs[g], kf, head_dim);
            } else if (fmt == KV_BF16) {
                const uint16_t *k = (const uint16_t *)kv + base;
                for (int g = 0; g < group; g++) s[g][j] = dot_bf16(qs[g], k, head_dim);
            } else {
                const float *k = (const float *)kv + base;
                for (int g = 0; g < group; g++) s[g][j] = dot_f32(qs[g], k, head_dim);
            }
        }
        if (softcap > 0.f) { /* soft-capped scores (Gemma 2): tanh(s / cap) * cap, before the softmax */
            for (int g = 0; g < group; g++)
                for (int j = 0; j < n; j++) s[g][j] = softcap * tanhf(s[g][j] / softcap);
        }
        for (int g = 0; g < group; g++) {
            const float corr = softmax_chunk(s[g], n, &m[g], &l[g]);
            if (corr != 1.f) {
#pragma omp simd
                for (int d = 0; d < head_dim; d++) acc[g][d] *= corr;
            }
        }
        for (int j = 0; j < n; j++) {
            const long base = (slot0 + j) * tok_stride + v_off + (long)h * head_dim;
            if (fmt == KV_INT8) {
                const float vs = scales[(slot0 + j) * 2 * kv_heads + kv_heads + h];
                const int8_t *v = (const int8_t *)kv + base;
                for (int g = 0; g < group; g++) {
                    const float p = s[g][j] * vs;
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) acc[g][d] += p * (float)v[d];
                }
            } else if (fmt == KV_FP8_E4M3 || fmt == KV_FP8_E5M2 || fmt == KV_INT4) {
                const float vs = scales[(slot0 + j) * 2 * kv_heads + kv_heads + h];
                float vf[MAX_HEAD_DIM];
                widen_codes(fmt, kv, base, head_dim, lut, vf);
                for (int g = 0; g < group; g++) {
                    const float p = s[g][j] * vs;
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) acc[g][d] += p * vf[d];
                }
            } else if (fmt == KV_BF16) {
                const uint16_t *v = (const uint16_t *)kv + base;
                float vf[MAX_HEAD_DIM];
#pragma omp simd
                for (int d = 0; d < head_dim; d++) vf[d] = bf16_to_f32(v[d]);
                for (int g = 0; g < group; g++) {
                    const float p = s[g][j];
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) acc[g][d] += p * vf[d];
                }
            } else {
                const float *v = (const float *)kv + base;
                for (int g = 0; g < group; g++) {
                    const float p = s[g][j];
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) acc[g][d] += p * v[d];
                }
            }
        }
        t += n;
    }
    for (int g = 0; g < group; g++) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int d = 0; d < head_dim; d++) out[g * head_dim + d] = acc[g][d] * inv;
    }
}

/* The same attention with the head size, the query heads per kv head and the cache format as
 * template constants, for float32 and bf16 caches of the common shapes (head_dim 64 or 128, groups
 * up to 8): the group's queries and accumulators live in vector registers, each key and value
 * is loaded (and widened / dequantized) once for the whole group. Keys are scored in the same
 * order as `attend`, but its sums run over vector lanes, so the two differ in rounding: a shape
 * always takes the same one (attend_rows). */

template <int D, int FMT>
static inline void load_row(const void *kv, long base, vfloat (&dst)[D / VEC]) {
    constexpr int NV = D / VEC;
    if constexpr (FMT == KV_F32) {
        const float *p = (const float *)kv + base;
        for (int i = 0; i < NV; i++) dst[i] = *(const vfloat *)(p + i * VEC);
    } else if constexpr (FMT == KV_BF16) {
        const uint16_t *p = (const uint16_t *)kv + base;
        for (int i = 0; i < NV; i++) dst[i] = kvflow::widen_bf16(p + i * VEC);
    }
}

/* One level of a transposed sum: x and y each hold VEC / w partial sums (per key) of 2w lanes
 * each; returns them as VEC / w sums of w lanes, lanes i and i + w of each added. */
template <int W, size_t... I>
static inline vfloat fold_level(vfloat x, vfloat y, std::index_sequence<I...>) {
    return __builtin_shufflevector(x, y, (I / W * 2 * W + I % W)...) +
           __builtin_shufflevector(x, y, (I / W * 2 * W + I % W + W)...);
}

/* The lane sums of VEC keys' product vectors as one vector (lane j: the sum of key j's lanes), by
 * a tree of log2(VEC) levels of shuffles and adds instead of one horizontal sum per key: keys j and
 * j + 1 are folded at level 0 (lanes i and i + VEC/2 added), then pairs of those at level 1 (i and
 * i + VEC/4), ... The tree is the same for every lane, so a key's score does not depend on its
 * neighbours. Built as the keys arrive: `stack[L]` holds the pending node of level L, and key J's
 * vector p climbs while it completes a node (J + 1 a multiple of 2^(L + 1)), so each key's row is
 * consumed as it is loaded instead of VEC rows being held at once (more than the vector registers:
 * they were spilled and reloaded). The last key leaves the whole sum in stack[log2(VEC)]. */
constexpr int FOLD_LEVELS = __builtin_ctz(VEC) + 1;

template <int J, int L = 0>
static inline __attribute__((always_inline)) void fold_key(vfloat (&stack)[FOLD_LEVELS], vfloat p) {
    if constexpr ((((J + 1) >> L) & 1) == 0)
        fold_key<J, L + 1>(stack, fold_level<(VEC >> (L + 1))>(stack[L], p, std::make_index_sequence<VEC>{}));
    else
        stack[L] = p;
}

/* Key J's products with the G queries (zeros past the chunk's n keys) into each query's tree. */
template <int D, int G, int FMT, int J>
static inline __attribute__((always_inline)) void score_key(const vfloat (&qv)[G][D / VEC], const void *kv,
                                                            const long *slots, bool valid, long tok_stride, int h,
                                                            vfloat (&stack)[G][FOLD_LEVELS]) {
    constexpr int NV = D / VEC;
    vfloat k[NV];
    if (valid)
        load_row<D, FMT>(kv, slots[J] * tok_stride + (long)h * D, k);
    else
        for (int i = 0; i < NV; i++) k[i] = vfloat{};
    for (int g = 0; g < G; g++) {
        vfloat p = qv[g][0] * k[0];
        for (int i = 1; i < NV; i++) p += qv[g][i] * k[i];
        fold_key<J>(stack[g], p);
    }
}

template <int D, int G, int FMT, int... J>
static inline __attribute__((always_inline)) void score_keys(const vfloat (&qv)[G][D / VEC], const void *kv,
                                                             const long *slots, int n, long tok_stride, int h,
                                                             float (&s)[G][KEY_CHUNK + VEC], int j0,
                                                             std::integer_sequence<int, J...>) {
    vfloat stack[G][FOLD_LEVELS];
    (score_key<D, G, FMT, J>(qv, kv, slots, J < n, tok_stride, h, stack), ...);
    for (int g = 0; g < G; g++) *(vfloat *)(s[g] + j0) = stack[g][FOLD_LEVELS - 1];
}

/* The online-softmax step of the fixed-shape path over a chunk's n scores of each of G queries (s
 * holds whole vectors: those past n are ignored), in place as in softmax_chunk; corr[g]: the factor
 * query g's accumulator takes. The exponentials in vector registers (simd.h's exp_clamped): a call
 * to glibc's vector expf leaves its caller no vector register, so attend_chunk's queries and
 * accumulators were stored and reloaded around every one. The G corrections take one vector. */
template <int G>
static inline void softmax_keys(float (&s)[G][KEY_CHUNK + VEC], int n, float (&m)[G], float (&l)[G],
                                float (&corr)[G]) {
    static_assert(G <= VEC, "the G corrections take one vector");
    const int full = n / VEC, tail = n % VEC;
    kvflow::vint lane;
    for (int i = 0; i < VEC; i++) lane[i] = i;
    const auto in_tail = lane < tail;
    vfloat old = vfloat{}, now = vfloat{};
    float sums[G];
    for (int g = 0; g < G; g++) {
        vfloat mx = vfloat{} + m[g];
        for (int v = 0; v < full; v++) {
            const vfloat x = *(const vfloat *)(s[g] + v * VEC);
            mx = x > mx ? x : mx;
        }
        if (tail) {
            const vfloat x = *(const vfloat *)(s[g] + full * VEC);
            mx = in_tail && x > mx ? x : mx;
        }
        const float top = kvflow::lanes_max(mx);
        vfloat sum = vfloat{};
        for (int v = 0; v < full; v++) {
            const vfloat e = kvflow::exp_clamped(*(const vfloat *)(s[g] + v * VEC) - top);
            *(vfloat *)(s[g] + v * VEC) = e;
            sum += e;
        }
        if (tail) {
            vfloat e = kvflow::exp_clamped(*(const vfloat *)(s[g] + full * VEC) - top);
            e = in_tail ? e : vfloat{};
            *(vfloat *)(s[g] + full * VEC) = e;
            sum += e;
        }
        sums[g] = kvflow::lanes_sum(sum);
        old[g] = m[g];
        now[g] = top;
        m[g] = top;
    }
    const vfloat c = kvflow::exp_clamped(old - now);
    for (int g = 0; g < G; g++) {
        corr[g] = c[g];
        l[g] = l[g] * c[g] + sums[g];
    }
}

/* One kv head's running attention for its G query heads: the scaled queries, the accumulators,
 * the running max and sum of the online softmax. */
template <int D, int G>
struct HeadState {
    vfloat qv[G][D / VEC], acc[G][D / VEC];
    float m[G], l[G];

    inline void start(const float *restrict q, float scale) {
        for (int g = 0; g < G; g++) {
            for (int i = 0; i < D / VEC; i++) {
                qv[g][i] = *(const vfloat *)(q + g * D + i * VEC) * scale;
                acc[g][i] = vfloat{};
            }
            m[g] = -1e30f;
            l[g] = 0.f;
        }
    }

    inline void finish(float *restrict out) const {
        for (int g = 0; g < G; g++) {
            const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
            for (int i = 0; i < D / VEC; i++) *(vfloat *)(out + g * D + i * VEC) = acc[g][i] * inv;
        }
    }

    /* A fresh softmax for the next segment (the queries kept). */
    inline void restart() {
        for (int g = 0; g < G; g++) {
            for (int i = 0; i < D / VEC; i++) acc[g][i] = vfloat{};
            m[g] = -1e30f;
            l[g] = 0.f;
        }
    }

    /* This state (the keys so far) and `next` (the following segment's) as one. noinline: one body
     * for both callers (attend_fixed, fold_states), so -ffast-math cannot round them apart. */
    __attribute__((noinline)) void fold(const HeadState &next) {
        for (int g = 0; g < G; g++) {
            const float mx = std::max(m[g], next.m[g]);
            const float a = expf(m[g] - mx), b = expf(next.m[g] - mx);
            l[g] = l[g] * a + next.l[g] * b;
            for (int i = 0; i < D / VEC; i++) acc[g][i] = acc[g][i] * a + next.acc[g][i] * b;
            m[g] = mx;
        }
    }

    /* The softmax state (not the queries) to and from G * (D + 2) floats: m, l, then acc. */
    static constexpr int FLOATS = G * (D + 2);
    inline void save(float *restrict to) const {
        for (int g = 0; g < G; g++) {
            to[g] = m[g];
            to[G + g] = l[g];
            for (int i = 0; i < D / VEC; i++) *(vfloat *)(to + 2 * G + g * D + i * VEC) = acc[g][i];
        }
    }
    inline void load(const float *restrict from) {
        for (int g = 0; g < G; g++) {
            m[g] = from[g];
            l[g] = from[G + g];
            for (int i = 0; i < D / VEC; i++) acc[g][i] = *(const vfloat *)(from + 2 * G + g * D + i * VEC);
        }
    }
};

/* The next chunk's keys and values of the heads a task reads (each slot's K lines of those heads,
 * then its V lines), fetched into L2 `per` lines at a time between the current chunk's keys. Issued
 * in one burst, the prefetches held the thread on its fill buffers until most of the chunk had
 * arrived, and then it computed with nothing in flight: fetch and compute took turns (spread, a
 * layer from memory is faster: benchmarks/decode_attention.py --caches 30, figures in
 * docs/benchmarks/results/). */
struct FetchAhead {
    const char *at = nullptr;  /* the cache */
    const long *slots = nullptr;  /* the chunk's slots */
    long slot_bytes = 0, k_off = 0, v_off = 0;  /* where the heads' K and V lines start in a slot */
    int span = 0;  /* lines of K (and of V) per slot */
    int lines = 0, per = 0, done = 0;
    int slot = 0, line = 0;  /* the next line: of slot `slot`, the `line`-th of its K then V lines */

    inline void step() {
        for (const int e = std::min(lines, done + per); done < e; done++) {
            const long off = line < span ? k_off + line * 64L : v_off + (line - span) * 64L;
            __builtin_prefetch(at + slots[slot] * slot_bytes + off, 0, 2);
            if (++line == 2 * span) {
                line = 0;
                slot++;
            }
        }
    }
    inline void rest() {
        per = lines;
        step();
    }
};

/* The keys and values in cache slots slots[0 .. n) of head h (n <= KEY_CHUNK) into st, fetching
 * ahead a share per key. always_inline: in attend_fixed's loop the state stays in registers. */
template <int D, int G, int FMT>
static inline __attribute__((always_inline)) void attend_chunk(HeadState<D, G> &st, const void *kv, const long *slots,
                                                               int n, long tok_stride, long v_off, int h,
                                                               FetchAhead &ahead) {
    constexpr int NV = D / VEC;
    // Register copies for the chunk (gcc may leave a state this large in memory otherwise).
    vfloat qv[G][NV], acc[G][NV];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < NV; i++) {
            qv[g][i] = st.qv[g][i];
            acc[g][i] = st.acc[g][i];
        }
    float s[G][KEY_CHUNK + VEC];
    for (int j0 = 0; j0 < n; j0 += VEC)  /* VEC keys at a time; past n: zero rows */
        score_keys<D, G, FMT>(qv, kv, slots + j0, n - j0, tok_stride, h, s, j0, std::make_integer_sequence<int, VEC>{});
    float corr[G];
    softmax_keys<G>(s, n, st.m, st.l, corr);
    for (int g = 0; g < G; g++)
        for (int i = 0; i < NV; i++) acc[g][i] *= corr[g];
    for (int j = 0; j < n; j++) {
        vfloat v[NV];
        load_row<D, FMT>(kv, slots[j] * tok_stride + v_off + (long)h * D, v);
        ahead.step();
        for (int g = 0; g < G; g++)
            for (int i = 0; i < NV; i++) acc[g][i] += s[g][j] * v[i];
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < NV; i++) st.acc[g][i] = acc[g][i];
}

/* Query rows that read the same keys through the same block table up to their own ends (one
 * sequence's decode row and the rows verifying its drafts: consecutive positions), ends ascending.
 * A single decode row is a run of one. */
struct RowRun {
    int count = 0;
    const float *q[MAX_SWEEP_HEADS];  /* each row's queries of the task's first kv head's group */
    float *out[MAX_SWEEP_HEADS];
    int end[MAX_SWEEP_HEADS];
};

/* Rows [r0, r0 + rows) of a call from kv head h0 on: their queries, outputs and ends. */
static inline RowRun row_run(const float *q, long q_row_stride, float *out, const int32_t *tokens,
                             const int32_t *context_lens, int num_heads, int group, int head_dim, int r0, int rows,
                             int h0) {
    RowRun run;
    run.count = rows;
    for (int i = 0; i < rows; i++) {
        const long tok = tokens[r0 + i];
        run.q[i] = q + tok * q_row_stride + (long)h0 * group * head_dim;
        run.out[i] = out + (tok * num_heads + (long)h0 * group) * head_dim;
        run.end[i] = context_lens[r0 + i];
    }
    return run;
}

/* Keys [begin, end) of kv heads [h, h + heads), chunk by chunk (KEY_CHUNK keys at most), for each row
 * of the run up to its own end: each chunk for every head and row before the next chunk. With all
 * of a row's heads (heads = kv_heads) the row's slots are read front to back, each once (a slot
 * holds every head's key and value side by side), where a head at a time reads a slot's 2 * D
 * elements of each 2 * kv_heads * D in kv_heads separate sweeps, which the hardware prefetchers
 * follow badly (a layer of decode rows read from memory took over half as long again as the same
 * bytes with one kv head). While a chunk computes, the next one's keys and values are fetched into
 * L2 (a block's successor lies anywhere in the pool), spread over its keys (FetchAhead), which
 * shortened such a layer further. Fetching two chunks ahead, or the share of the next chunk in the
 * first half of this one, was no faster. Figures: benchmarks/decode_attention.py --caches 30,
 * docs/benchmarks/results/. Each head's sums are the same either way.
 *
 * The keys run in segments of KEY_SEGMENT positions (at multiples of it), each a softmax of its own,
 * folded into the earlier ones' as it ends, so that a long row's segments can also run as separate
 * tasks (attend_segments: `limit` ends the range, `state_out` takes the raw state) with the same
 * result. */
template <int D, int G, int FMT>
static inline void attend_fixed(const RowRun &run, const void *kv, const int32_t *restrict table, int begin,
                                int kv_heads, int block_size, int h, int heads, float scale, int limit = 1 << 30,
                                float *restrict state_out = nullptr) {
    const long tok_stride = 2L * kv_heads * D, v_off = (long)kv_heads * D;
    const int rows = run.count, end = std::min(limit, run.end[rows - 1]);
    HeadState<D, G> st[MAX_SWEEP_HEADS];  /* row r's head i: st[r * heads + i] (rows x heads <= MAX_SWEEP_HEADS) */
    HeadState<D, G> done[MAX_SWEEP_HEADS];  /* the earlier segments' states folded, where there were any */
    bool folded[MAX_SWEEP_HEADS] = {};
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < heads; i++) st[r * heads + i].start(run.q[r] + (long)i * G * D, scale);
    constexpr long esize = FMT == KV_F32 ? 4 : 2;
    const long slot_bytes = tok_stride * esize, head_bytes = (long)D * esize;
    /* Chunks at fixed positions (so a row's chunks are the same in any run or batch), across block
     * boundaries: each chunk's slots looked up once, the next chunk's while this one computes. A bf16
     * cache's chunks hold 32 keys (the softmax's work per chunk spread over more keys); float32's stay
     * at 16, as its 32-key chunks were ~1.1x slower read from memory at 16-64 rows. A segment's first
     * 16 keys are a chunk of their own: the fetch of the next chunk starts sooner (faster from memory
     * at 16-64 rows; figures in docs/benchmarks/results/). */
    constexpr int CH = FMT == KV_F32 ? 16 : KEY_CHUNK, FIRST = 16;
    static_assert(KEY_SEGMENT % CH == 0 && CH % FIRST == 0, "a segment is whole chunks");
    const auto chunk_keys = [&](int t) {
        const int size = t % KEY_SEGMENT < FIRST ? FIRST : CH;
        return std::min(size - t % size, end - t);
    };
    const auto fill_slots = [&](int t, int n, long *to) {
        for (int j = 0; j < n;) {
            const int pos = t + j, off = pos % block_size, m = std::min(n - j, block_size - off);
            const long first = (long)table[pos / block_size] * block_size + off;
            for (int i = 0; i < m; i++) to[j + i] = first + i;
            j += m;
        }
        return (const long *)to;
    };
    long slots_at[2][KEY_CHUNK];
    int chunk = 0;
    if (begin < end) fill_slots(begin, chunk_keys(begin), slots_at[0]);
    for (int t = begin; t < end;) {
        if (t > begin && t % KEY_SEGMENT == 0)  /* a segment ends: fold it, start the next afresh */
            for (int r = 0; r < rows; r++) {
                if (run.end[r] <= t) continue;
                for (int i = r * heads; i < (r + 1) * heads; i++) {
                    if (folded[i])
                        done[i].fold(st[i]);
                    else
                        done[i] = st[i];
                    folded[i] = true;
                    st[i].restart();
                }
            }
        const int n = chunk_keys(t);
        const long *slots = slots_at[chunk % 2];
        FetchAhead ahead;
        if (t + n < end) {  /* the next chunk's keys and values of these heads, into L2 meanwhile */
            const int n2 = chunk_keys(t + n);
            ahead.slots = fill_slots(t + n, n2, slots_at[(chunk + 1) % 2]);
            ahead.at = (const char *)kv;
            ahead.slot_bytes = slot_bytes;
            ahead.k_off = h * head_bytes;
            ahead.v_off = v_off * esize + h * head_bytes;
            ahead.span = (int)((heads * head_bytes + 63) / 64);
            ahead.lines = n2 * 2 * ahead.span;
            ahead.per = (ahead.lines + rows * heads * n - 1) / (rows * heads * n);
        }
        /* A row's chunks are the ones it has alone (they start where its single run's would; its
         * last one ends at its own end), so its sums are the same as alone; the run's rows take a
         * head's chunk in turn while its keys and values are in L1. */
        for (int i = 0; i < heads; i++)
            for (int r = 0; r < rows; r++) {
                const int m = std::min(n, run.end[r] - t);
                if (m > 0) attend_chunk<D, G, FMT>(st[r * heads + i], kv, slots, m, tok_stride, v_off, h + i, ahead);
            }
        ahead.rest();
        t += n;
        chunk++;
    }
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < heads; i++) {
            const int k = r * heads + i;
            if (state_out) {  /* one segment's raw state (attend_segments folds them) */
                st[k].save(state_out + (long)k * HeadState<D, G>::FLOATS);
                continue;
            }
            if (folded[k]) {
                done[k].fold(st[k]);
                done[k].finish(run.out[r] + (long)i * G * D);
            } else {
                st[k].finish(run.out[r] + (long)i * G * D);
            }
        }
}

/* f(std::integral_constant<int, D>{}, std::integral_constant<int, G>{}) for the shapes the
 * fixed-shape path is instantiated for (head_dim D 64 or 128, G 1-8 query heads per kv head);
 * false, f not called, for any other. */
template <int D, class F, int... G>
static inline bool with_group(int group, F &f, std::integer_sequence<int, G...>) {
    return ((group == G + 1 && (f(std::integral_constant<int, D>{}, std::integral_constant<int, G + 1>{}), true)) ||
            ...);
}

template <class F>
static inline bool with_fixed_shape(int head_dim, int group, F &&f) {
    if (head_dim == 64) return with_group<64>(group, f, std::make_integer_sequence<int, 8>{});
    if (head_dim == 128) return with_group<128>(group, f, std::make_integer_sequence<int, 8>{});
    return false;
}

/* attend_fixed for (D, G) when it is one of the instantiated shapes (and rows x heads <=
 * MAX_SWEEP_HEADS); false otherwise. */
template <int FMT>
static inline bool attend_fast(int head_dim, int group, const RowRun &run, const void *kv, const int32_t *table,
                               int begin, int kv_heads, int block_size, int h, int heads, float scale,
                               int limit = 1 << 30, float *state_out = nullptr) {
    if (run.count * heads > MAX_SWEEP_HEADS) return false;
    return with_fixed_shape(head_dim, group, [&](auto d, auto g) {
        attend_fixed<decltype(d)::value, decltype(g)::value, FMT>(run, kv, table, begin, kv_heads, block_size, h,
                                                                  heads, scale, limit, state_out);
    });
}

/* Out = the `n` saved segment states at `states` (each HeadState<D, G>::FLOATS apart) folded in order. */
template <int D, int G>
static inline void fold_states(const float *states, int n, float *out) {
    HeadState<D, G> done, next;
    done.load(states);
    for (int k = 1; k < n; k++) {
        next.load(states + (long)k * HeadState<D, G>::FLOATS);
        done.fold(next);
    }
    done.finish(out);
}

static inline bool fast_shape(int fmt, int head_dim, int group) {
    return (fmt == KV_F32 || fmt == KV_BF16) && (head_dim == 64 || head_dim == 128) && group <= 8;
}

static inline int check_shape(int num_heads, int kv_heads, int head_dim) {
    const int group = num_heads / kv_heads;
    return head_dim > MAX_HEAD_DIM || group > MAX_GROUP || group * kv_heads != num_heads ? -1 : 0;
}

/* Prefill rows a tile at a time (a part of this header: it uses the formats and load_row above). */
#include "tiled_attention.h"

/* Row r's attention for kv heads [h0, h0 + heads) (attend_rows' per-row path). */
static inline void attend_row(const float *q, long q_row_stride, const void *kv, const float *scales, int fmt,
                              const int32_t *tables, long table_stride, const int32_t *context_lens,
                              const int32_t *tokens, int r, int h0, int heads, int num_heads, int kv_heads,
                              int head_dim, int block_size, int window, float scale, float *out, float softcap) {
    const int group = num_heads / kv_heads;
    const int end = context_lens[r];
    int begin = window > 0 ? end - window : 0;
    if (begin < 0) begin = 0;
    const long tok = tokens[r];
    const float *qr = q + tok * q_row_stride + (long)h0 * group * head_dim;
    const int32_t *table = tables + r * table_stride;
    float *o = out + (tok * num_heads + (long)h0 * group) * head_dim;
    /* The fixed-shape path where it takes the shape: a row task's heads in one sweep over its
     * slots, else a head at a time. */
    const auto fast = [&](int h, int n) {
        const RowRun run = row_run(q, q_row_stride, out, tokens, context_lens, num_heads, group, head_dim, r, 1, h);
        return fmt == KV_F32    ? attend_fast<KV_F32>(head_dim, group, run, kv, table, begin, kv_heads, block_size, h, n, scale)
             : fmt == KV_BF16 ? attend_fast<KV_BF16>(head_dim, group, run, kv, table, begin, kv_heads, block_size, h, n, scale)
                              : false;
    };
    /* (soft-capped scores take the generic path: the fixed-shape one has no cap) */
    if (softcap <= 0.f && heads > 1 && fast(h0, heads)) return;
    for (int h = h0; h < h0 + heads; h++) {
        const float *qh = qr + (long)(h - h0) * group * head_dim;
        float *oh = o + (long)(h - h0) * group * head_dim;
        if (softcap <= 0.f && fast(h, 1)) continue;
        /* The same code with the cache format and the common head sizes as constants, so gcc can
         * unroll and vectorize the fixed-length loops (benchmarks/decode_attention.py: clearly
         * faster with an int8 cache). */
#define ATTEND_DIMS(F)                                                                                   \
    do {                                                                                                 \
        if (head_dim == 64)                                                                              \
            attend(qh, kv, scales, F, table, begin, end, kv_heads, 64, block_size, group, h, scale, oh, softcap);  \
        else if (head_dim == 128)                                                                        \
            attend(qh, kv, scales, F, table, begin, end, kv_heads, 128, block_size, group, h, scale, oh, softcap); \
        else                                                                                             \
            attend(qh, kv, scales, F, table, begin, end, kv_heads, head_dim, block_size, group, h, scale, oh, softcap); \
    } while (0)
        if (fmt == KV_F32)
            ATTEND_DIMS(KV_F32);
        else if (fmt == KV_BF16)
            ATTEND_DIMS(KV_BF16);
        else if (fmt == KV_FP8_E4M3)
            ATTEND_DIMS(KV_FP8_E4M3);
        else if (fmt == KV_FP8_E5M2)
            ATTEND_DIMS(KV_FP8_E5M2);
        else if (fmt == KV_INT4)
            ATTEND_DIMS(KV_INT4);
        else
            ATTEND_DIMS(KV_INT8);  // (its dot of int8 codes, scaled once, beats dequantizing each row first)
#undef ATTEND_DIMS
    }
}

/* Rows that share sequences (prefill chunks), in tiles (tiled_attention.h): a task per (tile, kv
 * head), all of head 0's first, so the tasks running together read one head's keys and values while
 * they are in L2. Rows in runs too short for a tile take the per-row path. */
static inline void attend_tiled(const float *q, long q_row_stride, const void *kv, const float *scales, int fmt,
                                const int32_t *tables, long table_stride, const int32_t *context_lens,
                                const int32_t *tokens, int rows, int num_heads, int kv_heads, int head_dim,
                                int block_size, int window, float scale, float *out) {
    const int group = num_heads / kv_heads;
    const std::vector<AttentionTile> tiles =
        plan_tiles(tables, table_stride, context_lens, rows, group, block_size, window);
    const long n = (long)tiles.size();
#pragma omp for schedule(dynamic, 1)
    for (long task = 0; task < n * kv_heads; task++) {
        const AttentionTile &tile = tiles[task % n];
        const int h = (int)(task / n);
        if (tile.rows == 0) {
            attend_row(q, q_row_stride, kv, scales, fmt, tables, table_stride, context_lens, tokens, tile.r0, h, 1,
                       num_heads, kv_heads, head_dim, block_size, window, scale, out, 0.f);
            continue;
        }
        const int32_t *table = tables + tile.table_row * table_stride;
#define KVFLOW_TILE(D, F)                                                                                   \
    attend_tile<D, F>(tile, group, q, q_row_stride, tokens, context_lens, window, kv, table, kv_heads, num_heads, \
                      block_size, h, scale, out)
        if (head_dim == 64)
            fmt == KV_F32 ? KVFLOW_TILE(64, KV_F32) : KVFLOW_TILE(64, KV_BF16);
        else
            fmt == KV_F32 ? KVFLOW_TILE(128, KV_F32) : KVFLOW_TILE(128, KV_BF16);
#undef KVFLOW_TILE
    }
}

/* A decode call's work as (rows of a run, kv heads) tasks, where some rows share a sequence (runs of
 * RowRun, found as plan_tiles finds a prefill chunk's rows: consecutive rows whose tables agree over
 * the earlier row's keys, ends ascending); empty when every row is alone (plain decoding keeps the
 * per-row tasks). A run is cut into pieces of at most MAX_SWEEP_HEADS rows, and into more when there
 * are too few to keep the threads busy; a piece's task takes as many kv heads as its states allow
 * when the pieces alone keep every thread busy (as the per-row tasks do), else one. Longest first. The
 * same list on every thread. */
struct RunTask {
    int r0, rows, h0, heads;
};

static inline void plan_runs(const int32_t *tables, long table_stride, const int32_t *context_lens, int rows,
                             int kv_heads, int block_size, int threads, std::vector<RunTask> &tasks) {
    tasks.clear();
    thread_local std::vector<std::pair<int, int>> runs, pieces;  /* (first row, rows); reused per call */
    runs.clear();
    pieces.clear();
    bool shared = false;
    for (int r0 = 0; r0 < rows;) {
        int r1 = r0 + 1;
        while (r1 < rows && context_lens[r1] >= context_lens[r1 - 1]) {
            const long entries = (context_lens[r1 - 1] + block_size - 1) / block_size;
            if (memcmp(tables + r1 * table_stride, tables + (r1 - 1) * table_stride, entries * sizeof(int32_t)) != 0)
                break;
            r1++;
        }
        runs.push_back({r0, r1 - r0});
        shared |= r1 - r0 > 1;
        r0 = r1;
    }
    if (!shared) return;
    const int split = ((2 * threads + (int)runs.size() * kv_heads - 1) / ((int)runs.size() * kv_heads));
    for (const auto &[r0, n] : runs) {
        const int p = std::min(n, std::max((n + MAX_SWEEP_HEADS - 1) / MAX_SWEEP_HEADS, split));
        for (int i = 0; i < p; i++) {
            const int a = r0 + (int)((long)n * i / p), b = r0 + (int)((long)n * (i + 1) / p);
            pieces.push_back({a, b - a});
        }
    }
    const bool busy = (int)pieces.size() >= 4 * threads;
    for (const auto &[r0, n] : pieces) {
        const int per = busy ? std::max(1, std::min(kv_heads, MAX_SWEEP_HEADS / n)) : 1;
        for (int h = 0; h < kv_heads; h += per) tasks.push_back({r0, n, h, std::min(per, kv_heads - h)});
    }
    std::stable_sort(tasks.begin(), tasks.end(), [&](const RunTask &a, const RunTask &b) {
        return (long)context_lens[a.r0 + a.rows - 1] * a.rows * a.heads >
               (long)context_lens[b.r0 + b.rows - 1] * b.rows * b.heads;
    });
}

/* Task `t` of plan_runs: its rows' attention for its kv heads, through the run's last row's table. */
template <int FMT>
static inline void attend_run(const RunTask &t, const float *q, long q_row_stride, const void *kv,
                              const int32_t *tables, long table_stride, const int32_t *context_lens,
                              const int32_t *tokens, int num_heads, int kv_heads, int head_dim, int block_size,
                              float scale, float *out) {
    const int group = num_heads / kv_heads;
    const RowRun run = row_run(q, q_row_stride, out, tokens, context_lens, num_heads, group, head_dim, t.r0, t.rows,
                               t.h0);
    attend_fast<FMT>(head_dim, group, run, kv, tables + (long)(t.r0 + t.rows - 1) * table_stride, 0, kv_heads,
                     block_size, t.h0, t.heads, scale);
}

/* Row r's kv head h over its keys' KEY_SEGMENT-key segments as separate tasks, where a call's rows
 * and kv heads are too few to keep the threads busy (a batch-1 decode has as many tasks as kv
 * heads): each segment's raw state into `parts`, then each (row, head)'s states folded in order,
 * as attend_fixed folds them when one task takes them in turn, so the result is the same bits.
 * Returns false (nothing done) where it does not apply. Every thread of the region calls it. */
template <int FMT>
static inline bool attend_segments(const float *q, long q_row_stride, const void *kv, const int32_t *tables,
                                   long table_stride, const int32_t *context_lens, const int32_t *tokens, int rows,
                                   int num_heads, int kv_heads, int head_dim, int block_size, float scale,
                                   float *out, std::vector<float> *parts) {
    const int group = num_heads / kv_heads, threads = omp_get_num_threads();
    if (!parts || threads < 2 || rows * kv_heads >= 2 * threads) return false;
    int most = 0;
    for (int r = 0; r < rows; r++) most = std::max(most, (context_lens[r] + KEY_SEGMENT - 1) / KEY_SEGMENT);
    if (most < 2) return false;
    const long floats = (long)group * (head_dim + 2);  /* HeadState<D, G>::FLOATS */
#pragma omp single
    parts->resize((size_t)rows * kv_heads * most * floats);
    float *buf = parts->data();
    const auto one = [&](int r, int h) {
        return row_run(q, q_row_stride, out, tokens, context_lens, num_heads, group, head_dim, r, 1, h);
    };
    const long tasks = (long)rows * kv_heads * most;
#pragma omp for schedule(dynamic, 1)
    for (long i = 0; i < tasks; i++) {
        const int k = (int)(i % most), h = (int)(i / most % kv_heads), r = (int)(i / most / kv_heads);
        if ((long)k * KEY_SEGMENT >= context_lens[r]) continue;
        attend_fast<FMT>(head_dim, group, one(r, h), kv, tables + (long)r * table_stride, k * KEY_SEGMENT,
                         kv_heads, block_size, h, 1, scale, (k + 1) * KEY_SEGMENT, buf + i * floats);
    }
#pragma omp for schedule(static)
    for (long i = 0; i < (long)rows * kv_heads; i++) {
        const int r = (int)(i / kv_heads), h = (int)(i % kv_heads);
        const int n = (context_lens[r] + KEY_SEGMENT - 1) / KEY_SEGMENT;
        float *dst = one(r, h).out[0];
        with_fixed_shape(head_dim, group, [&](auto d, auto g) {
            fold_states<decltype(d)::value, decltype(g)::value>(buf + i * most * floats, n, dst);
        });
    }
    return true;
}

static inline void attend_rows(const float *q, long q_row_stride, const void *kv, const float *scales, int fmt,
                        const int32_t *tables, long table_stride, const int32_t *context_lens,
                        const int32_t *tokens, int rows, int num_heads, int kv_heads, int head_dim,
                        int block_size, int window, float scale, float *out, int head_major = 0,
                        float softcap = 0.f, std::vector<float> *parts = nullptr) {
    const int group = num_heads / kv_heads;
    if (head_major == 2 && softcap <= 0.f && tiled_shape(fmt, head_dim, group)) {
        attend_tiled(q, q_row_stride, kv, scales, fmt, tables, table_stride, context_lens, tokens, rows, num_heads,
                     kv_heads, head_dim, block_size, window, scale, out);
        return;
    }
    /* Decode rows (head_major 0) where some share a sequence (a decode verifying its drafts): tasks
     * of plan_runs, so a run's rows read their keys and values once, each row's sums as alone.
     * Otherwise a task per row (its kv heads one after another on one thread, over the same block
     * table and the same pages of cache) where the rows alone keep every thread busy; else a task
     * per (row, kv head). head_major (rows that share their sequences: prefill chunks; 2: in tiles
     * where tiled_shape takes them, see attend_tiled): a task per (row, kv head), all rows of head 0
     * first, so a thread's next rows sweep the same head's keys and values while they are still in
     * L2 (a row sweeping all its heads outgrew L2 on long float32 contexts). Each head's result is
     * the same either way. */
    if (!head_major && softcap <= 0.f && window <= 0 && fast_shape(fmt, head_dim, group)) {
        thread_local std::vector<RunTask> tasks;
        plan_runs(tables, table_stride, context_lens, rows, kv_heads, block_size, omp_get_num_threads(), tasks);
        if (tasks.empty()) {  /* every row alone: too few of them split their keys (attend_segments) */
            if (fmt == KV_F32 ? attend_segments<KV_F32>(q, q_row_stride, kv, tables, table_stride, context_lens, tokens,
                                                        rows, num_heads, kv_heads, head_dim, block_size, scale, out, parts)
                              : attend_segments<KV_BF16>(q, q_row_stride, kv, tables, table_stride, context_lens,
                                                         tokens, rows, num_heads, kv_heads, head_dim, block_size,
                                                         scale, out, parts))
                return;
        } else {
            const long n = (long)tasks.size();
#pragma omp for schedule(dynamic, 1)
            for (long i = 0; i < n; i++)
                fmt == KV_F32 ? attend_run<KV_F32>(tasks[i], q, q_row_stride, kv, tables, table_stride, context_lens,
                                                   tokens, num_heads, kv_heads, head_dim, block_size, scale, out)
                              : attend_run<KV_BF16>(tasks[i], q, q_row_stride, kv, tables, table_stride, context_lens,
                                                    tokens, num_heads, kv_heads, head_dim, block_size, scale, out);
            return;
        }
    }
    const int per_task = !head_major && rows >= 4 * omp_get_num_threads() ? kv_heads : 1;
    const long tasks = (long)rows * kv_heads;
#pragma omp for schedule(dynamic, 1)
    for (long first = 0; first < tasks; first += per_task) {
        const int r = head_major ? (int)(first % rows) : (int)(first / kv_heads);
        const int h0 = head_major ? (int)(first / rows) : (int)(first % kv_heads);
        attend_row(q, q_row_stride, kv, scales, fmt, tables, table_stride, context_lens, tokens, r, h0, per_task,
                   num_heads, kv_heads, head_dim, block_size, window, scale, out, softcap);
    }
}


/* A decode step's attention, inside a parallel region. qkv: [rows, q heads | k heads | v heads], one
 * new token per sequence: rotary on each row's q and k in place, its k and v into cache slot
 * slots[t], then (after the loop's barrier) attention as attend_rows, the new keys included. */
static inline void decode_attention(float *qkv, long qkv_row_stride, const float *cos_t, const float *sin_t,
                                    void *cache, float *scales, int fmt, const int64_t *slots,
                                    const int32_t *tables, long table_stride, const int32_t *context_lens,
                                    const int32_t *tokens, int rows, int num_heads, int kv_heads, int head_dim,
                                    int block_size, int window, float scale, float *out,
                                    std::vector<float> *parts = nullptr) {
#pragma omp for
    for (int t = 0; t < rows; t++) {
        float *row = qkv + t * qkv_row_stride;
        rotary_heads(row, num_heads + kv_heads, head_dim, cos_t + (long)t * head_dim, sin_t + (long)t * head_dim);
        write_kv(row + (long)num_heads * head_dim, slots[t], cache, scales, fmt, kv_heads, head_dim);
    }
    attend_rows(qkv, qkv_row_stride, cache, scales, fmt, tables, table_stride, context_lens, tokens, rows,
                num_heads, kv_heads, head_dim, block_size, window, scale, out, 0, 0.f, parts);
}

#endif
