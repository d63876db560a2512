/* The fp32 linear's C++ interface inside the "linear" library (f32_linear.cpp, decode_pass.cpp). */
#ifndef KVFLOW_F32_LINEAR_H
#define KVFLOW_F32_LINEAR_H

#include "prologue.h"

namespace kvflow {

constexpr int QUAD = 4;   // output channels per packed group
constexpr int BLOCK = 8;  // input features per packed run (one 8-float vector)

/* A float32 weight [n, k], packed so that a thread's read of it is one sequential stream: quads
 * of QUAD output channels, each stored as runs of BLOCK input features, channel after channel
 * (w[((q * kp + c) * QUAD + j) * BLOCK + b] = W[q * QUAD + j, c + b]), k padded with zeros to kp
 * (a multiple of BLOCK) and n to a multiple of QUAD. */
struct F32Weight {
  float* w;
  int n, k, kp;
};

F32Weight* f32_pack(const float* w, int n, int k);
void f32_free(F32Weight* p);

/* out[m, n] = residual + W . pre(x) + bias: see f32_linear.cpp. Opens its own parallel region. */
void f32_linear(const F32Weight& p, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                const float* bias, const float* residual, long ld_res, float* out, int num_threads);

}  // namespace kvflow

#endif
