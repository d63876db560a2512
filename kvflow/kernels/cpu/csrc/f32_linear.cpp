/* fp32 linear for a few rows (kvflow/kernels/cpu/f32_linear.py, NativeF32Kernel):
 * out = residual + W . pre(x) + bias, pre as in linear_ops.h.
 *
 * Decode at small batch is bound by the bytes of weight read. The weight is packed once (see
 * F32Weight in f32_linear.h) so that each thread reads its share as one sequential stream, a
 * quad of output channels at a time, multiplied with all the call's rows while it is in L1. BLAS
 * sgemv / sgemm at 1-4 rows stay well under the read bandwidth on the machines measured (and the
 * Python around one call per op is the rest of a step), so this kernel and the fused decode pass
 * over it (decode_pass.cpp) are the autotune's candidates for few rows
 * (kvflow/kernels/cpu/autotune.py).
 *
 * A row's dot products are summed in the same order whatever the tile or the number of rows (eight
 * lanes over the padded features, then a fixed tree), so a token's result does not depend on its
 * batch.
 */
#include "f32_linear.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>

namespace kvflow {
namespace {

// Eight floats, loads and stores unaligned: ymm on AVX / AVX2, also fine under AVX512 (gcc's
// vector extension; scalar code on CPUs without it).
typedef float vf __attribute__((vector_size(32), aligned(4)));

inline float hsum(vf a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

/* y[r * ldy + j] = W[q + j] . v[r] for r < R, j < J of the quad q; the quad's data is its packed
 * blocks (see F32Weight), v rows kp apart (zero-padded like the weight). */
template <int R, int J>
inline void tile(const float* __restrict quad, int kp, const float* __restrict v, float* __restrict y, long ldy) {
  vf acc[R][J];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < J; j++) acc[r][j] = vf{};
  for (int c = 0; c < kp; c += BLOCK) {
    const float* blk = quad + (long)c * QUAD;
    vf wv[J];
    for (int j = 0; j < J; j++) wv[j] = *(const vf*)(blk + j * BLOCK);
    for (int r = 0; r < R; r++) {
      const vf xv = *(const vf*)(v + (long)r * kp + c);
      for (int j = 0; j < J; j++) acc[r][j] += wv[j] * xv;
    }
  }
  for (int r = 0; r < R; r++)
    for (int j = 0; j < J; j++) y[r * ldy + j] = hsum(acc[r][j]);
}

/* Output channels of quads [q0, q1) for all m rows into y (rows n apart; a last partial quad's
 * padding channels go to `spill`). A quad (QUAD x kp floats) is read from memory as one sequential
 * stream by the first pair of input rows, then from L1 by the next pairs: a 2 x 4 tile keeps its
 * accumulators, weight vectors and input vector within 16 vector registers. */
inline void quads(const F32Weight& p, const float* v, int m, int q0, int q1, float* out) {
  const int kp = p.kp;
  const long n = p.n;
  float spill[2 * QUAD];
  for (int q = q0; q < q1; q++) {
    const float* quad = p.w + (long)q * QUAD * kp;
    const bool partial = (q + 1) * QUAD > p.n;
    for (int r = 0; r < m; r += 2) {
      const float* vr = v + (long)r * kp;
      float* y = partial ? spill : out + r * n + (long)q * QUAD;
      const long ldy = partial ? QUAD : n;
      const int rows = std::min(2, m - r);
      if (rows == 2)
        tile<2, QUAD>(quad, kp, vr, y, ldy);
      else
        tile<1, QUAD>(quad, kp, vr, y, ldy);
      if (partial)
        for (int i = 0; i < rows; i++)
          for (int j = q * QUAD; j < p.n; j++) out[(r + i) * n + j] = spill[i * QUAD + j - q * QUAD];
    }
  }
}

thread_local F32Workspace t_work;  // per calling thread (the engine's), reused across calls

}  // namespace

F32Weight* f32_pack(const float* w, int n, int k) {
  const int kp = (k + BLOCK - 1) / BLOCK * BLOCK, nq = (n + QUAD - 1) / QUAD;
  auto* p = new F32Weight{static_cast<float*>(std::aligned_alloc(64, (size_t)nq * QUAD * kp * sizeof(float))), n, k,
                          kp};
  for (int q = 0; q < nq; q++)
    for (int c = 0; c < kp; c += BLOCK)
      for (int j = 0; j < QUAD; j++)
        for (int b = 0; b < BLOCK; b++) {
          const int row = q * QUAD + j, col = c + b;
          p->w[((long)q * kp + c) * QUAD + j * BLOCK + b] = row < n && col < k ? w[(long)row * k + col] : 0.f;
        }
  return p;
}

void f32_free(F32Weight* p) {
  std::free(p->w);
  delete p;
}

void F32Workspace::reserve(int m, int kp) { v.resize(std::max(v.size(), (size_t)m * kp)); }

void f32_linear_team(const F32Weight& p, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                     const float* bias, const float* residual, long ld_res, float* out, F32Workspace& w) {
  const int n = p.n, k = p.k, kp = p.kp;
  const float* v = x;  // the rows the tiles read, kp apart
  if (kind != NONE || ldx != kp || k != kp) {
    float* rows = w.v.data();
#pragma omp for schedule(static)
    for (int i = 0; i < m; i++) {
      float* vi = rows + (long)i * kp;
      prologue(kind, x + i * ldx, k, norm_w, eps, vi);
      std::fill(vi + k, vi + kp, 0.f);
    }
    v = rows;
  }
  const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
  // Contiguous ranges of quads, one per thread.
  const int nq = (n + QUAD - 1) / QUAD, per = (nq + nth - 1) / nth;
  const int q0 = std::min(nq, tid * per), q1 = std::min(nq, q0 + per);
  quads(p, v, m, q0, q1, out);
  const int j0 = std::min(n, q0 * QUAD), j1 = std::min(n, q1 * QUAD);
  for (int i = 0; i < m; i++)  // (a scale of 1 leaves every sum as it is)
    epilogue(out + (long)i * n, j0, j1, 1.f, bias, residual ? residual + i * ld_res : nullptr);
#pragma omp barrier
}

void f32_linear(const F32Weight& p, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                const float* bias, const float* residual, long ld_res, float* out, int num_threads) {
  if (m <= 0) return;
  // The calling thread's workspace, named before the region: inside it `t_work` is each thread's own.
  F32Workspace& work = t_work;
  work.reserve(m, p.kp);
#pragma omp parallel num_threads(num_threads)
  f32_linear_team(p, x, ldx, m, kind, norm_w, eps, bias, residual, ld_res, out, work);
}

}  // namespace kvflow

