/* The decoder layers of an int8 Llama-family model for a decode-only step, in one call
 * (kvflow/kernels/cpu/int8_decode.py). Per layer:
 *
 *   qkv = W_qkv . rmsnorm(x) + b          int8_linear, RMSNORM prologue
 *   attn = attention(rotary(q), cache <- rotary(k), v)   decode_attention (attention.h)
 *   x' = x + W_o . attn                   int8_linear, residual
 *   x = x' + W_down . silu_mul(W_gate_up . rmsnorm(x'))
 *
 * The same functions as the per-layer path (Int8Kernel, CpuPagedAttention) in the same order, so a
 * token's result is bit for bit the one that path gives; what goes is the ~10 Python-level calls
 * per layer, most of a batch-1 step's time after the matmuls.
 */
#include "int8_linear.h"

#include <omp.h>

#include <algorithm>
#include <vector>

#include "attention.h"

namespace {

/* Mirrors kvflow/kernels/cpu/int8_decode.py (ctypes.Structure): keep the field order in step. */
struct DecoderShape {
  int num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size, window, kv_quant;
  float eps, scale;
};

struct DecoderLayer {
  const kvflow::PackedWeight *qkv, *o, *gate_up, *down;
  const float *qkv_bias, *input_norm, *post_norm;
  void* kv_cache;
  float* kv_scales;
};

thread_local std::vector<float> t_qkv, t_attn, t_mid, t_gate_up;

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
  using kvflow::int8_linear;
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
    int8_linear(*L.qkv, x, s->hidden, rows, kvflow::RMSNORM, L.input_norm, s->eps, L.qkv_bias, nullptr, 0, qkv,
                num_threads);
    phase(0);
#pragma omp parallel num_threads(num_threads)
    decode_attention(qkv, qkv_cols, cos_t, sin_t, L.kv_cache, L.kv_scales, s->kv_quant, slots, tables,
                     table_stride, context_lens, tokens, rows, s->num_heads, s->num_kv_heads, s->head_dim,
                     s->block_size, s->window, s->scale, attn);
    phase(1);
    int8_linear(*L.o, attn, q_cols, rows, kvflow::NONE, nullptr, 0.f, nullptr, x, s->hidden, mid, num_threads);
    phase(2);
    int8_linear(*L.gate_up, mid, s->hidden, rows, kvflow::RMSNORM, L.post_norm, s->eps, nullptr, nullptr, 0,
                gate_up, num_threads);
    phase(3);
    int8_linear(*L.down, gate_up, 2L * s->intermediate, rows, kvflow::SILU_MUL, nullptr, 0.f, nullptr, mid,
                s->hidden, x, num_threads);
    phase(4);
  }
  return 0;
}

}  // extern "C"
