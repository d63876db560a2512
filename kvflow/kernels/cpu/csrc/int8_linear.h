/* The int8 linear's C++ interface inside the "linear" library (int8_linear.cpp, decode_pass.cpp). */
#ifndef KVFLOW_INT8_LINEAR_H
#define KVFLOW_INT8_LINEAR_H

#include <fbgemm/Fbgemm.h>

#include "prologue.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace kvflow {

struct PackedWeight {
  std::unique_ptr<fbgemm::PackBMatrix<int8_t>> packed;
  int n, k;
  int levels;                        // activations use round(levels * v / max|v|) + levels + 1
  std::vector<float> scale;         // per output channel
  std::vector<int32_t> col_offsets; // sum of each output channel's int8 weights
};

/* out[m, n] = residual + W . pre(x) + bias: see int8_linear.cpp. Opens its own parallel region. */
void int8_linear(const PackedWeight& p, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                 const float* bias, const float* residual, long ld_res, float* out, int num_threads);

}  // namespace kvflow

#endif
