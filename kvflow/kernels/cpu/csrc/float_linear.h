/* The float linear's C++ interface inside the "linear" library (float_linear.cpp, decode_pass.cpp):
 * float32 activations and accumulation over float32 or bfloat16 weights. */
#ifndef KVFLOW_FLOAT_LINEAR_H
#define KVFLOW_FLOAT_LINEAR_H

#include <cstdint>
#include <vector>

#include "linear_ops.h"

namespace kvflow {

constexpr int QUAD = 4;  // output channels per packed group
constexpr int BLOCK = 8;  // input features per packed run (one 8-float vector)

enum WeightType { W_F32 = 0, W_BF16 = 1 };

/* A weight [n, k], packed so that a thread's read of it is one sequential stream: quads of QUAD
 * output channels, each stored as runs of BLOCK input features, channel after channel
 * (w[((q * kp + c) * QUAD + j) * BLOCK + b] = W[q * QUAD + j, c + b]), k padded with zeros to kp
 * (a multiple of BLOCK) and n to a multiple of QUAD. Elements are float32, or bfloat16 (the upper
 * half of a float32: widened to float32 in registers, so products are exact float32 ones and a
 * decode step reads half the bytes). */
struct FloatWeight {
  void* w;
  int n, k, kp;
  int type;  // WeightType
};

FloatWeight* float_pack(const void* w, int n, int k, int type);
void float_free(FloatWeight* p);

/* The prologue's rows (zero-padded to kp) of a call, shared by its team; `reserve` before the
 * parallel region. */
struct FloatWorkspace {
  std::vector<float> v;
  void reserve(int m, int kp);
};

/* out[m, n] = residual + W . pre(x) + bias: see float_linear.cpp. Called by every thread of a
 * parallel region (`w` reserved for it beforehand); ends with a barrier. */
void float_linear_team(const FloatWeight& p, const float* x, long ldx, int m, int kind, const float* norm_w,
                       float eps, const float* bias, const float* residual, long ld_res, float* out,
                       FloatWorkspace& w);

/* The same in a parallel region of its own. */
void float_linear(const FloatWeight& p, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                  const float* bias, const float* residual, long ld_res, float* out, int num_threads);

}  // namespace kvflow

#endif
