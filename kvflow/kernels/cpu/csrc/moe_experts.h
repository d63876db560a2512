/* The routed experts' C++ interface inside the "linear" library (moe_experts.cpp, decode_pass.cpp). */
#ifndef KVFLOW_MOE_EXPERTS_H
#define KVFLOW_MOE_EXPERTS_H

#include <cstdint>
#include <vector>

#include "float_linear.h"

namespace kvflow {

/* A call's grouping of the (row, slot) pairs and its buffers, shared by the team: `reserve`-free,
 * float_experts_team sizes it (one thread) before using it. */
struct ExpertsWorkspace {
  FloatWorkspace work;
  std::vector<float> rows, mid, out;  // grouped input rows, gate | up outputs, expert outputs
  std::vector<int> start, order, pos;
};

/* out[r] = sum over r's slots j, in slot order, of weights[r * top_k + j] *
 * down_e(silu(gate_e(pre(x_r))) * up_e(pre(x_r))), e = experts[r * top_k + j], for the experts held
 * here (first_expert .. first_expert + num_held - 1: gate_up[i], down[i], FloatWeight handles); a
 * pair routed to an expert held elsewhere adds 0. pre: `kind` (NONE, or RMSNORM with norm_w, eps)
 * applied to each expert's rows by its gate | up projection. Called by every thread of a parallel
 * region; ends with a barrier. */
void float_experts_team(const void* const* gate_up, const void* const* down, int num_held, int first_expert,
                        const float* x, long ldx, int rows, int top_k, const int64_t* experts, const float* weights,
                        int kind, const float* norm_w, float eps, float* out, ExpertsWorkspace& ws);

/* One routed layer as the native decode pass (decode_pass.cpp) runs it: its router and experts
 * (FloatWeight handles; the router float32 [num_experts, hidden]), and Qwen2-MoE's shared expert
 * (gate | up, down, and its gate [1, hidden] in float32) or nulls. `slot`: the layer's place among
 * the model's routed layers (where its chosen experts go). Mirrored by
 * kvflow/kernels/cpu/decode_pass.py (ctypes.Structure): keep the field order in step. */
struct MoeLayer {
  const void* router;
  void* const* gate_up;
  void* const* down;
  const void *shared_gate_up, *shared_down, *shared_gate;
  int num_experts, top_k, renormalize, slot;
};

struct MoeWorkspace {
  ExpertsWorkspace experts;
  FloatWorkspace work;  // the router's and the shared expert's prologue rows
  std::vector<float> logits, weights, routed, shared_mid, shared_out, shared_gate;
  int tie = 0;
};

/* out[r] = x[r] + the layer's feed-forward of rmsnorm(x[r]) (norm_w, eps): the router's logits
 * (float32 sums), softmax over the experts, the top_k (renormalised if `renormalize`), the experts
 * (float_experts_team), plus sigmoid(shared gate) x the shared expert where there is one. Row r's
 * experts go to chosen[r * top_k ..], best first. Returns 1, with `out` unwritten, where a row's
 * top-k probabilities tie with each other or with an expert left out (which expert a tie goes to is
 * torch.topk's choice, not this function's: the caller re-runs the step through torch), else 0.
 * Called by every thread of a parallel region; ends with a barrier. */
int moe_layer_team(const MoeLayer& L, const float* norm_w, float eps, const float* x, int rows, float* out,
                   int64_t* chosen, MoeWorkspace& ws);

}  // namespace kvflow

#endif
