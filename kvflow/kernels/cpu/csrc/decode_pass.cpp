/* The decoder layers of a Llama-family model for a decode step (one new token per sequence, or a few:
 * a decode and the drafts it verifies), in one call
 * (kvflow/kernels/cpu/decode_pass.py), over int8 (int8_linear.cpp), float32 or bfloat16 (float_linear.cpp) or
 * block-quantized (block_linear.cpp: GGUF formats) weights. Per layer:
 *
 *   qkv = W_qkv . rmsnorm(x) + b          linear, RMSNORM prologue (then, Qwen3 / OLMoE, q/k norms: qk_norm.cpp)
 *   attn = attention(rotary(q), cache <- rotary(k), v)   decode_attention (attention.h; no rotary on a NoPE layer)
 *   x' = x + W_o . attn                   linear, residual
 *   x = x' + W_down . silu_mul(W_gate_up . rmsnorm(x'))
 *     or, for a routed layer, x = x' + moe(rmsnorm(x'))   moe_layer_team (moe_experts.cpp)
 *
 * The same functions as the per-layer path (Int8Kernel / NativeFloatKernel, CpuPagedAttention) in the
 * same order, so a token's result is bit for bit the one that path gives; what goes is the ~10
 * Python-level calls per layer, most of a small-batch step's time after the matmuls. (A routed
 * layer's router runs here on the float kernel, where the per-layer path routes in torch as HF
 * does: float32 sums in another order, so close to that path, not bit for bit; a tie in a top-k
 * ends the call with 1, for the caller to run the step through torch.)
 *
 * With LoRA adapters (a LoraStep), each projection's output then gets its adapter rows' scaling * B (A x)
 * from lora_team (lora.cpp), the same function the per-layer path calls: rows of adapters and of the
 * base model share the pass.
 */
#include <omp.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "attention.h"
#include "block_linear.h"
#include "float_linear.h"
#include "int8_linear.h"
#include "lora.h"
#include "moe_experts.h"
#include "qk_norm.h"

