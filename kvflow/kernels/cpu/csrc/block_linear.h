/* The block-quantized linear's C++ interface inside the "linear" library (block_linear.cpp,
 * decode_pass.cpp): weights in GGUF's block formats, read as they are stored. */
#ifndef KVFLOW_BLOCK_LINEAR_H
#define KVFLOW_BLOCK_LINEAR_H

#include <cstdint>
#include <vector>

#include "linear_ops.h"
#include "weight_memory.h"

namespace kvflow {

// GGML type ids of the formats the kernel reads (gguf.GGMLQuantizationType).
enum BlockType { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

constexpr int QA = 32;  // activation block: 32 int8 values with one float scale

constexpr int X8 = 8;  // output channels interleaved by the repacked layout

/* A run of output channels stored in one format. Either GGUF's own layout: `rows` rows of
 * `row_bytes` bytes, each the blocks of one output channel over all k inputs, memory the caller
 * keeps alive; or, for Q4_0 / Q4_1 / Q8_0 / Q4_K with rows a multiple of X8, repacked at load into
 * `packed` (X8 channels interleaved: see block_linear.cpp) and `data` points there. */
struct BlockSegment {
  int type, rows;
  long row_bytes;
  const uint8_t* data;
  bool x8;
  std::vector<uint8_t, WeightAllocator<uint8_t>> packed;
};

/* W [n, k] as consecutive segments (a fused projection keeps its parts' formats: q | k | v). */
struct BlockWeight {
  int n, k;
  std::vector<BlockSegment> segs;
};

/* A call's activations, shared by its team: each row's prologue output, quantized per block of QA
 * to int8 `q` with scale `d` and `s` = d * sum(q) (for formats with an offset); `v` holds each
 * thread's float row. `reserve` before the parallel region. */
struct BlockWorkspace {
  std::vector<int8_t> q;
  std::vector<uint8_t> qu;  // q + 128, unsigned: the Q8_0 and Q6_K tiles' operand with VNNI
  std::vector<float> d, s, v;
  void reserve(int m, int k, int num_threads);
};

/* out[m, n] = residual + W . pre(x) + bias, pre as in linear_ops.h. Called by every thread of a
 * parallel region (`w` reserved for it beforehand); ends with a barrier. */
void block_linear_team(const BlockWeight& p, const float* x, long ldx, int m, int kind, const float* norm_w,
                       float eps, const float* bias, const float* residual, long ld_res, float* out,
                       BlockWorkspace& w);

/* The same in a parallel region of its own. */
void block_linear(const BlockWeight& p, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                  const float* bias, const float* residual, long ld_res, float* out, int num_threads);

}  // namespace kvflow

#endif
