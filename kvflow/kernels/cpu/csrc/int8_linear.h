/* The int8 linear's C++ interface inside the "linear" library (int8_linear.cpp, decode_pass.cpp). */
#ifndef KVFLOW_INT8_LINEAR_H
#define KVFLOW_INT8_LINEAR_H

#include <fbgemm/Fbgemm.h>

#include "linear_ops.h"
#include "weight_memory.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace kvflow {

struct PackedWeight {
  std::unique_ptr<fbgemm::PackBMatrix<int8_t>> packed;  // over `buf` (FBGEMM's packing, our memory)
  int n, k;
  int levels;                        // activations use round(levels * v / max|v|) + levels + 1
  std::vector<float> scale;         // per output channel
  std::vector<int32_t> col_offsets; // sum of each output channel's int8 weights
  void* buf = nullptr;              // the packed matrix, from alloc_weights (huge pages)
  size_t buf_bytes = 0;
  ~PackedWeight() {
    packed.reset();
    free_weights(buf, buf_bytes);
  }
};

/* The buffers of a call, shared by the threads of its team: the quantized rows, each thread's
 * prologue row, the row scales, the int32 accumulators. `reserve` (before the parallel region)
 * grows them to what a call of m rows of W [n, k] needs. */
struct Int8Workspace {
  std::vector<uint8_t> q;
  std::vector<float> v, r;
  std::vector<int32_t> acc;
  void reserve(int m, int k, int n, int num_threads);
};

/* out[m, n] = residual + W . pre(x) + bias: see int8_linear.cpp. Called by every thread of a
 * parallel region (`w` reserved for it beforehand); ends with a barrier. */
void int8_linear_team(const PackedWeight& p, const float* x, long ldx, int m, int kind, const float* norm_w,
                      float eps, const float* bias, const float* residual, long ld_res, float* out,
                      Int8Workspace& w);

/* The same in a parallel region of its own. */
void int8_linear(const PackedWeight& p, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                 const float* bias, const float* residual, long ld_res, float* out, int num_threads);

}  // namespace kvflow

#endif