namespace {

/* Mirrors kvflow/kernels/cpu/decode_pass.py (ctypes.Structure): keep the field order in step. */
struct DecoderShape {
  int num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size, window;
  int kv_format;  // KV_F32, KV_INT8, KV_BF16, KV_FP8_E4M3, KV_FP8_E5M2 or KV_INT4 (attention.h)
  float eps, scale;
  int qk_norm;  // kvflow::QkNorm: q/k RMSNorms after the qkv projection (layers' q_norm, k_norm)
};

/* Weights: kvflow::PackedWeight* (int8), kvflow::FloatWeight* (float32 / bf16) or kvflow::BlockWeight*, per
 * the entry point. */
struct DecoderLayer {
  const void *qkv, *o, *gate_up, *down;
  const float *qkv_bias, *input_norm, *post_norm;
  void* kv_cache;
  float* kv_scales;
  const kvflow::MoeLayer* moe;  // a routed layer's feed-forward (gate_up, down unused), or null
  const float *q_norm, *k_norm;  // with DecoderShape::qk_norm: the norms' float32 weights
  int rope;  // 0: the layer does not rotate q and k (SmolLM3's NoPE layers): it gets cos 1, sin 0
};

/* A step's adapters (kvflow/kernels/cpu/decode_pass.py mirrors it): per layer its qkv, o, gate_up and
 * down projections' stacked adapters (projs[4 * layer + i]; a null `a`: that projection takes none),
 * the rows under adapters, and the widest parts * rmax of any projection. */
struct LoraStep {
  const kvflow::LoraProj* projs;
  kvflow::LoraRows rows;
  int max_tk;
};

thread_local kvflow::LoraWorkspace t_lora;
thread_local std::vector<float> t_qkv, t_attn, t_mid, t_gate_up, t_segments, t_cos_one, t_sin_zero;
thread_local kvflow::MoeWorkspace t_moe;

/* The int8, float and block linears, each with its workspace sized for every projection of a layer. */
struct Int8 {
  using Weight = kvflow::PackedWeight;
  kvflow::Int8Workspace work;
  void reserve(const DecoderShape* s, int rows, int nth, int qkv_cols) {
    for (const auto& [k, n] : {std::pair{s->hidden, qkv_cols}, {s->num_heads * s->head_dim, s->hidden},
                               {s->hidden, 2 * s->intermediate}, {s->intermediate, s->hidden}})
      work.reserve(rows, k, n, nth);
  }
  void operator()(const void* w, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                  const float* bias, const float* residual, long ld_res, float* out) {
    kvflow::int8_linear_team(*static_cast<const Weight*>(w), x, ldx, m, kind, norm_w, eps, bias, residual, ld_res,
                             out, work);
  }
};

struct Float {
  using Weight = kvflow::FloatWeight;
  kvflow::FloatWorkspace work;
  void reserve(const DecoderShape* s, int rows, int, int) {
    const int widest = std::max({s->hidden, s->num_heads * s->head_dim, s->intermediate});
    work.reserve(rows, widest + 1);  // (kp: k, or k rounded up to even)
  }
  void operator()(const void* w, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                  const float* bias, const float* residual, long ld_res, float* out) {
    kvflow::float_linear_team(*static_cast<const Weight*>(w), x, ldx, m, kind, norm_w, eps, bias, residual, ld_res,
                            out, work);
  }
};

struct Block {
  using Weight = kvflow::BlockWeight;
  kvflow::BlockWorkspace work;
  void reserve(const DecoderShape* s, int rows, int nth, int) {
    work.reserve(rows, std::max({s->hidden, s->num_heads * s->head_dim, s->intermediate}), nth);
  }
  void operator()(const void* w, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                  const float* bias, const float* residual, long ld_res, float* out) {
    kvflow::block_linear_team(*static_cast<const Weight*>(w), x, ldx, m, kind, norm_w, eps, bias, residual, ld_res,
                              out, work);
  }
};

thread_local Int8 t_int8;
thread_local Float t_float;
thread_local Block t_block;

/* The whole pass is one parallel region: every linear and the attention are team functions that
 * end with a barrier, so the threads stay hot from one projection to the next instead of being
 * forked and joined ~150 times a step. */
template <class Linear>
int decode(Linear& linear, const DecoderShape* s, const DecoderLayer* layers, float* x, int rows, const float* cos_t,
           const float* sin_t, const int64_t* slots, const int32_t* tables, long table_stride,
           const int32_t* context_lens, const int32_t* tokens, double* phase_seconds, int num_threads,
           const LoraStep* lora, int64_t* routed) {
  using kvflow::NONE;
  using kvflow::RMSNORM;
  using kvflow::SILU_MUL;
  if (check_shape(s->num_heads, s->num_kv_heads, s->head_dim)) return -1;
  const int q_cols = s->num_heads * s->head_dim;
  const int qkv_cols = q_cols + 2 * s->num_kv_heads * s->head_dim;
  t_qkv.resize((size_t)rows * qkv_cols);
  t_attn.resize((size_t)rows * q_cols);
  t_mid.resize((size_t)rows * s->hidden);
  t_gate_up.resize((size_t)rows * 2 * s->intermediate);
  linear.reserve(s, rows, num_threads, qkv_cols);
  // A layer without rotary rotates by the identity: x * 1 + y * 0 is x, the bits the per-layer path
  // keeps by not rotating (the tables made only for a model that has such layers).
  if (std::any_of(layers, layers + s->num_layers, [](const DecoderLayer& L) { return !L.rope; })) {
    t_cos_one.assign((size_t)rows * s->head_dim, 1.f);
    t_sin_zero.assign((size_t)rows * s->head_dim, 0.f);
  }
  const float *cos_one = t_cos_one.data(), *sin_zero = t_sin_zero.data();
  if (lora && lora->rows.num_segments == 0) lora = nullptr;
  kvflow::LoraWorkspace& lora_work = t_lora;  // (the calling thread's: the team shares it)
  if (lora)
    lora_work.reserve(lora->rows.seg_start[lora->rows.num_segments],
                      std::max({s->hidden, s->num_heads * s->head_dim, s->intermediate}), lora->max_tk);
  // out += the adapter rows' LoRA of projection i of layer l (its input x, pre-op `kind`).
  auto adapt = [&](int l, int i, const float* in, long ld_in, int kind, const float* norm_w, float* out, long ld_out) {
    if (!lora || !lora->projs[4 * l + i].a) return;
    kvflow::lora_team(lora->projs[4 * l + i], lora->rows, in, ld_in, kind, norm_w, s->eps, out, ld_out, lora_work);
  };
  float *qkv = t_qkv.data(), *attn = t_attn.data(), *mid = t_mid.data(), *gate_up = t_gate_up.data();
  kvflow::MoeWorkspace& moe_work = t_moe;
  std::vector<float>* segments = &t_segments;  // (the calling thread's: attention's key segments)
  int status = 0;
  // phase_seconds (or null): wall time added per phase -- qkv, attention, o, gate_up, down -- by
  // the first thread, after the barrier that ends each phase.
  double t = phase_seconds ? omp_get_wtime() : 0.0;
  auto phase = [&](int i) {
    if (!phase_seconds || omp_get_thread_num() != 0) return;
    const double now = omp_get_wtime();
    phase_seconds[i] += now - t;
    t = now;
  };
#pragma omp parallel num_threads(num_threads)
  for (int l = 0; l < s->num_layers; l++) {
    const DecoderLayer& L = layers[l];
    linear(L.qkv, x, s->hidden, rows, RMSNORM, L.input_norm, s->eps, L.qkv_bias, nullptr, 0, qkv);
    adapt(l, 0, x, s->hidden, RMSNORM, L.input_norm, qkv, qkv_cols);
    if (s->qk_norm)
      kvflow::qk_norm_team(qkv, qkv_cols, rows, s->num_heads, s->num_kv_heads, s->head_dim, s->qk_norm, L.q_norm,
                           L.k_norm, s->eps);
    phase(0);
    decode_attention(qkv, qkv_cols, L.rope ? cos_t : cos_one, L.rope ? sin_t : sin_zero, L.kv_cache, L.kv_scales,
                     s->kv_format, slots, tables,
                     table_stride, context_lens, tokens, rows, s->num_heads, s->num_kv_heads, s->head_dim,
                     s->block_size, s->window, s->scale, attn, segments);  // (ends with its loop's barrier)
    phase(1);
    linear(L.o, attn, q_cols, rows, NONE, nullptr, 0.f, nullptr, x, s->hidden, mid);
    adapt(l, 1, attn, q_cols, NONE, nullptr, mid, s->hidden);
    phase(2);
    if (L.moe) {
      if (kvflow::moe_layer_team(*L.moe, L.post_norm, s->eps, mid, rows, x,
                                 routed + (long)L.moe->slot * rows * L.moe->top_k, moe_work)) {
        if (omp_get_thread_num() == 0) status = 1;
        break;  // (every thread saw the tie after the same barrier)
      }
      phase(4);
      continue;
    }
    linear(L.gate_up, mid, s->hidden, rows, RMSNORM, L.post_norm, s->eps, nullptr, nullptr, 0, gate_up);
    adapt(l, 2, mid, s->hidden, RMSNORM, L.post_norm, gate_up, 2L * s->intermediate);
    phase(3);
    linear(L.down, gate_up, 2L * s->intermediate, rows, SILU_MUL, nullptr, 0.f, nullptr, mid, s->hidden, x);
    adapt(l, 3, gate_up, 2L * s->intermediate, SILU_MUL, nullptr, x, s->hidden);
    phase(4);
  }
  return status;
}

}  // namespace

