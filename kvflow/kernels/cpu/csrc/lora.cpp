/* Multi-LoRA shrink / expand (kvflow/kernels/cpu/lora.py; lora.h): for one projection, every adapter row of a
 * step in one call, whatever the number of adapters -- Punica's segmented SGMV on the CPU. Three
 * phases, each shared by the team and ended by a barrier:
 *
 *   v[i] = pre(x[rows[i]])                   the projection's input (RMSNorm, silu * mul or none)
 *   t[i, p, q] = A_slot[p, q] . v[i]          shrink: each A row read once a step, for its segment's rows
 *   out[rows[i], j] += sum_q t[i, p(j), q] * Bt_slot[q, j]   expand: threads own column ranges
 *
 * At rank 16 the arithmetic is a few percent of the base projection's; what it costs is reading
 * each resident adapter's weights once per step, so rows of one adapter share every load (a
 * segment's rows go through a weight row together, four at a time).
 *
 * Each sum runs in one fixed order (a dot product over the input in one vector accumulator,
 * then its lanes pairwise; an expand over the rank in order), the same for any number of rows,
 * segments or threads: this file is compiled without reassociation (kvflow/kernels/cpu/native.py),
 * so the fused decode pass and the per-layer path give a row the same result.
 */
#include "lora.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "linear_ops.h"
#include "simd.h"

