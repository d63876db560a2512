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
 *
 * Also here, so that a decode step's attention is one call (kvflow_decode_attention): rotary on the
 * new q and k, the cache write of the new k and v (quantized for an int8 cache), then attention.
 * The same helpers serve the separate calls (kvflow_rotary, kvflow_write_kv) of prefill steps, so a
 * token's cached K/V are bit for bit the same whichever path computed them.
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 32
#define CHUNK 32 /* keys scored per online-softmax update */
#define PARALLEL_MIN 65536 /* elements below which rotary / cache writes stay on one thread */
#define MIN_KV_SCALE 1e-12f /* as kvflow.layers.quant: an all-zero vector quantizes to zeros */

/* Rotary in place on `heads` contiguous head vectors, rotate-half layout:
 * x = x * cos + roll(x, D/2) * sin_signed (sin_signed: sin with its first half negated). */
static inline void rotary_heads(float *x, int heads, int head_dim, const float *restrict c,
                                const float *restrict s) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; h++) {
        float *restrict v = x + (long)h * head_dim;
        float lo[MAX_HEAD_DIM / 2], hi[MAX_HEAD_DIM / 2];
        for (int d = 0; d < half; d++) {
            lo[d] = v[d];
            hi[d] = v[half + d];
        }
        for (int d = 0; d < half; d++) {
            v[d] = lo[d] * c[d] + hi[d] * s[d];
            v[half + d] = hi[d] * c[half + d] + lo[d] * s[half + d];
        }
    }
}

/* One token's new k and v (kv: 2 * kv_heads * head_dim floats, k heads then v heads) into cache slot
 * `slot`; int8 caches get one scale per (k/v, head): max|x| / 127. */
static inline void write_kv(const float *restrict kv, long slot, void *cache, float *scales, int quant,
                            int kv_heads, int head_dim) {
    const long n = 2L * kv_heads * head_dim;
    if (!quant) {
        float *restrict dst = (float *)cache + slot * n;
        for (long i = 0; i < n; i++) dst[i] = kv[i];
        return;
    }
    int8_t *restrict dst = (int8_t *)cache + slot * n;
    for (int v = 0; v < 2 * kv_heads; v++) {
        const float *restrict x = kv + (long)v * head_dim;
        float mx = 0.f;
        for (int d = 0; d < head_dim; d++) mx = fmaxf(mx, fabsf(x[d]));
        const float sc = fmaxf(mx * (1.f / 127.f), MIN_KV_SCALE);
        scales[slot * 2 * kv_heads + v] = sc;
        for (int d = 0; d < head_dim; d++) dst[(long)v * head_dim + d] = (int8_t)nearbyintf(x[d] / sc);
    }
}

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

static int check_shape(int num_heads, int kv_heads, int head_dim) {
    const int group = num_heads / kv_heads;
    return head_dim > MAX_HEAD_DIM || (head_dim & 1) || group > MAX_GROUP || group * kv_heads != num_heads ? -1 : 0;
}

static void attend_rows(const float *q, long q_row_stride, const void *kv, const float *scales, int quant,
                        const int32_t *tables, long table_stride, const int32_t *context_lens,
                        const int32_t *tokens, int rows, int num_heads, int kv_heads, int head_dim,
                        int block_size, int window, float scale, float *out) {
    const int group = num_heads / kv_heads;
    const long tasks = (long)rows * kv_heads;
#pragma omp for schedule(dynamic, 1)
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
    if (check_shape(num_heads, kv_heads, head_dim)) return -1;
#pragma omp parallel num_threads(num_threads)
    attend_rows(q, q_row_stride, kv, scales, quant, tables, table_stride, context_lens, tokens, rows, num_heads,
                kv_heads, head_dim, block_size, window, scale, out);
    return 0;
}

/* Rotary in place on x: rows of `heads` contiguous head vectors, rows x_row_stride apart; cos, sin:
 * [rows, head_dim]. */
void kvflow_rotary(float *x, long x_row_stride, int rows, int heads, int head_dim, const float *cos_t,
                   const float *sin_t, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((long)rows * heads * head_dim >= PARALLEL_MIN)
    for (int t = 0; t < rows; t++)
        rotary_heads(x + t * x_row_stride, heads, head_dim, cos_t + (long)t * head_dim, sin_t + (long)t * head_dim);
}

/* Cache write of `rows` tokens: kv rows (k heads then v heads, contiguous) kv_row_stride apart. */
void kvflow_write_kv(const float *kv, long kv_row_stride, const int64_t *slots, int rows, void *cache,
                     float *scales, int quant, int kv_heads, int head_dim, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((long)rows * kv_heads * head_dim >= PARALLEL_MIN)
    for (int t = 0; t < rows; t++)
        write_kv(kv + t * kv_row_stride, slots[t], cache, scales, quant, kv_heads, head_dim);
}

/* A decode step's attention in one call. qkv: [rows, q heads | k heads | v heads] (rows
 * qkv_row_stride apart, one new token per sequence, row r = sequence r); rotary applied to q and k
 * in place, k and v written to slots[r], then row r attends to the first context_lens[r] keys of its
 * table (its new token included). Returns 0, or -1 for shapes beyond the kernel's limits. */
int kvflow_decode_attention(float *qkv, long qkv_row_stride, const float *cos_t, const float *sin_t,
                            void *cache, float *scales, int quant, const int64_t *slots, const int32_t *tables,
                            long table_stride, const int32_t *context_lens, const int32_t *tokens, int rows,
                            int num_heads, int kv_heads, int head_dim, int block_size, int window, float scale,
                            float *out, int num_threads) {
    if (check_shape(num_heads, kv_heads, head_dim)) return -1;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for
        for (int t = 0; t < rows; t++) {
            float *row = qkv + t * qkv_row_stride;
            rotary_heads(row, num_heads + kv_heads, head_dim, cos_t + (long)t * head_dim, sin_t + (long)t * head_dim);
            write_kv(row + (long)num_heads * head_dim, slots[t], cache, scales, quant, kv_heads, head_dim);
        }
        /* the implicit barrier of the loop above: every new key is in the cache */
        attend_rows(qkv, qkv_row_stride, cache, scales, quant, tables, table_stride, context_lens, tokens, rows,
                    num_heads, kv_heads, head_dim, block_size, window, scale, out);
    }
    return 0;
}
