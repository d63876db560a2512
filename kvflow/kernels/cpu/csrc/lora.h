/* Multi-LoRA's shrink and expand inside the "linear" library (lora.cpp, decode_pass.cpp): one call adds,
 * for every row of a step that runs under an adapter, scaling * B (A pre(x)) of its adapter to the
 * projection's output, all adapters of the step at once (Punica's segmented SGMV). */
#ifndef KVFLOW_LORA_H
#define KVFLOW_LORA_H

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvflow {

constexpr int LORA_MAX_PARTS = 3;  // q, k, v of a fused qkv projection

/* One projection's resident adapters, stacked by slot (mirrored by kvflow/kernels/cpu/lora.py):
 *   a     [slots, parts * rmax, in]: row p * rmax + r of a slot is row r of part p's A
 *   bt    [slots, rmax, out]: bt[s, r, j] = scaling_p * B_p[j - start_p, r] for the columns j of part p
 *   ranks [slots, parts]: part p of slot s has rank ranks[s, p] (0: not adapted, or an empty slot)
 * Parts are column ranges of the fused output ([part_end[p - 1], part_end[p])). Only the first
 * rank rows of a part are read: slots are sized for the highest rank, an adapter costs its own. */
struct LoraProj {
  const float* a;
  const float* bt;
  const int32_t* ranks;
  int in, out, parts, rmax;
  int part_end[LORA_MAX_PARTS];
};

/* The rows of a step that run under an adapter, grouped by slot: rows[seg_start[g] ..
 * seg_start[g + 1]) run under slot seg_slot[g] (rows of the base model are in no segment). */
struct LoraRows {
  const int32_t* rows;
  const int32_t* seg_start;
  const int32_t* seg_slot;
  int num_segments;
};

/* Each adapter row's input and shrunk vector, shared by the team; `reserve` before the parallel region. */
struct LoraWorkspace {
  std::vector<float> v, t;
  void reserve(int rows, int k, int tk) {
    if (v.size() < (std::size_t)rows * k) v.resize((std::size_t)rows * k);
    if (t.size() < (std::size_t)rows * tk) t.resize((std::size_t)rows * tk);
  }
};

/* out[row] += B_slot (A_slot pre(x[row])) for every row of `r` (pre: the Prologue `kind` of
 * linear_ops.h, as the projection's own linear applies it; x: rows ldx apart, out: ldo apart).
 * Called by every thread of a parallel region (`w` reserved for r's rows, p.in and
 * p.parts * p.rmax); ends with a barrier. Each output's sum runs over the rank in order, whatever
 * the rows, segments or threads: a row's result does not depend on its batch. */
void lora_team(const LoraProj& p, const LoraRows& r, const float* x, long ldx, int kind, const float* norm_w,
               float eps, float* out, long ldo, LoraWorkspace& w);

}  // namespace kvflow

#endif
