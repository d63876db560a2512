/* Row-wise operations of the int8 (W8A8) path, one call each instead of several small torch ops
 * (each costs a few microseconds of dispatch here). Each row is computed on its own, in an order that
 * does not depend on how many rows there are: a token's result is the same whatever its batch (the
 * int8 path is exact across batching, chunking and preemption). The norms and the activation run
 * inside the int8 linear's call (int8_linear.cpp).
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>

#define PARALLEL_MIN 65536 /* elements below which a call stays on one thread */

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
