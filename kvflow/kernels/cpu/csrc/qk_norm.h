/* q/k RMSNorms in place in a qkv row, in the "linear" library (qk_norm.cpp): one compiled copy, so the
 * per-layer path (kvflow/kernels/cpu/qk_norm.py) and the native decode pass (decode_pass.cpp) give a
 * token the same bits. */
#ifndef KVFLOW_QK_NORM_H
#define KVFLOW_QK_NORM_H

namespace kvflow {

enum QkNorm { QK_NONE = 0, QK_PER_HEAD = 1, QK_WHOLE = 2 };

/* Rows of qkv ([q heads | k heads | v heads] of head_dim each, rows ld apart): q and k RMS-normed in
 * place (linear_ops.h's RMSNORM) with weights q_w, k_w -- per head (QK_PER_HEAD: every head over its
 * head_dim values, the weights head_dim long; Qwen3) or over the whole projection (QK_WHOLE: q over
 * num_heads x head_dim values, k over kv_heads x head_dim; OLMoE); v untouched. Called by every
 * thread of a parallel region; ends with a barrier. */
void qk_norm_team(float* qkv, long ld, int rows, int num_heads, int kv_heads, int head_dim, int mode,
                  const float* q_w, const float* k_w, float eps);

}  // namespace kvflow

#endif
