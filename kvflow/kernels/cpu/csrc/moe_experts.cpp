/* The routed experts of one Mixture-of-Experts layer for a step's rows, in one call
 * (kvflow/kernels/cpu/moe_experts.py), over float32 or bfloat16 weights (float_linear.cpp).
 *
 * The (row, slot) pairs are grouped by expert, each group in (row, slot) order; every expert that
 * received pairs runs its gate | up projection, then its down projection with silu(gate) * up
 * fused into the input, over its rows only -- the per-expert calls the per-layer path makes
 * (kvflow/layers/moe.py's grouped_experts), but in one parallel region, so the threads stay hot
 * from one expert to the next and the activations stay float32 between them. A row's output is
 * then the sum over its slots, in slot order, of weight x the expert's output: the same float32
 * operations as the per-layer path's weighting and sum.
 */
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "float_linear.h"

namespace {

thread_local kvflow::FloatWorkspace t_work;
thread_local std::vector<float> t_rows, t_gate_up, t_out;
thread_local std::vector<int> t_start, t_order, t_pos;

}  // namespace

extern "C" {

/* out[r] = sum over r's slots j, in slot order, of weights[r * top_k + j] * down_e(silu(gate_e(x_r)) *
 * up_e(x_r)), e = experts[r * top_k + j], for the experts held here: first_expert .. first_expert +
 * num_held - 1, whose gate | up and down weights are gate_up[i], down[i] (kvflow::FloatWeight handles;
 * gate_up [2 x width, hidden], down [hidden, width]). A pair routed to an expert held elsewhere adds
 * 0 (its rank adds it, expert parallelism). x: [rows, hidden] float32, rows ldx apart; out: [rows,
 * hidden] float32, contiguous. */
void kvflow_float_experts(void* const* gate_up, void* const* down, int num_held, int first_expert, const float* x,
                          long ldx, int rows, int top_k, const int64_t* experts, const float* weights, float* out,
                          int num_threads) {
  using kvflow::FloatWeight;
  const int pairs = rows * top_k;
  const int hidden = static_cast<const FloatWeight*>(gate_up[0])->k;
  const int width2 = static_cast<const FloatWeight*>(gate_up[0])->n;
  // start[i]..start[i + 1]: expert i's pairs in the grouped order; pos[p]: pair p's place there (-1:
  // held elsewhere); order[q]: the pair at place q.
  std::vector<int>&start = t_start, &order = t_order, &pos = t_pos;
  start.assign(num_held + 1, 0);
  pos.assign(pairs, -1);
  for (int p = 0; p < pairs; p++) {
    const long i = experts[p] - first_expert;
    if (i >= 0 && i < num_held) start[i + 1]++;
  }
  int most = 0;
  for (int i = 0; i < num_held; i++) {
    most = std::max(most, start[i + 1]);
    start[i + 1] += start[i];
  }
  const int held = start[num_held];
  order.resize(held);
  {
    std::vector<int> next(start.begin(), start.end() - 1);
    for (int p = 0; p < pairs; p++) {
      const long i = experts[p] - first_expert;
      if (i < 0 || i >= num_held) continue;
      pos[p] = next[i];
      order[next[i]++] = p;
    }
  }
  // The calling thread's buffers, named before the region: the team shares them.
  kvflow::FloatWorkspace& work = t_work;
  int kp = 0;
  for (int i = 0; i < num_held; i++)
    if (start[i + 1] > start[i])
      kp = std::max({kp, static_cast<const FloatWeight*>(gate_up[i])->kp, static_cast<const FloatWeight*>(down[i])->kp});
  if (most > 0) work.reserve(most, kp);
  t_rows.resize(std::max<size_t>(1, (size_t)held * hidden));
  t_gate_up.resize(std::max<size_t>(1, (size_t)most * width2));
  t_out.resize(std::max<size_t>(1, (size_t)held * hidden));
  float *grouped = t_rows.data(), *mid = t_gate_up.data(), *eout = t_out.data();
  const int* order_p = order.data();
  const int* pos_p = pos.data();
  const int* start_p = start.data();
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int q = 0; q < held; q++)
      std::memcpy(grouped + (long)q * hidden, x + (long)(order_p[q] / top_k) * ldx, sizeof(float) * hidden);
    for (int i = 0; i < num_held; i++) {
      const int m = start_p[i + 1] - start_p[i];
      if (m == 0) continue;  // (every thread sees the same counts: the team stays in step)
      kvflow::float_linear_team(*static_cast<const FloatWeight*>(gate_up[i]), grouped + (long)start_p[i] * hidden,
                                hidden, m, kvflow::NONE, nullptr, 0.f, nullptr, nullptr, 0, mid, work);
      kvflow::float_linear_team(*static_cast<const FloatWeight*>(down[i]), mid, width2, m, kvflow::SILU_MUL, nullptr,
                                0.f, nullptr, nullptr, 0, eout + (long)start_p[i] * hidden, work);
    }
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
      float* o = out + (long)r * hidden;
      for (int j = 0; j < top_k; j++) {
        const int p = r * top_k + j;
        const float w = weights[p];
        const float* e = pos_p[p] >= 0 ? eout + (long)pos_p[p] * hidden : nullptr;
        if (j == 0) {
          for (int c = 0; c < hidden; c++) o[c] = e ? e[c] * w : 0.f;
        } else if (e) {
          for (int c = 0; c < hidden; c++) o[c] += e[c] * w;
        } else {
          for (int c = 0; c < hidden; c++) o[c] += 0.f;  // (as the per-layer path adds its zero rows)
        }
      }
    }
  }
}

}  // extern "C"
