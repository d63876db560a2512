/* The routed experts of one Mixture-of-Experts layer for a step's rows, in one call
 * (kvflow/kernels/cpu/moe_experts.py), over float32 or bfloat16 weights (float_linear.cpp).
 *
 * The (row, slot) pairs are grouped by expert, each group in (row, slot) order; every expert that
 * received pairs runs its gate | up projection, then its down projection with silu(gate) * up
 * fused into the input, over its rows only -- the per-expert calls the per-layer path makes
 * (kvflow/layers/moe.py's grouped_experts), but in one parallel region, so the threads stay hot
 * from one expert to the next and the activations stay float32 between them. A row's output is
 * then the sum over its slots, in slot order, of weight x the expert's output: the same float32
 * operations as the per-layer path's weighting and sum. The native decode pass (decode_pass.cpp)
 * runs the same team function inside its own parallel region.
 */
#include "moe_experts.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace kvflow {

void float_experts_team(const void* const* gate_up, const void* const* down, int num_held, int first_expert,
                        const float* x, long ldx, int rows, int top_k, const int64_t* experts, const float* weights,
                        int kind, const float* norm_w, float eps, float* out, ExpertsWorkspace& ws) {
  const int pairs = rows * top_k;
  const int hidden = static_cast<const FloatWeight*>(gate_up[0])->k;
  const int width2 = static_cast<const FloatWeight*>(gate_up[0])->n;
  // start[i]..start[i + 1]: expert i's pairs in the grouped order; pos[p]: pair p's place there (-1:
  // held elsewhere); order[q]: the pair at place q. Planned by one thread, read by all after its
  // barrier.
#pragma omp single
  {
    std::vector<int>&start = ws.start, &order = ws.order, &pos = ws.pos;
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
    std::vector<int> next(start.begin(), start.end() - 1);
    for (int p = 0; p < pairs; p++) {
      const long i = experts[p] - first_expert;
      if (i < 0 || i >= num_held) continue;
      pos[p] = next[i];
      order[next[i]++] = p;
    }
    int kp = 0;
    for (int i = 0; i < num_held; i++)
      if (start[i + 1] > start[i])
        kp = std::max({kp, static_cast<const FloatWeight*>(gate_up[i])->kp,
                       static_cast<const FloatWeight*>(down[i])->kp});
    if (most > 0) ws.work.reserve(most, kp);
    ws.rows.resize(std::max<size_t>(1, (size_t)held * hidden));
    ws.mid.resize(std::max<size_t>(1, (size_t)most * width2));
    ws.out.resize(std::max<size_t>(1, (size_t)held * hidden));
  }
  const int held = ws.start[num_held];
  float *grouped = ws.rows.data(), *mid = ws.mid.data(), *eout = ws.out.data();
  const int* order = ws.order.data();
  const int* pos = ws.pos.data();
  const int* start = ws.start.data();
#pragma omp for schedule(static)
  for (int q = 0; q < held; q++)
    std::memcpy(grouped + (long)q * hidden, x + (long)(order[q] / top_k) * ldx, sizeof(float) * hidden);
  for (int i = 0; i < num_held; i++) {
    const int m = start[i + 1] - start[i];
    if (m == 0) continue;  // (every thread sees the same counts: the team stays in step)
    float_linear_team(*static_cast<const FloatWeight*>(gate_up[i]), grouped + (long)start[i] * hidden, hidden, m,
                      kind, norm_w, eps, nullptr, nullptr, 0, mid, ws.work);
    float_linear_team(*static_cast<const FloatWeight*>(down[i]), mid, width2, m, SILU_MUL, nullptr, 0.f, nullptr,
                      nullptr, 0, eout + (long)start[i] * hidden, ws.work);
  }
#pragma omp for schedule(static)
  for (int r = 0; r < rows; r++) {
    float* o = out + (long)r * hidden;
    for (int j = 0; j < top_k; j++) {
      const int p = r * top_k + j;
      const float w = weights[p];
      const float* e = pos[p] >= 0 ? eout + (long)pos[p] * hidden : nullptr;
      if (j == 0) {
        for (int c = 0; c < hidden; c++) o[c] = e ? e[c] * w : 0.f;
      } else if (e) {
        for (int c = 0; c < hidden; c++) o[c] += e[c] * w;
      } else {
        for (int c = 0; c < hidden; c++) o[c] += 0.f;  // (as the per-layer path adds its zero rows)
      }
    }
  }
  // (the loop's implicit barrier ends the call)
}