extern "C" {

/* The float32 weight w [n, k] (row-major) packed into the kernel's layout (a copy); a handle. */
void* kvflow_f32_pack(const float* w, int n, int k) { return kvflow::f32_pack(w, n, k); }

void kvflow_f32_free(void* handle) { kvflow::f32_free(static_cast<kvflow::F32Weight*>(handle)); }

/* The packed weight back as float32 [n, k]. */
void kvflow_f32_unpack(void* handle, float* w) {
  const auto& p = *static_cast<kvflow::F32Weight*>(handle);
  for (int row = 0; row < p.n; row++)
    for (int col = 0; col < p.k; col++)
      w[(long)row * p.k + col] =
          p.w[((long)(row / kvflow::QUAD) * p.kp + col / kvflow::BLOCK * kvflow::BLOCK) * kvflow::QUAD +
              row % kvflow::QUAD * kvflow::BLOCK + col % kvflow::BLOCK];
}

/* out[m, n] = residual + W . pre(x) + bias (see the top of the file). x rows are ldx apart and hold
 * k values (2k for SILU_MUL: gate then up); residual (or null) rows are ld_res apart; out is dense. */
void kvflow_f32_linear(void* handle, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                       const float* bias, const float* residual, long ld_res, float* out, int num_threads) {
  kvflow::f32_linear(*static_cast<kvflow::F32Weight*>(handle), x, ldx, m, kind, norm_w, eps, bias, residual,
                     ld_res, out, num_threads);
}

}  // extern "C"
