/* Attention of a prefill chunk's rows, a tile of rows at a time (a part of attention.h, included
 * there after the cache formats and load_row).
 *
 * attend_rows gives each query row its own pass over its keys: every key is loaded, and each product
 * summed across vector lanes, once per row -- well below what the same multiply-adds reach as a
 * GEMM (benchmarks/prefill_attention.py; figures in docs/benchmarks/results/). The rows of one
 * prefill chunk read the same keys through the same block table, so here a tile of them is computed
 * together, flash-attention style: the tile's (row, query head) pairs are the vector lanes
 * (TILE_LANES of them), its queries transposed once into qt[d][lane], and for each chunk of
 * TILE_KEYS keys
 *   scores   s[j][lane] = sum_d k[j][d] * qt[d][lane]     (a key element broadcast, a lane vector)
 *   softmax  online, per lane, over the chunk (masked outside each row's [begin, end))
 *   values   ot[d][lane] += sum_j v[j][d] * s[j][lane]
 * so each loaded key and value element feeds TILE_LANES lanes, and nothing is summed across lanes.
 * The accumulators live in registers for TILE_REGS keys (or head dims) at a time.
 *
 * A row's result does not depend on the tile it is in: every lane runs the same operations in the
 * same order (d ascending in a score, keys ascending in the values), the chunks start at multiples
 * of TILE_KEYS of the position whatever the tile, and masked keys add exact zeros. The sums run in
 * another order than attend_rows' (which keeps decode rows bit for bit the same alone or batched),
 * so a position attended here and as a decode row can differ in the last bits (more over a bf16
 * cache with bf16 products, below: the query and probabilities rounded to bf16).
 *
 * Float32 and bfloat16 caches (widened to float32 as a chunk is copied in, or multiplied in bf16
 * where the CPU has AVX512_BF16), head_dim 64 and 128; other shapes
 * and formats, soft-capped scores, and rows in runs too short to fill half a tile take attend_rows'
 * per-row path. */
#ifndef KVFLOW_TILED_ATTENTION_H
#define KVFLOW_TILED_ATTENTION_H

#include <vector>

/* Three lane vectors (16 rows of 3 query heads, SmolLM2's group) and half a vector of keys in
 * registers: 3 x VEC / 2 accumulators and 3 query vectors, within the 32 (AVX-512) or 16 (AVX2)
 * vector registers. Chosen by timing variants on one layer's 2,048-token prompt on the AVX-512
 * EPYC: 2 lane vectors were slower, 1 or 3 vectors of keys per softmax step no faster. */
constexpr int TILE_LANES = 3 * VEC;  /* (row, query head) pairs of a tile */
constexpr int TILE_KEYS = 2 * VEC;   /* keys per online-softmax step */
constexpr int TILE_REGS = VEC / 2;   /* keys / head dims whose lane vectors stay in registers */
static_assert(TILE_KEYS % TILE_REGS == 0 && 64 % TILE_REGS == 0, "register passes must divide the chunk and D");

/* Rows [r0, r0 + rows) of a call, their keys within [begin, end), read through row table_row's
 * block table (its run's first: checked equal to each row's over that row's keys). */
struct AttentionTile {
    int r0, rows, begin, end, table_row;
};

/* One key's (or value's) head vector of a float32 or bf16 cache into dst as float32. */
template <int D, int FMT>
static inline void widen_head(const void *kv, long base, float *restrict dst) {
    vfloat row[D / VEC];
    load_row<D, FMT>(kv, base, row);
    for (int i = 0; i < D / VEC; i++) *(vfloat *)(dst + i * VEC) = row[i];
}

/* s[j][lane] = sum_d kp[j][d] * qt[d][lane] for keys j < n (n rounded up to TILE_REGS: kp's rows
 * past n are zeros). */
