/* Paged attention for query rows that each attend to their sequence's cached keys, read in place.
 *
 * Built at first use by kvflow/layers/native.py (gcc -O3 -march=native -fopenmp) and called through
 * ctypes. The torch path gathers (copies) every sequence's KV and pads a batch to its longest
 * context before scaled_dot_product_attention; this kernel walks each sequence's block table and
 * reads K/V where they lie, once, with an online softmax -- so a step costs the KV that is really
 * there, and blocks shared by several sequences (prefix caching) are read from cache, not copied.
 *
 * Cache layout (see kvflow/layers/attention.py): data [num_blocks, block_size, 2, kv_heads, head_dim],
 * float32, or int8 with scales [num_blocks, block_size, 2, kv_heads] (one per token, K/V and head).
 *
 * One task = one (query row, kv head): the `group` query heads sharing that kv head are scored
 * together, so each K/V row is loaded once for all of them.
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 32
#define CHUNK 32 /* keys scored per online-softmax update */

static inline float dot_f32(const float *restrict a, const float *restrict b, int n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float dot_i8(const float *restrict a, const int8_t *restrict b, int n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * (float)b[i];
    return s;
}

static void attend(const float *restrict q, const void *kv, const float *scales, int quant,
                   const int32_t *restrict table, int begin, int end, int kv_heads, int head_dim,
                   int block_size, int group, int h, float scale, float *restrict out) {
    float qs[MAX_GROUP][MAX_HEAD_DIM];
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float m[MAX_GROUP], l[MAX_GROUP];
    float s[MAX_GROUP][CHUNK];
    const long tok_stride = 2L * kv_heads * head_dim; /* elements from one slot to the next */
    const long v_off = (long)kv_heads * head_dim;

    for (int g = 0; g < group; g++) {
        for (int d = 0; d < head_dim; d++) {
            qs[g][d] = q[g * head_dim + d] * scale;
            acc[g][d] = 0.f;
        }
        m[g] = -1e30f;
        l[g] = 0.f;
    }
    int t = begin;
    while (t < end) {
        const int off = t % block_size;
        int n = block_size - off;
        if (n > CHUNK) n = CHUNK;
        if (n > end - t) n = end - t;
        const long slot0 = (long)table[t / block_size] * block_size + off;

        for (int j = 0; j < n; j++) {
            const long base = (slot0 + j) * tok_stride + (long)h * head_dim;
            if (quant) {
                const float ks = scales[(slot0 + j) * 2 * kv_heads + h];
                const int8_t *k = (const int8_t *)kv + base;
                for (int g = 0; g < group; g++) s[g][j] = ks * dot_i8(qs[g], k, head_dim);
            } else {
                const float *k = (const float *)kv + base;
                for (int g = 0; g < group; g++) s[g][j] = dot_f32(qs[g], k, head_dim);
            }
        }
        for (int g = 0; g < group; g++) {
            float mx = m[g];
            for (int j = 0; j < n; j++) mx = s[g][j] > mx ? s[g][j] : mx;
            const float corr = expf(m[g] - mx);
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < n; j++) {
                s[g][j] = expf(s[g][j] - mx);
                sum += s[g][j];
            }
            l[g] = l[g] * corr + sum;
            m[g] = mx;
            if (corr != 1.f) {
#pragma omp simd
                for (int d = 0; d < head_dim; d++) acc[g][d] *= corr;
            }
        }
        for (int j = 0; j < n; j++) {
            const long base = (slot0 + j) * tok_stride + v_off + (long)h * head_dim;
            if (quant) {
                const float vs = scales[(slot0 + j) * 2 * kv_heads + kv_heads + h];
                const int8_t *v = (const int8_t *)kv + base;
                for (int g = 0; g < group; g++) {
                    const float p = s[g][j] * vs;
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) acc[g][d] += p * (float)v[d];
                }
            } else {
                const float *v = (const float *)kv + base;
                for (int g = 0; g < group; g++) {
                    const float p = s[g][j];
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) acc[g][d] += p * v[d];
                }
            }
        }
        t += n;
    }
    for (int g = 0; g < group; g++) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int d = 0; d < head_dim; d++) out[g * head_dim + d] = acc[g][d] * inv;
    }
}

/* rows: query rows (one token each). For row r:
 *   q[tokens[r] * q_row_stride + head * head_dim + d]          its query (float32)
 *   tables[r * table_stride + i]                                 its sequence's block table
 *   keys at positions [max(0, context_lens[r] - window), context_lens[r])  (window <= 0: all)
 *   out[tokens[r] * num_heads * head_dim + head * head_dim + d]  its output (float32)
 * Returns 0, or -1 when head_dim / group exceed the kernel's limits (checked by the caller too). */
int kvflow_paged_attention(const float *q, long q_row_stride, const void *kv, const float *scales,
                           int quant, const int32_t *tables, long table_stride, const int32_t *context_lens,
                           const int32_t *tokens, int rows, int num_heads, int kv_heads,
                           int head_dim, int block_size, int window, float scale, float *out,
                           int num_threads) {
    const int group = num_heads / kv_heads;
    if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP || group * kv_heads != num_heads) return -1;
    const long tasks = (long)rows * kv_heads;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (long task = 0; task < tasks; task++) {
        const int r = (int)(task / kv_heads), h = (int)(task % kv_heads);
        const int end = context_lens[r];
        int begin = window > 0 ? end - window : 0;
        if (begin < 0) begin = 0;
        const long tok = tokens[r];
        attend(q + tok * q_row_stride + (long)h * group * head_dim, kv, scales, quant,
               tables + r * table_stride, begin, end, kv_heads, head_dim,
               block_size, group, h, scale, out + (tok * num_heads + (long)h * group) * head_dim);
    }
    return 0;
}