int moe_layer_team(const MoeLayer& L, const float* norm_w, float eps, const float* x, int rows, float* out,
                   int64_t* chosen, MoeWorkspace& ws) {
  const FloatWeight& router = *static_cast<const FloatWeight*>(L.router);
  const auto* sgu = static_cast<const FloatWeight*>(L.shared_gate_up);
  const auto* sd = static_cast<const FloatWeight*>(L.shared_down);
  const auto* sg = static_cast<const FloatWeight*>(L.shared_gate);
  const int n_exp = L.num_experts, k = L.top_k, hidden = router.k;
#pragma omp single
  {
    ws.logits.resize((size_t)rows * n_exp);
    ws.weights.resize((size_t)rows * k);
    ws.routed.resize((size_t)rows * hidden);
    int kp = router.kp;
    if (sgu) {
      kp = std::max({kp, sgu->kp, sd->kp, sg->kp});
      ws.shared_mid.resize((size_t)rows * sgu->n);
      ws.shared_out.resize((size_t)rows * hidden);
      ws.shared_gate.resize(rows);
    }
    ws.work.reserve(rows, kp);
    ws.tie = 0;
  }
  float *logits = ws.logits.data(), *weights = ws.weights.data(), *routed = ws.routed.data();
  float_linear_team(router, x, hidden, rows, RMSNORM, norm_w, eps, nullptr, nullptr, 0, logits, ws.work);
  // softmax over the experts, then the top-k of those probabilities (as HF's routers select).
#pragma omp for schedule(static)
  for (int r = 0; r < rows; r++) {
    float* p = logits + (long)r * n_exp;
    int64_t* ids = chosen + (long)r * k;
    float* w = weights + (long)r * k;
    float top = p[0], sum = 0.f;
    for (int e = 1; e < n_exp; e++) top = std::max(top, p[e]);
    for (int e = 0; e < n_exp; e++) sum += p[e] = std::exp(p[e] - top);
    for (int e = 0; e < n_exp; e++) p[e] /= sum;
    float picked = 0.f;
    for (int j = 0; j < k; j++) {
      int best = -1;
      for (int e = 0; e < n_exp; e++) {
        if (std::find(ids, ids + j, e) != ids + j) continue;
        if (best < 0 || p[e] > p[best]) best = e;
      }
      ids[j] = best;
      w[j] = p[best];
      picked += p[best];
      int equal = 0;  // a chosen probability met twice: a tie torch.topk breaks its own way
      for (int e = 0; e < n_exp; e++) equal += p[e] == p[best];
      if (equal > 1) {
#pragma omp atomic write
        ws.tie = 1;
      }
    }
    if (L.renormalize)
      for (int j = 0; j < k; j++) w[j] /= picked;
  }
  if (ws.tie) return 1;  // (read after the loop's barrier: every thread returns here)
  float_experts_team(L.gate_up, L.down, n_exp, 0, x, hidden, rows, k, chosen, weights, RMSNORM, norm_w, eps, routed,
                     ws.experts);
  float *shared_out = ws.shared_out.data(), *gate = ws.shared_gate.data();
  if (sgu) {
    float_linear_team(*sgu, x, hidden, rows, RMSNORM, norm_w, eps, nullptr, nullptr, 0, ws.shared_mid.data(),
                      ws.work);
    float_linear_team(*sd, ws.shared_mid.data(), sgu->n, rows, SILU_MUL, nullptr, 0.f, nullptr, nullptr, 0,
                      shared_out, ws.work);
    float_linear_team(*sg, x, hidden, rows, RMSNORM, norm_w, eps, nullptr, nullptr, 0, gate, ws.work);
  }
#pragma omp for schedule(static)
  for (int r = 0; r < rows; r++) {
    const float* in = x + (long)r * hidden;
    const float* e = routed + (long)r * hidden;
    float* o = out + (long)r * hidden;
    if (sgu) {
      const float g = 1.f / (1.f + std::exp(-gate[r]));
      const float* s = shared_out + (long)r * hidden;
      for (int c = 0; c < hidden; c++) o[c] = in[c] + (e[c] + g * s[c]);
    } else {
      for (int c = 0; c < hidden; c++) o[c] = in[c] + e[c];
    }
  }
  return 0;
}

}  // namespace kvflow

namespace {

thread_local kvflow::ExpertsWorkspace t_experts;

}  // namespace

extern "C" {

/* kvflow::float_experts_team over x as it is (kind NONE), in a parallel region of its own: out[r]
 * the weighted sum of r's experts held here. x: [rows, hidden] float32, rows ldx apart; out: [rows,
 * hidden] float32, contiguous. */
void kvflow_float_experts(void* const* gate_up, void* const* down, int num_held, int first_expert, const float* x,
                          long ldx, int rows, int top_k, const int64_t* experts, const float* weights, float* out,
                          int num_threads) {
  // The calling thread's workspace, named before the region: inside it `t_experts` is each thread's.
  kvflow::ExpertsWorkspace& ws = t_experts;
#pragma omp parallel num_threads(num_threads)
  kvflow::float_experts_team(gate_up, down, num_held, first_expert, x, ldx, rows, top_k, experts, weights,
                             kvflow::NONE, nullptr, 0.f, out, ws);
}

}  // extern "C"