namespace kvflow {
namespace {

// Floats ahead that the loops over A's and B's rows ask the memory for: a step of many adapters
// with few rows each is bound by reading their weights, in many short runs.
constexpr int PREFETCH = 128;

inline vfloat load_padded(const float* p, int n) {
  vfloat v = vfloat{};
  std::memcpy(&v, p, n * sizeof(float));
  return v;
}

/* t[e * ldt_e + i * ldt] = a_e . v[i] for NA rows a_e of A (k apart) and NR rows of v (k apart):
 * one vector accumulator per pair, over the features in order, its lanes then summed in order. */
template <int NA, int NR>
inline void dots(const float* __restrict a, const float* __restrict v, int k, float* __restrict t, int ldt) {
  vfloat acc[NA][NR];
  for (int e = 0; e < NA; e++)
    for (int i = 0; i < NR; i++) acc[e][i] = vfloat{};
  int c = 0;
  for (; c + VEC <= k; c += VEC) {
    vfloat w[NA];
    for (int e = 0; e < NA; e++) __builtin_prefetch(a + (long)e * k + c + PREFETCH);
    for (int e = 0; e < NA; e++) w[e] = *(const vfloat*)(a + (long)e * k + c);
    for (int i = 0; i < NR; i++) {
      const vfloat x = *(const vfloat*)(v + (long)i * k + c);
      for (int e = 0; e < NA; e++) acc[e][i] = fmadd(w[e], x, acc[e][i]);
    }
  }
  if (c < k) {  // (zero-padded: the same vector code for the tail)
    vfloat w[NA];
    for (int e = 0; e < NA; e++) w[e] = load_padded(a + (long)e * k + c, k - c);
    for (int i = 0; i < NR; i++) {
      const vfloat x = load_padded(v + (long)i * k + c, k - c);
      for (int e = 0; e < NA; e++) acc[e][i] = fmadd(w[e], x, acc[e][i]);
    }
  }
  for (int e = 0; e < NA; e++)
    for (int i = 0; i < NR; i++) t[e + (long)i * ldt] = lanes_sum(acc[e][i]);
}

/* Rows [i0, i1) of v against NA rows of A (see dots), four rows of v at a time. */
template <int NA>
inline void shrink_rows(const float* a, const float* v, int k, float* t, int ldt, int i0, int i1) {
  int i = i0;
  for (; i + 4 <= i1; i += 4) dots<NA, 4>(a, v + (long)i * k, k, t + (long)i * ldt, ldt);
  // (the last rows in one go too: an adapter with two rows in the step reads its A rows once)
  if (i1 - i == 3) dots<NA, 3>(a, v + (long)i * k, k, t + (long)i * ldt, ldt);
  if (i1 - i == 2) dots<NA, 2>(a, v + (long)i * k, k, t + (long)i * ldt, ldt);
  if (i1 - i == 1) dots<NA, 1>(a, v + (long)i * k, k, t + (long)i * ldt, ldt);
}

/* out_i[j .. j + NV * VEC) += sum_{q < rank} t_i[q] * b[q * ldb + j ..] for NR rows (n: the valid
 * columns of the last vector, VEC but at the end of a range). */
template <int NR, int NV>
inline void expand_at(const float* __restrict t, int ldt, const float* __restrict b, long ldb, int rank, int j,
                      int n, float* const* outs) {
  vfloat acc[NR][NV];
  for (int i = 0; i < NR; i++)
    for (int u = 0; u < NV; u++) acc[i][u] = vfloat{};
  for (int q = 0; q < rank; q++) {
    const float* bq = b + q * ldb + j;
    __builtin_prefetch(bq + PREFETCH);
    vfloat w[NV];
    for (int u = 0; u < NV; u++)
      w[u] = (u < NV - 1 || n == VEC) ? *(const vfloat*)(bq + u * VEC) : load_padded(bq + u * VEC, n);
    for (int i = 0; i < NR; i++) {
      const vfloat ti = vfloat{} + t[(long)i * ldt + q];
      for (int u = 0; u < NV; u++) acc[i][u] = fmadd(ti, w[u], acc[i][u]);
    }
  }
  for (int i = 0; i < NR; i++) {
    for (int u = 0; u < NV; u++) {
      float* o = outs[i] + j + u * VEC;
      if (u < NV - 1 || n == VEC) {
        *(vfloat*)o += acc[i][u];
      } else {
        const vfloat y = load_padded(o, n) + acc[i][u];
        std::memcpy(o, &y, n * sizeof(float));
      }
    }
  }
}

/* out[i][j] += sum_{q < rank} t[i * ldt + q] * b[q * ldb + j] for j in [j0, j1), NR rows: two
 * vectors of columns at a time (each column's sum the same whichever way it is reached). */
template <int NR>
inline void expand(const float* t, int ldt, const float* b, long ldb, int rank, int j0, int j1, float* const* outs) {
  int j = j0;
  for (; j + 2 * VEC <= j1; j += 2 * VEC) expand_at<NR, 2>(t, ldt, b, ldb, rank, j, VEC, outs);
  for (; j < j1; j += VEC) expand_at<NR, 1>(t, ldt, b, ldb, rank, j, std::min(VEC, j1 - j), outs);
}

}  // namespace

void lora_team(const LoraProj& p, const LoraRows& r, const float* x, long ldx, int kind, const float* norm_w,
               float eps, float* out, long ldo, LoraWorkspace& w) {
  if (r.num_segments == 0) return;
  const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
  const int n = r.seg_start[r.num_segments], k = p.in, tk = p.parts * p.rmax;
  float *v = w.v.data(), *t = w.t.data();
  for (int i = tid; i < n; i += nth) prologue(kind, x + (long)r.rows[i] * ldx, k, norm_w, eps, v + (long)i * k);
#pragma omp barrier
  // Shrink: the (segment, part, pair of rank rows) items split into one contiguous run per thread
  // (each thread streams its share of A, each A row read once).
  int items = 0;
  for (int g = 0; g < r.num_segments; g++)
    for (int part = 0; part < p.parts; part++) items += (p.ranks[(long)r.seg_slot[g] * p.parts + part] + 1) / 2;
  const int first = (int)((long)items * tid / nth), last = (int)((long)items * (tid + 1) / nth);
  // A long segment (a prompt's rows) goes through the thread's A rows a block of rows at a time:
  // the block's inputs and the A rows stay in L2.
  constexpr int ROW_BLOCK = 64;
  for (int g = 0, item0 = 0; g < r.num_segments && item0 < last; g++) {
    const int slot = r.seg_slot[g], i0 = r.seg_start[g], i1 = r.seg_start[g + 1];
    const int32_t* ranks = p.ranks + (long)slot * p.parts;
    int seg_items = 0;
    for (int part = 0; part < p.parts; part++) seg_items += (ranks[part] + 1) / 2;
    if (item0 + seg_items > first) {
      for (int b0 = i0; b0 < i1; b0 += ROW_BLOCK) {
        const int b1 = std::min(i1, b0 + ROW_BLOCK);
        int item = item0;
        for (int part = 0; part < p.parts && item < last; part++) {
          for (int q = 0; q < ranks[part] && item < last; q += 2, item++) {
            if (item < first) continue;
            const int col = part * p.rmax + q;
            const float* a = p.a + ((long)slot * tk + col) * k;
            if (q + 1 < ranks[part])
              shrink_rows<2>(a, v, k, t + col, tk, b0, b1);
            else
              shrink_rows<1>(a, v, k, t + col, tk, b0, b1);
          }
        }
      }
    }
    item0 += seg_items;
  }
#pragma omp barrier
  // Expand: each thread owns a range of whole vectors of output columns, for every segment.
  const int nvec = (p.out + VEC - 1) / VEC;
  const int c0 = (int)((long)nvec * tid / nth) * VEC, c1 = std::min(p.out, (int)((long)nvec * (tid + 1) / nth) * VEC);
  for (int g = 0; g < r.num_segments && c0 < c1; g++) {
    const int slot = r.seg_slot[g], i0 = r.seg_start[g], i1 = r.seg_start[g + 1];
    const int32_t* ranks = p.ranks + (long)slot * p.parts;
    const float* b = p.bt + (long)slot * p.rmax * p.out;
    for (int part = 0, start = 0; part < p.parts; start = p.part_end[part++]) {
      const int j0 = std::max(c0, start), j1 = std::min(c1, p.part_end[part]), rank = ranks[part];
      if (j0 >= j1 || rank == 0) continue;
      const float* tp = t + part * p.rmax;
      int i = i0;
      for (; i + 4 <= i1; i += 4) {
        float* outs[4];
        for (int e = 0; e < 4; e++) outs[e] = out + (long)r.rows[i + e] * ldo;
        expand<4>(tp + (long)i * tk, tk, b, p.out, rank, j0, j1, outs);
      }
      float* outs[3];
      for (int e = 0; i + e < i1; e++) outs[e] = out + (long)r.rows[i + e] * ldo;
      if (i1 - i == 3) expand<3>(tp + (long)i * tk, tk, b, p.out, rank, j0, j1, outs);
      if (i1 - i == 2) expand<2>(tp + (long)i * tk, tk, b, p.out, rank, j0, j1, outs);
      if (i1 - i == 1) expand<1>(tp + (long)i * tk, tk, b, p.out, rank, j0, j1, outs);
    }
  }
#pragma omp barrier
}

}  // namespace kvflow

namespace {
thread_local kvflow::LoraWorkspace t_work;
}

extern "C" {

/* lora_team in a parallel region of its own (the per-layer path: one call per projection). */
void kvflow_lora_add(const kvflow::LoraProj* p, const kvflow::LoraRows* r, const float* x, long ldx, int kind,
                     const float* norm_w, float eps, float* out, long ldo, int num_threads) {
  if (r->num_segments == 0) return;
  kvflow::LoraWorkspace& work = t_work;  // (the calling thread's: the team shares it)
  work.reserve(r->seg_start[r->num_segments], p->in, p->parts * p->rmax);
#pragma omp parallel num_threads(num_threads)
  kvflow::lora_team(*p, *r, x, ldx, kind, norm_w, eps, out, ldo, work);
}

}  // extern "C"
