/* The fp32 linear's C++ interface inside the "linear" library (f32_linear.cpp, decode_pass.cpp). */
#ifndef KVFLOW_F32_LINEAR_H
#define KVFLOW_F32_LINEAR_H

#include <vector>

#include "linear_ops.h"

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

/* The prologue's rows (zero-padded to kp) of a call, shared by its team; `reserve` before the
 * parallel region. */
struct F32Workspace {
  std::vector<float> v;
  void reserve(int m, int kp);
};

/* out[m, n] = residual + W . pre(x) + bias: see f32_linear.cpp. Called by every thread of a
 * parallel region (`w` reserved for it beforehand); ends with a barrier. */
void f32_linear_team(const F32Weight& p, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                     const float* bias, const float* residual, long ld_res, float* out, F32Workspace& w);

/* The same in a parallel region of its own. */
void f32_linear(const F32Weight& p, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                const float* bias, const float* residual, long ld_res, float* out, int num_threads);

}  // namespace kvflow

#endif
