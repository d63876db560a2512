/* W8A8 linear through FBGEMM, one call per projection (kvflow/kernels/cpu/int8_linear.py, Int8Kernel).
 *
 * out = residual + (W_q . quant(pre(x))) * row_scale * w_scale + bias, where
 *   pre(x) is x, rmsnorm(x) * norm_w, or silu(x[:, :k]) * x[:, k:] (the op that feeds the projection),
 *   quant(v) = round(127 * v / max|v|) + 128, one scale per row (per token), so a token gets the full
 *   8-bit range whatever its batch holds and its result does not depend on the batch,
 *   W_q is int8 with one symmetric scale per output channel, packed once by FBGEMM.
 * The int8 GEMM and the per-channel dequantization are FBGEMM's (PackAWithRowOffset, PackBMatrix,
 * ReQuantizeForFloat, fbgemmPacked: the kernels behind torch's quantized linear, called directly so a
 * projection is one call with its prologue and epilogue instead of five torch ops).
 *
 * Every row is computed by the same code in the same order whatever the number of rows: reductions
 * use LANES fixed partial sums and exp goes through one LANES-wide path for every element.
 */
#include "int8_linear.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

namespace kvflow {
namespace {

constexpr float MIN_SCALE = 1e-30f;

using Dequantize = fbgemm::ReQuantizeForFloat<false, fbgemm::QuantizationGranularity::OUT_CHANNEL>;

inline float absmax(const float* __restrict v, int n) {
  float m[LANES] = {0};
  int i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; j++) m[j] = std::max(m[j], std::fabs(v[i + j]));
  for (int j = 0; i + j < n; j++) m[j] = std::max(m[j], std::fabs(v[i + j]));
  float r = MIN_SCALE;
  for (int j = 0; j < LANES; j++) r = std::max(r, m[j]);
  return r;
}

/* One row: pre-op, row scale, quantization to levels + 1 +- levels. */
inline float quantize_row(int kind, const float* x, int k, const float* norm_w, float eps, int levels, float* v,
                          uint8_t* q) {
  prologue(kind, x, k, norm_w, eps, v);
  const float r = absmax(v, k);
  const float inv = (float)levels / r, zero = (float)(levels + 1);
  for (int c = 0; c < k; c++) q[c] = (uint8_t)(std::nearbyint(v[c] * inv) + zero);
  return r;
}

// Per calling thread (the engine's), reused across calls: large prefill buffers would otherwise be
// mapped and faulted in on every call.
thread_local Int8Workspace t_work;

}  // namespace

void Int8Workspace::reserve(int m, int k, int n, int num_threads) {
  q.resize(std::max(q.size(), (size_t)m * k));
  v.resize(std::max(v.size(), (size_t)num_threads * k));
  r.resize(std::max(r.size(), (size_t)m));
  acc.resize(std::max(acc.size(), (size_t)m * n));
}

void int8_linear_team(const PackedWeight& p, const float* x, long ldx, int m, int kind, const float* norm_w,
                      float eps, const float* bias, const float* residual, long ld_res, float* out,
                      Int8Workspace& w) {
  const int n = p.n, k = p.k;
  const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
  uint8_t* q = w.q.data();
  float* r = w.r.data();
  fbgemm::DoNothing<float, float> done;
  Dequantize dequantize(done, 1.f / (float)p.levels, p.scale.data(), p.levels + 1, nullptr, nullptr,
                        p.col_offsets.data(), nullptr, n);
#pragma omp for schedule(static)
  for (int i = 0; i < m; i++)
    r[i] = quantize_row(kind, x + i * ldx, k, norm_w, eps, p.levels, w.v.data() + (long)tid * k, q + (long)i * k);
  fbgemm::PackAWithRowOffset<uint8_t> a(fbgemm::matrix_op_t::NoTranspose, m, k, q, k, nullptr, 1);
  fbgemm::fbgemmPacked(a, *p.packed, out, w.acc.data(), n, dequantize, tid, nth);
#pragma omp barrier
  if (m >= nth) {
#pragma omp for schedule(static)
    for (int i = 0; i < m; i++)
      epilogue(out + (long)i * n, 0, n, r[i], bias, residual ? residual + i * ld_res : nullptr);
  } else {  // few rows: split the columns
    const int chunk = (n + nth - 1) / nth, j0 = std::min(n, tid * chunk), j1 = std::min(n, j0 + chunk);
    for (int i = 0; i < m; i++)
      epilogue(out + (long)i * n, j0, j1, r[i], bias, residual ? residual + i * ld_res : nullptr);
#pragma omp barrier
  }
}

void int8_linear(const PackedWeight& p, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                 const float* bias, const float* residual, long ld_res, float* out, int num_threads) {
  if (m <= 0) return;
  // The calling thread's workspace, named before the region: inside it `t_work` is each thread's own.
  Int8Workspace& work = t_work;
  work.reserve(m, p.k, p.n, num_threads);
#pragma omp parallel num_threads(num_threads)
  int8_linear_team(p, x, ldx, m, kind, norm_w, eps, bias, residual, ld_res, out, work);
}


}  // namespace kvflow

extern "C" {

/* w: int8 [n, k] row-major, scale: [n] (w ~= w_q * scale); activations are quantized to 2 * levels + 1
 * values (127: 8 bits; 63: 7 bits, where FBGEMM's AVX2 kernel would saturate int16 pair sums).
 * Returns a handle, or null when FBGEMM does not support this CPU. */
void* kvflow_int8_pack(const int8_t* w, const float* scale, int n, int k, int levels) {
  if (!fbgemm::fbgemmSupportedCPU()) return nullptr;
  auto* p = new kvflow::PackedWeight{nullptr, n, k, levels, std::vector<float>(n), std::vector<int32_t>(n, 0)};
  for (int j = 0; j < n; j++) {
    p->scale[j] = scale[j];
    int32_t s = 0;
    for (int c = 0; c < k; c++) s += w[(long)j * k + c];
    p->col_offsets[j] = s;
  }
  // The packed matrix in our memory (huge pages, as the other kernels' weights: csrc/weight_memory.h)
  // rather than FBGEMM's own heap allocation.
  p->buf_bytes = (size_t)fbgemm::PackBMatrix<int8_t>::packedBufferSize(k, n);
  p->buf = kvflow::alloc_weights(p->buf_bytes);
  if (!p->buf) {
    delete p;
    return nullptr;
  }
  p->packed = std::make_unique<fbgemm::PackBMatrix<int8_t>>(fbgemm::matrix_op_t::Transpose, k, n, w, k,
                                                            static_cast<int8_t*>(p->buf), 1);
  return p;
}

void kvflow_int8_free(void* handle) { delete static_cast<kvflow::PackedWeight*>(handle); }

/* The packed weight back as int8 [n, k] and its scales [n]. */
void kvflow_int8_unpack(void* handle, int8_t* w, float* scale) {
  auto& p = *static_cast<kvflow::PackedWeight*>(handle);
  p.packed->unpack(w);
  std::copy(p.scale.begin(), p.scale.end(), scale);
}

/* out[m, n] = residual + W . pre(x) + bias (see the top of the file). x rows are ldx apart and hold
 * k values (2k for SILU_MUL: gate then up); residual (or null) rows are ld_res apart; out is dense. */
void kvflow_int8_linear(void* handle, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                        const float* bias, const float* residual, long ld_res, float* out, int num_threads) {
  kvflow::int8_linear(*static_cast<kvflow::PackedWeight*>(handle), x, ldx, m, kind, norm_w, eps, bias, residual,
                      ld_res, out, num_threads);
}

}  // extern "C"