extern "C" {

/* x: [rows, hidden] hidden states in, the last layer's output out (the final norm is the caller's).
 * Row r is a new token at cache slot slots[r]; it attends to the first context_lens[r]
 * keys of its block table (tables + r * table_stride). cos, sin: [rows, head_dim] (sin with its
 * first half negated). phase_seconds: null, or 5 doubles that collect the time spent in each phase
 * (benchmarks). lora: null, or the step's adapters and the rows that run under them. routed: where
 * routed layers put each row's chosen experts ([routed layers, rows, top_k] int64), or null for a
 * model without any. Returns 0; -1 for attention shapes beyond the kernel's limits; 1 for a tie in
 * a routed layer's top-k (the layers before it have run: x and the cache hold their work). */
int kvflow_int8_decode(const DecoderShape* s, const DecoderLayer* layers, float* x, int rows, const float* cos_t,
                       const float* sin_t, const int64_t* slots, const int32_t* tables, long table_stride,
                       const int32_t* context_lens, const int32_t* tokens, double* phase_seconds,
                       int num_threads, const LoraStep* lora, int64_t* routed) {
  return decode(t_int8, s, layers, x, rows, cos_t, sin_t, slots, tables, table_stride, context_lens, tokens,
                phase_seconds, num_threads, lora, routed);
}

/* The same over float32 or bfloat16 weights (layers hold kvflow::FloatWeight handles); activations in
 * float32 either way (a bf16 model's hidden states are widened by the caller). */
int kvflow_float_decode(const DecoderShape* s, const DecoderLayer* layers, float* x, int rows, const float* cos_t,
                      const float* sin_t, const int64_t* slots, const int32_t* tables, long table_stride,
                      const int32_t* context_lens, const int32_t* tokens, double* phase_seconds, int num_threads,
                      const LoraStep* lora, int64_t* routed) {
  return decode(t_float, s, layers, x, rows, cos_t, sin_t, slots, tables, table_stride, context_lens, tokens,
                phase_seconds, num_threads, lora, routed);
}

/* The same over block-quantized weights (layers hold kvflow::BlockWeight handles). */
int kvflow_block_decode(const DecoderShape* s, const DecoderLayer* layers, float* x, int rows, const float* cos_t,
                        const float* sin_t, const int64_t* slots, const int32_t* tables, long table_stride,
                        const int32_t* context_lens, const int32_t* tokens, double* phase_seconds,
                        int num_threads, const LoraStep* lora, int64_t* routed) {
  return decode(t_block, s, layers, x, rows, cos_t, sin_t, slots, tables, table_stride, context_lens, tokens,
                phase_seconds, num_threads, lora, routed);
}

}  // extern "C"
