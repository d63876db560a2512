/* Float linear for a few rows (kvflow/kernels/cpu/float_linear.py, NativeFloatKernel):
 * out = residual + W . pre(x) + bias, pre as in linear_ops.h; float32 activations and sums, the
 * weight in float32 or bfloat16.
 *
 * Decode at small batch is bound by the bytes of weight read. The weight is packed once (see
 * FloatWeight in float_linear.h) so that each thread reads its share as one sequential stream, a
 * quad of output channels at a time, multiplied with all the call's rows while it is in L1. BLAS
 * sgemv / sgemm at 1-4 rows stay well under the read bandwidth on the machines measured (and the
 * Python around one call per op is the rest of a step), so this kernel and the fused decode pass
 * over it (decode_pass.cpp) are the autotune's candidates for few rows
 * (kvflow/kernels/cpu/autotune.py). bfloat16 weights are widened in registers (a shift): the
 * products are those of float32 maths on the bf16 values, and a step reads half the bytes.
 *
 * A row's dot products are summed in the same order whatever the tile or the number of rows (BLOCK
 * lanes over the padded features, then a fixed tree), so a token's result does not depend on its
 * batch.
 */
#include "float_linear.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace kvflow {
namespace {

// BLOCK floats, loads and stores unaligned: one ymm on AVX / AVX2 / AVX-512 (gcc's vector
// extension; scalar code on CPUs without it). (zmm measured no faster on a Zen 4 EPYC, whose
// AVX-512 units are 256 bits wide, and a decode step is bound by the weights' bytes.)
typedef float vf __attribute__((vector_size(BLOCK * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(BLOCK * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(BLOCK * 4)));

inline vf load(const float* p) { return *(const vf*)p; }
// bf16 -> float32: the 16 bits are the float's upper half.
inline vf load(const uint16_t* p) { return (vf)(__builtin_convertvector(*(const vh*)p, vu) << 16); }

inline float hsum(vf a) {
  float t[BLOCK];
  std::memcpy(t, &a, sizeof t);
  for (int w = BLOCK / 2; w > 0; w /= 2)
    for (int i = 0; i < w; i++) t[i] += t[i + w];
  return t[0];
}

/* y[r * ldy + j] = W[q + j] . v[r] for r < R, j < J of the quad q; the quad's data is its packed
 * blocks (see FloatWeight), v rows kp apart (zero-padded like the weight). */
template <int R, int J, class T>
inline void tile(const T* __restrict quad, int kp, const float* __restrict v, float* __restrict y, long ldy) {
  vf acc[R][J];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < J; j++) acc[r][j] = vf{};
  for (int c = 0; c < kp; c += BLOCK) {
    const T* blk = quad + (long)c * QUAD;
    vf wv[J];
    for (int j = 0; j < J; j++) wv[j] = load(blk + j * BLOCK);
    for (int r = 0; r < R; r++) {
      const vf xv = *(const vf*)(v + (long)r * kp + c);
      for (int j = 0; j < J; j++) acc[r][j] += wv[j] * xv;
    }
  }
  for (int r = 0; r < R; r++)
    for (int j = 0; j < J; j++) y[r * ldy + j] = hsum(acc[r][j]);
}

/* Output channels of quads [q0, q1) for all m rows into y (rows n apart; a last partial quad's
 * padding channels go to `spill`). A quad (QUAD x kp elements) is read from memory as one sequential
 * stream by the first pair of input rows, then from L1 by the next pairs: a 2 x 4 tile keeps its
 * accumulators, weight vectors and input vector within 16 vector registers. */
template <class T>
void quads(const FloatWeight& p, const float* v, int m, int q0, int q1, float* out) {
  const int kp = p.kp;
  const long n = p.n;
  const T* w = static_cast<const T*>(p.w);
  float spill[2 * QUAD];
  for (int q = q0; q < q1; q++) {
    const T* quad = w + (long)q * QUAD * kp;
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

template <class T>
void pack(const T* src, int n, int k, int kp, T* dst) {
  const int nq = (n + QUAD - 1) / QUAD;
  for (int q = 0; q < nq; q++)
    for (int c = 0; c < kp; c += BLOCK)
      for (int j = 0; j < QUAD; j++)
        for (int b = 0; b < BLOCK; b++) {
          const int row = q * QUAD + j, col = c + b;
          dst[((long)q * kp + c) * QUAD + j * BLOCK + b] = row < n && col < k ? src[(long)row * k + col] : T{};
        }
}

template <class T>
void unpack(const FloatWeight& p, T* dst) {
  const T* w = static_cast<const T*>(p.w);
  for (int row = 0; row < p.n; row++)
    for (int col = 0; col < p.k; col++)
      dst[(long)row * p.k + col] =
          w[((long)(row / QUAD) * p.kp + col / BLOCK * BLOCK) * QUAD + row % QUAD * BLOCK + col % BLOCK];
}

thread_local FloatWorkspace t_work;  // per calling thread (the engine's), reused across calls

}  // namespace

FloatWeight* float_pack(const void* w, int n, int k, int type) {
  const int kp = (k + BLOCK - 1) / BLOCK * BLOCK, nq = (n + QUAD - 1) / QUAD;
  const size_t size = type == W_BF16 ? 2 : 4;
  const size_t bytes = ((size_t)nq * QUAD * kp * size + 63) / 64 * 64;
  auto* p = new FloatWeight{std::aligned_alloc(64, bytes), n, k, kp, type};
  if (type == W_BF16)
    pack(static_cast<const uint16_t*>(w), n, k, kp, static_cast<uint16_t*>(p->w));
  else
    pack(static_cast<const float*>(w), n, k, kp, static_cast<float*>(p->w));
  return p;
}

void float_free(FloatWeight* p) {
  std::free(p->w);
  delete p;
}

void FloatWorkspace::reserve(int m, int kp) { v.resize(std::max(v.size(), (size_t)m * kp)); }

void float_linear_team(const FloatWeight& p, const float* x, long ldx, int m, int kind, const float* norm_w,
                       float eps, const float* bias, const float* residual, long ld_res, float* out,
                       FloatWorkspace& w) {
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
  if (p.type == W_BF16)
    quads<uint16_t>(p, v, m, q0, q1, out);
  else
    quads<float>(p, v, m, q0, q1, out);
  const int j0 = std::min(n, q0 * QUAD), j1 = std::min(n, q1 * QUAD);
  for (int i = 0; i < m; i++)  // (a scale of 1 leaves every sum as it is)
    epilogue(out + (long)i * n, j0, j1, 1.f, bias, residual ? residual + i * ld_res : nullptr);
#pragma omp barrier
}

void float_linear(const FloatWeight& p, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                  const float* bias, const float* residual, long ld_res, float* out, int num_threads) {
  if (m <= 0) return;
  // The calling thread's workspace, named before the region: inside it `t_work` is each thread's own.
  FloatWorkspace& work = t_work;
  work.reserve(m, p.kp);
#pragma omp parallel num_threads(num_threads)
  float_linear_team(p, x, ldx, m, kind, norm_w, eps, bias, residual, ld_res, out, work);
}

}  // namespace kvflow

extern "C" {

/* The weight w [n, k] (row-major; float32, or bfloat16 when type is 1) packed into the kernel's
 * layout (a copy); a handle. */
void* kvflow_float_pack(const void* w, int n, int k, int type) { return kvflow::float_pack(w, n, k, type); }

void kvflow_float_free(void* handle) { kvflow::float_free(static_cast<kvflow::FloatWeight*>(handle)); }

/* The packed weight back, in its own type, [n, k]. */
void kvflow_float_unpack(void* handle, void* w) {
  const auto& p = *static_cast<kvflow::FloatWeight*>(handle);
  if (p.type == kvflow::W_BF16)
    kvflow::unpack(p, static_cast<uint16_t*>(w));
  else
    kvflow::unpack(p, static_cast<float*>(w));
}

/* out[m, n] = residual + W . pre(x) + bias (see the top of the file). x rows are ldx apart and hold
 * k values (2k for SILU_MUL: gate then up); residual (or null) rows are ld_res apart; out is dense. */
void kvflow_float_linear(void* handle, const float* x, long ldx, int m, int kind, const float* norm_w, float eps,
                         const float* bias, const float* residual, long ld_res, float* out, int num_threads) {
  kvflow::float_linear(*static_cast<kvflow::FloatWeight*>(handle), x, ldx, m, kind, norm_w, eps, bias, residual,
                       ld_res, out, num_threads);
}

}  // extern "C"
