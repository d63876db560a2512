/* The ops around a projection inside the native linears (int8_linear.cpp, float_linear.cpp), so a
 * projection and its neighbours are one call: the prologue that produces its input, applied row by
 * row, and the epilogue (scale, bias, residual) on its output. Shared, so both backends (and their
 * decode passes) compute them the same way with the same rounding. */
#ifndef KVFLOW_LINEAR_OPS_H
#define KVFLOW_LINEAR_OPS_H

#include <algorithm>
#include <cmath>
#include <cstring>

#include "simd.h"

namespace kvflow {

enum Prologue { NONE = 0, RMSNORM = 1, SILU_MUL = 2 };

// Reductions use LANES fixed partial sums, and exp one LANES-wide path for every element, so a
// row's result does not depend on how many rows a call holds.
constexpr int LANES = 16;

/* pre(x) of one row into v[k]. */
inline void prologue(int kind, const float* __restrict x, int k, const float* __restrict norm_w, float eps,
                     float* __restrict v) {
  if (kind == RMSNORM) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= k; i += LANES)
      for (int j = 0; j < LANES; j++) acc[j] += x[i + j] * x[i + j];
    for (int j = 0; i + j < k; j++) acc[j] += x[i + j] * x[i + j];
    float ss = 0.f;
    for (int j = 0; j < LANES; j++) ss += acc[j];
    const float inv = 1.f / std::sqrt(ss / (float)k + eps);
    for (int c = 0; c < k; c++) v[c] = x[c] * inv * norm_w[c];
  } else if (kind == SILU_MUL) {
    // silu(g) * u = g / (1 + exp(-g)) * u, VEC values at a time; a tail goes through the same
    // vector code, padded.
    const float* __restrict up = x + k;
    const auto silu_mul = [](vfloat g, vfloat u) { return g / (1.f + exp_clamped(-g)) * u; };
    int i = 0;
    for (; i + VEC <= k; i += VEC)
      *(vfloat*)(v + i) = silu_mul(*(const vfloat*)(x + i), *(const vfloat*)(up + i));
    if (i < k) {
      vfloat g = vfloat{}, u = vfloat{};
      std::memcpy(&g, x + i, (k - i) * sizeof(float));
      std::memcpy(&u, up + i, (k - i) * sizeof(float));
      const vfloat y = silu_mul(g, u);
      std::memcpy(v + i, &y, (k - i) * sizeof(float));
    }
  } else {
    for (int c = 0; c < k; c++) v[c] = x[c];
  }
}

/* y[j] = res[j] + (y[j] * r + bias[j]) for j in [j0, j1); bias, res may be null. */
inline void epilogue(float* __restrict y, int j0, int j1, float r, const float* __restrict bias,
                     const float* __restrict res) {
  for (int j = j0; j < j1; j++) {
    float o = y[j] * r;
    if (bias) o += bias[j];
    if (res) o = res[j] + o;
    y[j] = o;
  }
}

}  // namespace kvflow

#endif
