/* Row-wise fused operations of the int8 (W8A8) path, so that a decoder layer at small batch runs a
 * handful of calls instead of many small torch ops (each costs a few microseconds of dispatch here).
 *
 * Every operation works on each row on its own, in an order that does not depend on the row's
 * address or on how many rows there are: a token's result is the same whatever it is batched with
 * (the int8 path is exact across batching, chunking and preemption). Reductions therefore use a
 * fixed set of LANES partial sums, and exp goes through the same LANES-wide code for every element.
 *
 * "Row-scaled" output: each row divided by its max |value| (at least 1e-30), with that max stored
 * in scale[row]: what the int8 linear quantizes with a fixed 8-bit scale (kvflow/layers/linear.py).
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>

#define LANES 16
#define PARALLEL_MIN 65536 /* elements below which a call stays on one thread */

static inline float row_absmax(const float *restrict y, int n) {
    float m[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) m[j] = fmaxf(m[j], fabsf(y[i + j]));
    for (int j = 0; i + j < n; j++) m[j] = fmaxf(m[j], fabsf(y[i + j]));
    float r = 1e-30f;
    for (int j = 0; j < LANES; j++) r = fmaxf(r, m[j]);
    return r;
}

static inline void scale_row(float *restrict y, int n, float *restrict scale) {
    const float r = row_absmax(y, n);
    *scale = r;
    for (int i = 0; i < n; i++) y[i] = y[i] / r;
}

void kvflow_row_scale(const float *x, long x_stride, int rows, int cols, float *out, float *scale,
                      int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((long)rows * cols >= PARALLEL_MIN)
    for (int r = 0; r < rows; r++) {
        const float *restrict xr = x + r * x_stride;
        float *restrict o = out + (long)r * cols;
        for (int i = 0; i < cols; i++) o[i] = xr[i];
        scale_row(o, cols, scale + r);
    }
}

/* y = x * rsqrt(mean(x^2) + eps) * w, row-scaled. */
void kvflow_rmsnorm_row_scale(const float *x, long x_stride, const float *w, float eps, int rows, int cols,
                              float *out, float *scale, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((long)rows * cols >= PARALLEL_MIN)
    for (int r = 0; r < rows; r++) {
        const float *restrict xr = x + r * x_stride;
        float *restrict o = out + (long)r * cols;
        float acc[LANES] = {0};
        int i = 0;
        for (; i + LANES <= cols; i += LANES)
            for (int j = 0; j < LANES; j++) acc[j] += xr[i + j] * xr[i + j];
        for (int j = 0; i + j < cols; j++) acc[j] += xr[i + j] * xr[i + j];
        float ss = 0.f;
        for (int j = 0; j < LANES; j++) ss += acc[j];
        const float inv = 1.f / sqrtf(ss / (float)cols + eps);
        for (int k = 0; k < cols; k++) o[k] = xr[k] * inv * w[k];
        scale_row(o, cols, scale + r);
    }
}

/* h = silu(gu[:, :inter]) * gu[:, inter:], row-scaled. */
void kvflow_silu_mul_row_scale(const float *gu, long gu_stride, int rows, int inter, float *out, float *scale,
                               int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((long)rows * inter >= PARALLEL_MIN)
    for (int r = 0; r < rows; r++) {
        const float *restrict g = gu + r * gu_stride;
        const float *restrict u = g + inter;
        float *restrict o = out + (long)r * inter;
        for (int i = 0; i < inter; i += LANES) {
            float e[LANES];
            const int n = inter - i < LANES ? inter - i : LANES;
            for (int j = 0; j < LANES; j++) e[j] = j < n ? -g[i + j] : 0.f;
#pragma omp simd
            for (int j = 0; j < LANES; j++) e[j] = expf(e[j]);
            for (int j = 0; j < n; j++) o[i + j] = g[i + j] / (1.f + e[j]) * u[i + j];
        }
        scale_row(o, inter, scale + r);
    }
}

/* Rotary embedding in place, rotate-half layout: for each row t and head h of x,
 * x = x * cos[t] + roll(x, D/2) * sin_signed[t] (sin_signed: sin with its first half negated). */
void kvflow_rotary(float *x, long x_stride, int rows, int heads, int head_dim, const float *cos_t,
                   const float *sin_t, int num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if ((long)rows * heads * head_dim >= PARALLEL_MIN)
    for (int t = 0; t < rows; t++) {
        const float *restrict c = cos_t + (long)t * head_dim;
        const float *restrict s = sin_t + (long)t * head_dim;
        for (int h = 0; h < heads; h++) {
            float *restrict v = x + t * x_stride + (long)h * head_dim;
            float lo[128], hi[128];
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
}
