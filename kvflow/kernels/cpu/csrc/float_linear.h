/* The float linear's C++ interface inside the "linear" library (float_linear.cpp, decode_pass.cpp):
 * float32, bfloat16 or float8 e4m3 weights, float32 sums. */
#ifndef KVFLOW_FLOAT_LINEAR_H
#define KVFLOW_FLOAT_LINEAR_H

#include <cstdint>
#include <vector>

#include "linear_ops.h"
#include "simd.h"

namespace kvflow {

// Output channels per panel: one vector register of floats. The library is compiled for the CPU it
// runs on, and packs and reads its own layout.
constexpr int LANES_OUT = VEC;

// bfloat16 weights meet bfloat16 activations in the CPU's bf16 dot product (AVX512-BF16: two
// products per lane and instruction) where it has one; elsewhere they are widened to float32 in
// registers and meet float32 activations.
#ifdef __AVX512BF16__
constexpr bool BF16_DOT = true;
#else
constexpr bool BF16_DOT = false;
#endif

// W_FP8: float8 e4m3 bytes (a quantized checkpoint's FP8 weights) with one scale per output channel,
// widened in registers (simd.h's widen_e4m3) and scaled after the sum.
enum WeightType { W_F32 = 0, W_BF16 = 1, W_FP8 = 2 };

// What is done to each input row before the products: nothing, or (ACT_FP8_TOKEN) rounded to float8
// e4m3 with a scale of max|x| / 448 per row, as an FP8 W8A8 checkpoint's dynamic per-token
// activations are (the products then run on those values in float32).
enum ActQuant { ACT_NONE = 0, ACT_FP8_TOKEN = 1 };

/* A weight [n, k] in panels of LANES_OUT output channels (n padded with zero channels), each panel
 * one contiguous run over k: w[(p * kp + c) * LANES_OUT + j] = W[p * LANES_OUT + j, c] (float32, or
 * bf16 widened: kp = k), or for the bf16 dot product pairs of features per channel,
 * w[((p * kp / 2 + c / 2) * LANES_OUT + j) * 2 + c % 2] (kp = k rounded up to even, zero-padded).
 * (float_linear.cpp groups panels and interleaves a group's panels feature by feature; under AVX2
 * bf16 panels go in pairs laid out for two unpacks: packed_index there.)
 * A tile reads whole vectors of output channels and broadcasts one input value (or pair): no
 * horizontal sums, and each output's sum runs over k in order whatever the tile. */
struct FloatWeight {
  void* w;
  int n, k, kp;
  int type;  // WeightType
  size_t bytes;  // of w (weight_memory.h)
  float* channel_scale = nullptr;  // W_FP8: n scales (times 2^8, see widen_e4m3), else null
  int act = ACT_NONE;  // ActQuant
};

FloatWeight* float_pack(const void* w, int n, int k, int type);
/* float8 e4m3 weights [n, k] with per-output-channel scales [n] (copied), `act` an ActQuant. */
FloatWeight* float_pack_fp8(const uint8_t* w, int n, int k, const float* scale, int act);
void float_free(FloatWeight* p);

/* The prologue's rows of a call (float32, kp apart; and as bf16 pairs for the dot product), shared
 * by its team; `reserve` before the parallel region. */
struct FloatWorkspace {
  std::vector<float> v;
  std::vector<uint32_t> pairs;
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