template <int D>
static inline void tile_scores(const float (&qt)[D][TILE_LANES], const float (&kp)[TILE_KEYS][D], int n,
                               float (&s)[TILE_KEYS][TILE_LANES]) {
    constexpr int NL = TILE_LANES / VEC;
    for (int j0 = 0; j0 < n; j0 += TILE_REGS) {
        vfloat acc[TILE_REGS][NL] = {};
        for (int d = 0; d < D; d++) {
            vfloat qv[NL];
            for (int v = 0; v < NL; v++) qv[v] = *(const vfloat *)&qt[d][v * VEC];
            for (int jj = 0; jj < TILE_REGS; jj++) {
                const float k = kp[j0 + jj][d];
                for (int v = 0; v < NL; v++) acc[jj][v] += k * qv[v];
            }
        }
        for (int jj = 0; jj < TILE_REGS; jj++)
            for (int v = 0; v < NL; v++) *(vfloat *)&s[j0 + jj][v * VEC] = acc[jj][v];
    }
}

/* ot[d][lane] += sum_{j < n} vp[j][d] * p[j][lane]. */
template <int D>
static inline void tile_values(const float (&p)[TILE_KEYS][TILE_LANES], const float (&vp)[TILE_KEYS][D], int n,
                               float (&ot)[D][TILE_LANES]) {
    constexpr int NL = TILE_LANES / VEC;
    for (int d0 = 0; d0 < D; d0 += TILE_REGS) {
        vfloat acc[TILE_REGS][NL];
        for (int dd = 0; dd < TILE_REGS; dd++)
            for (int v = 0; v < NL; v++) acc[dd][v] = *(const vfloat *)&ot[d0 + dd][v * VEC];
        for (int j = 0; j < n; j++) {
            vfloat pv[NL];
            for (int v = 0; v < NL; v++) pv[v] = *(const vfloat *)&p[j][v * VEC];
            for (int dd = 0; dd < TILE_REGS; dd++) {
                const float x = vp[j][d0 + dd];
                for (int v = 0; v < NL; v++) acc[dd][v] += x * pv[v];
            }
        }
        for (int dd = 0; dd < TILE_REGS; dd++)
            for (int v = 0; v < NL; v++) *(vfloat *)&ot[d0 + dd][v * VEC] = acc[dd][v];
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* A bf16 cache's tiles multiply in bf16 (vdpbf16ps: two bf16 products summed into a float32 lane
 * per instruction, twice the float32 FMA's rate): queries and probabilities rounded to bf16 (to
 * nearest even), keys and values as stored, every sum in float32. */
#define KVFLOW_TILE_BF16_PRODUCTS 1

static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

/* Two bf16 values as one 32-bit lane, `lo` the even element (vdpbf16ps' pairing). */
static inline uint32_t bf16_pair(uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }

/* s[j][lane] = sum_d kb[j][d] * q[d][lane], d in pairs: qp[d / 2][lane] holds lane's (d, d + 1). */
template <int D>
static inline void tile_scores_bf16(const uint32_t (&qp)[D / 2][TILE_LANES], const uint16_t (&kb)[TILE_KEYS][D],
                                    int n, float (&s)[TILE_KEYS][TILE_LANES]) {
    constexpr int NL = TILE_LANES / 16;
    for (int j0 = 0; j0 < n; j0 += TILE_REGS) {
        __m512 acc[TILE_REGS][NL];
        for (int jj = 0; jj < TILE_REGS; jj++)
            for (int v = 0; v < NL; v++) acc[jj][v] = _mm512_setzero_ps();
        for (int dp = 0; dp < D / 2; dp++) {
            __m512bh qv[NL];
            for (int v = 0; v < NL; v++) qv[v] = as_bh(_mm512_load_si512((const void *)&qp[dp][v * 16]));
            for (int jj = 0; jj < TILE_REGS; jj++) {
                uint32_t pair;
                memcpy(&pair, &kb[j0 + jj][2 * dp], sizeof(pair));
                const __m512bh k = as_bh(_mm512_set1_epi32((int)pair));
                for (int v = 0; v < NL; v++) acc[jj][v] = _mm512_dpbf16_ps(acc[jj][v], k, qv[v]);
            }
        }
        for (int jj = 0; jj < TILE_REGS; jj++)
            for (int v = 0; v < NL; v++) _mm512_store_ps(&s[j0 + jj][v * 16], acc[jj][v]);
    }
}

/* ot[d][lane] += sum_j v[j][d] * p[j][lane], j in pairs: vpair[j / 2][d] and pp[j / 2][lane]. */
template <int D>
static inline void tile_values_bf16(const uint32_t (&pp)[TILE_KEYS / 2][TILE_LANES],
                                    const uint32_t (&vpair)[TILE_KEYS / 2][D], int pairs, float (&ot)[D][TILE_LANES]) {
    constexpr int NL = TILE_LANES / 16;
    for (int d0 = 0; d0 < D; d0 += TILE_REGS) {
        __m512 acc[TILE_REGS][NL];
        for (int dd = 0; dd < TILE_REGS; dd++)
            for (int v = 0; v < NL; v++) acc[dd][v] = _mm512_load_ps(&ot[d0 + dd][v * 16]);
        for (int jp = 0; jp < pairs; jp++) {
            __m512bh pv[NL];
            for (int v = 0; v < NL; v++) pv[v] = as_bh(_mm512_load_si512((const void *)&pp[jp][v * 16]));
            for (int dd = 0; dd < TILE_REGS; dd++) {
                const __m512bh x = as_bh(_mm512_set1_epi32((int)vpair[jp][d0 + dd]));
                for (int v = 0; v < NL; v++) acc[dd][v] = _mm512_dpbf16_ps(acc[dd][v], x, pv[v]);
            }
        }
        for (int dd = 0; dd < TILE_REGS; dd++)
            for (int v = 0; v < NL; v++) _mm512_store_ps(&ot[d0 + dd][v * 16], acc[dd][v]);
    }
}
#else
#define KVFLOW_TILE_BF16_PRODUCTS 0
#endif

/* One tile's attention for kv head h: lanes (i, g) = row r0 + i, query head h * G + g. */
template <int D, int FMT>
static void attend_tile(const AttentionTile &tile, int G, const float *q, long q_row_stride, const int32_t *tokens,
                        const int32_t *context_lens, int window, const void *kv, const int32_t *table,
                        int kv_heads, int num_heads, int block_size, int h, float scale, float *out) {
    using kvflow::vint;
    constexpr int L = TILE_LANES;
    constexpr bool BF = FMT == KV_BF16 && KVFLOW_TILE_BF16_PRODUCTS;
    alignas(64) float qt[D][L], ot[D][L], kp[BF ? 1 : TILE_KEYS][D], vp[BF ? 1 : TILE_KEYS][D], s[TILE_KEYS][L];
    alignas(64) float m[L], l[L];
    alignas(64) int lo[L], hi[L];
    for (int lane = 0; lane < L; lane++) {
        m[lane] = -1e30f;
        l[lane] = 0.f;
        lo[lane] = hi[lane] = 0;  /* lanes past the tile's rows attend to nothing */
        for (int d = 0; d < D; d++) qt[d][lane] = ot[d][lane] = 0.f;
    }
    for (int i = 0; i < tile.rows; i++) {
        const int r = tile.r0 + i, end = context_lens[r];
        const float *qr = q + (long)tokens[r] * q_row_stride + (long)h * G * D;
        for (int g = 0; g < G; g++) {
            const int lane = i * G + g;
            hi[lane] = end;
            lo[lane] = window > 0 ? std::max(0, end - window) : 0;
            for (int d = 0; d < D; d++) qt[d][lane] = qr[g * D + d] * scale;
        }
    }
#if KVFLOW_TILE_BF16_PRODUCTS
    /* the bf16 path's operands: queries and probabilities in pairs for the lanes, keys as stored,
     * values in pairs of keys (sized 1 when unused) */
    alignas(64) uint32_t qpair[BF ? D / 2 : 1][L], ppair[BF ? TILE_KEYS / 2 : 1][L];
    alignas(64) uint16_t kb[BF ? TILE_KEYS : 1][D];
    alignas(64) uint32_t vpair[BF ? TILE_KEYS / 2 : 1][D];
    if constexpr (BF)
        for (int dp = 0; dp < D / 2; dp++)
#pragma omp simd
            for (int lane = 0; lane < L; lane++)
                qpair[dp][lane] = bf16_pair(kvflow::f32_to_bf16(qt[2 * dp][lane]), kvflow::f32_to_bf16(qt[2 * dp + 1][lane]));
#endif
    const long tok_stride = 2L * kv_heads * D, v_off = (long)kv_heads * D + (long)h * D, k_off = (long)h * D;
    for (int c0 = tile.begin / TILE_KEYS * TILE_KEYS; c0 < tile.end; c0 += TILE_KEYS) {
        const int n = std::min(TILE_KEYS, tile.end - c0);
        const int padded = (n + TILE_REGS - 1) / TILE_REGS * TILE_REGS;
        const auto slot_of = [&](int j) {
            const int pos = c0 + j;
            return (long)table[pos / block_size] * block_size + pos % block_size;
        };
#if KVFLOW_TILE_BF16_PRODUCTS
        if constexpr (BF) {
            /* keys as stored (rows past n zero); values interleaved in pairs of keys */
            for (int j = 0; j < n; j++)
                memcpy(kb[j], (const uint16_t *)kv + slot_of(j) * tok_stride + k_off, D * sizeof(uint16_t));
            for (int j = n; j < padded; j++) memset(kb[j], 0, sizeof(kb[j]));
            for (int jp = 0; 2 * jp < n; jp++) {
                const uint16_t *v0 = (const uint16_t *)kv + slot_of(2 * jp) * tok_stride + v_off;
                if (2 * jp + 1 < n) {
                    const uint16_t *v1 = (const uint16_t *)kv + slot_of(2 * jp + 1) * tok_stride + v_off;
#pragma omp simd
                    for (int d = 0; d < D; d++) vpair[jp][d] = bf16_pair(v0[d], v1[d]);
                } else {
#pragma omp simd
                    for (int d = 0; d < D; d++) vpair[jp][d] = v0[d];
                }
            }
            tile_scores_bf16<D>(qpair, kb, n, s);
        } else
#endif
        {
            for (int j = 0; j < n; j++) {
                widen_head<D, FMT>(kv, slot_of(j) * tok_stride + k_off, kp[j]);
                widen_head<D, FMT>(kv, slot_of(j) * tok_stride + v_off, vp[j]);
            }
            for (int j = n; j < padded; j++) memset(kp[j], 0, sizeof(kp[j]));
            tile_scores<D>(qt, kp, n, s);
        }
        /* The online softmax, a lane per (row, head): keys outside a row's [lo, hi) get p = 0 and
         * leave its max alone (a lane with no key yet keeps m = -1e30, corr 1, l 0). In vector
         * registers with simd.h's exp_clamped (glibc's vector expf is a call per vector). */
        for (int v = 0; v < L / VEC; v++) {
            const vint lov = *(const vint *)&lo[v * VEC], hiv = *(const vint *)&hi[v * VEC];
            const vfloat m_old = *(const vfloat *)&m[v * VEC];
            vfloat mx = m_old;
            for (int j = 0; j < n; j++) {
                const vint pos = vint{} + (c0 + j);
                const vfloat sj = *(const vfloat *)&s[j][v * VEC];
                mx = ((pos >= lov) & (pos < hiv) & (sj > mx)) ? sj : mx;
            }
            const vfloat c = kvflow::exp_clamped(m_old - mx);
            vfloat sum = vfloat{};
            for (int j = 0; j < n; j++) {
                const vint pos = vint{} + (c0 + j);
                vfloat &sj = *(vfloat *)&s[j][v * VEC];
                const vfloat e = kvflow::exp_clamped(sj - mx);  /* (masked keys' may exceed 1: dropped) */
                sj = ((pos >= lov) & (pos < hiv)) ? e : vfloat{};
                sum += sj;
            }
            *(vfloat *)&m[v * VEC] = mx;
            *(vfloat *)&l[v * VEC] = *(const vfloat *)&l[v * VEC] * c + sum;
            for (int d = 0; d < D; d++) *(vfloat *)&ot[d][v * VEC] *= c;
        }
#if KVFLOW_TILE_BF16_PRODUCTS
        if constexpr (BF) {
            if (n % 2) memset(s[n], 0, sizeof(s[n]));  /* the last pair's missing key */
            const int pairs = (n + 1) / 2;
            for (int jp = 0; jp < pairs; jp++)
#pragma omp simd
                for (int lane = 0; lane < L; lane++)
                    ppair[jp][lane] = bf16_pair(kvflow::f32_to_bf16(s[2 * jp][lane]), kvflow::f32_to_bf16(s[2 * jp + 1][lane]));
            tile_values_bf16<D>(ppair, vpair, pairs, ot);
        } else
#endif
            tile_values<D>(s, vp, n, ot);
    }
    for (int i = 0; i < tile.rows; i++) {
        float *o = out + ((long)tokens[tile.r0 + i] * num_heads + (long)h * G) * D;
        for (int g = 0; g < G; g++) {
            const int lane = i * G + g;
            const float inv = l[lane] > 0.f ? 1.f / l[lane] : 0.f;
            for (int d = 0; d < D; d++) o[g * D + d] = ot[d][lane] * inv;
        }
    }
}

/* Whether the tiled path takes this shape and cache format. */
static inline bool tiled_shape(int fmt, int head_dim, int group) {
    return (fmt == KV_F32 || fmt == KV_BF16) && (head_dim == 64 || head_dim == 128) && 2 * group <= TILE_LANES;
}

/* The call's rows as tiles: runs of consecutive rows that read the same block table (a prefill
 * chunk's), each cut into near-equal tiles of at most TILE_LANES / group rows; a run too short to
 * fill half a tile's lanes becomes single-row entries (rows = 0: attend_rows' path). Longest work
 * first, so the dynamic schedule ends with the short tasks. The same list on every thread. */
static inline std::vector<AttentionTile> plan_tiles(const int32_t *tables, long table_stride,
                                                    const int32_t *context_lens, int rows, int group,
                                                    int block_size, int window) {
    std::vector<AttentionTile> tiles;
    const int per_tile = TILE_LANES / group;
    const auto begin_of = [&](int r) { return window > 0 ? std::max(0, context_lens[r] - window) : 0; };
    for (int r0 = 0; r0 < rows;) {
        int r1 = r0 + 1;
        while (r1 < rows) {
            const long entries = (context_lens[r1] + block_size - 1) / block_size;
            if (memcmp(tables + r1 * table_stride, tables + r0 * table_stride, entries * sizeof(int32_t)) != 0) break;
            r1++;
        }
        const int run = r1 - r0;
        if (2 * run * group < TILE_LANES) {
            for (int r = r0; r < r1; r++) tiles.push_back({r, 0, begin_of(r), context_lens[r], r});
        } else {
            const int n = (run + per_tile - 1) / per_tile;
            for (int t = 0; t < n; t++) {
                const int a = r0 + (int)((long)run * t / n), b = r0 + (int)((long)run * (t + 1) / n);
                AttentionTile tile{a, b - a, 1 << 30, 0, r0};
                for (int r = a; r < b; r++) {
                    tile.begin = std::min(tile.begin, begin_of(r));
                    tile.end = std::max(tile.end, context_lens[r]);
                }
                tiles.push_back(tile);
            }
        }
        r0 = r1;
    }
    std::stable_sort(tiles.begin(), tiles.end(), [](const AttentionTile &a, const AttentionTile &b) {
        return (long)(a.end - a.begin) * std::max(a.rows, 1) > (long)(b.end - b.begin) * std::max(b.rows, 1);
    });
    return tiles;
}

#endif
