/* q/k RMSNorms in place (qk_norm.h): Qwen3's per-head norms and OLMoE's whole-projection ones, with
 * the fused linears' RMSNorm (linear_ops.h's prologue), compiled without reassociation
 * (kvflow/kernels/cpu/native.py) so its sums are the same wherever it is called from. */
#include "qk_norm.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "linear_ops.h"

namespace kvflow {

namespace {

/* n values of x normed in place (through a copy: the prologue reads and writes separate rows). */
inline void norm_in_place(float* x, int n, const float* w, float eps, std::vector<float>& tmp) {
  tmp.resize(std::max<size_t>(tmp.size(), n));
  std::memcpy(tmp.data(), x, sizeof(float) * n);
  prologue(RMSNORM, tmp.data(), n, w, eps, x);
}

thread_local std::vector<float> t_tmp;

}  // namespace

void qk_norm_team(float* qkv, long ld, int rows, int num_heads, int kv_heads, int head_dim, int mode,
                  const float* q_w, const float* k_w, float eps) {
#pragma omp for schedule(static)
  for (int r = 0; r < rows; r++) {
    float* q = qkv + (long)r * ld;
    float* k = q + (long)num_heads * head_dim;
    std::vector<float>& tmp = t_tmp;  // (each thread's own)
    if (mode == QK_PER_HEAD) {
      for (int h = 0; h < num_heads; h++) norm_in_place(q + (long)h * head_dim, head_dim, q_w, eps, tmp);
      for (int h = 0; h < kv_heads; h++) norm_in_place(k + (long)h * head_dim, head_dim, k_w, eps, tmp);
    } else if (mode == QK_WHOLE) {
      norm_in_place(q, num_heads * head_dim, q_w, eps, tmp);
      norm_in_place(k, kv_heads * head_dim, k_w, eps, tmp);
    }
  }
}

}  // namespace kvflow

extern "C" {

/* kvflow::qk_norm_team in a parallel region of its own. */
void kvflow_qk_norm(float* qkv, long ld, int rows, int num_heads, int kv_heads, int head_dim, int mode,
                    const float* q_w, const float* k_w, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads)
  kvflow::qk_norm_team(qkv, ld, rows, num_heads, kv_heads, head_dim, mode, q_w, k_w, eps);
}

}  // extern "C"
