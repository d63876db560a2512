/* The decoder layers of a Llama-family model for a decode-only step, in one call
 * (kvflow/kernels/cpu/decode_pass.py), over int8 (int8_linear.cpp) or float32 (f32_linear.cpp)
 * weights. Per layer:
 *
 *   qkv = W_qkv . rmsnorm(x) + b          linear, RMSNORM prologue
 *   attn = attention(rotary(q), cache <- rotary(k), v)   decode_attention (attention.h)
 *   x' = x + W_o . attn                   linear, residual
 *   x = x' + W_down . silu_mul(W_gate_up . rmsnorm(x'))
 *
 * The same functions as the per-layer path (Int8Kernel / NativeF32Kernel, CpuPagedAttention) in the
 * same order, so a token's result is bit for bit the one that path gives; what goes is the ~10
 * Python-level calls per layer, most of a small-batch step's time after the matmuls.
 */
#include <omp.h>

#include <algorithm>
#include <vector>

#include "attention.h"
#include "f32_linear.h"
#include "int8_linear.h"

namespace {

/* Mirrors kvflow/kernels/cpu/decode_pass.py (ctypes.Structure): keep the field order in step. */
struct DecoderShape {
  int num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size, window, kv_quant;
  float eps, scale;
};

/* Weights: kvflow::PackedWeight* (int8) or kvflow::F32Weight* (float32), per the entry point. */
struct DecoderLayer {
  const void *qkv, *o, *gate_up, *down;
  const float *qkv_bias, *input_norm, *post_norm;
  void* kv_cache;
  float* kv_scales;
};

thread_local std::vector<float> t_qkv, t_attn, t_mid, t_gate_up;

template <class Weight, class Linear>
int decode(Linear linear, const DecoderShape* s, const DecoderLayer* layers, float* x, int rows, const float* cos_t,
           const float* sin_t, const int64_t* slots, const int32_t* tables, long table_stride,
           const int32_t* context_lens, const int32_t* tokens, double* phase_seconds, int num_threads) {
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
  float *qkv = t_qkv.data(), *attn = t_attn.data(), *mid = t_mid.data(), *gate_up = t_gate_up.data();
  // phase_seconds (or null): wall time added per phase -- qkv, attention, o, gate_up, down.
  double t = phase_seconds ? omp_get_wtime() : 0.0;
  auto phase = [&](int i) {
    if (!phase_seconds) return;
    const double now = omp_get_wtime();
    phase_seconds[i] += now - t;
    t = now;
  };
  for (int l = 0; l < s->num_layers; l++) {
    const DecoderLayer& L = layers[l];
    const auto& w = [](const void* p) -> const Weight& { return *static_cast<const Weight*>(p); };
    linear(w(L.qkv), x, s->hidden, rows, RMSNORM, L.input_norm, s->eps, L.qkv_bias, nullptr, 0, qkv, num_threads);
    phase(0);
#pragma omp parallel num_threads(num_threads)
    decode_attention(qkv, qkv_cols, cos_t, sin_t, L.kv_cache, L.kv_scales, s->kv_quant, slots, tables,
                     table_stride, context_lens, tokens, rows, s->num_heads, s->num_kv_heads, s->head_dim,
                     s->block_size, s->window, s->scale, attn);
    phase(1);
    linear(w(L.o), attn, q_cols, rows, NONE, nullptr, 0.f, nullptr, x, s->hidden, mid, num_threads);
    phase(2);
    linear(w(L.gate_up), mid, s->hidden, rows, RMSNORM, L.post_norm, s->eps, nullptr, nullptr, 0, gate_up,
           num_threads);
    phase(3);
    linear(w(L.down), gate_up, 2L * s->intermediate, rows, SILU_MUL, nullptr, 0.f, nullptr, mid, s->hidden, x,
           num_threads);
    phase(4);
  }
  return 0;
}

}  // namespace

extern "C" {

/* x: [rows, hidden] hidden states in, the last layer's output out (the final norm is the caller's).
 * Row r is sequence r's new token at cache slot slots[r]; it attends to the first context_lens[r]
 * keys of its block table (tables + r * table_stride). cos, sin: [rows, head_dim] (sin with its
 * first half negated). phase_seconds: null, or 5 doubles that collect the time spent in each phase
 * (benchmarks). Returns 0, or -1 for attention shapes beyond the kernel's limits. */
int kvflow_int8_decode(const DecoderShape* s, const DecoderLayer* layers, float* x, int rows, const float* cos_t,
                       const float* sin_t, const int64_t* slots, const int32_t* tables, long table_stride,
                       const int32_t* context_lens, const int32_t* tokens, double* phase_seconds,
                       int num_threads) {
  return decode<kvflow::PackedWeight>(kvflow::int8_linear, s, layers, x, rows, cos_t, sin_t, slots, tables,
                                      table_stride, context_lens, tokens, phase_seconds, num_threads);
}

/* The same over float32 weights (layers hold kvflow::F32Weight handles). */
int kvflow_f32_decode(const DecoderShape* s, const DecoderLayer* layers, float* x, int rows, const float* cos_t,
                      const float* sin_t, const int64_t* slots, const int32_t* tables, long table_stride,
                      const int32_t* context_lens, const int32_t* tokens, double* phase_seconds, int num_threads) {
  return decode<kvflow::F32Weight>(kvflow::f32_linear, s, layers, x, rows, cos_t, sin_t, slots, tables,
                                   table_stride, context_lens, tokens, phase_seconds, num_threads);
}

}  // extern "C"
