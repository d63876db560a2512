/* Paged attention for query rows that each attend to their sequence's cached keys, read in place.
 *
 * Built at first use by kvflow/kernels/cpu/native.py (g++ -O3 -march=native -fopenmp) and called through
 * ctypes. The torch path gathers (copies) every sequence's KV and pads a batch to its longest
 * context before scaled_dot_product_attention; this kernel walks each sequence's block table and
 * reads K/V where they lie, once, with an online softmax -- so a step costs the KV that is really
 * there, and blocks shared by several sequences (prefix caching) are read from cache, not copied.
 *
 * Cache layout (see kvflow/attention/backend.py): data [num_blocks, block_size, 2, kv_heads, head_dim],
 * float32, bfloat16 (`fmt` KV_BF16: computed in float32, stored rounded to nearest), or quantized --
 * int8, fp8 e4m3 / e5m2, int4 (head_dim / 2 bytes a row) -- with scales [num_blocks, block_size, 2,
 * kv_heads] (one per token, K/V and head; attention.h).
 *
 * One task = one (query row, kv head): the `group` query heads sharing that kv head are scored
 * together, so each K/V row is loaded once for all of them.
 *
 * Also here: rotary (kvflow_rotary) and the cache write (kvflow_write_kv, quantized caches
 * quantized there), by the same code (attention.h) as the native decode pass (decode_pass.cpp), so a token's
 * cached K/V are bit for bit the same whichever path computed them.
 */
#include "attention.h"

extern "C" {

/* rows: query rows (one token each). For row r:
 *   q[tokens[r] * q_row_stride + head * head_dim + d]          its query (float32)
 *   tables[r * table_stride + i]                                 its sequence's block table
 *   keys at positions [max(0, context_lens[r] - window), context_lens[r])  (window <= 0: all)
 *   out[tokens[r] * num_heads * head_dim + head * head_dim + d]  its output (float32)
 * head_major: rows share sequences (prefill chunks): 1 a task per (row, kv head), 2 in tiles where the
 * shape allows (tiled_attention.h); see attend_rows.
 * softcap > 0: scores (scale * q.k) become tanh(score / softcap) * softcap before the softmax.
 * Returns 0, or -1 when head_dim / group exceed the kernel's limits (checked by the caller too). */
int kvflow_paged_attention(const float *q, long q_row_stride, const void *kv, const float *scales,
                           int fmt, const int32_t *tables, long table_stride, const int32_t *context_lens,
                           const int32_t *tokens, int rows, int num_heads, int kv_heads,
                           int head_dim, int block_size, int window, float scale, float *out,
                           int num_threads, int head_major, float softcap) {
    if (check_shape(num_heads, kv_heads, head_dim)) return -1;
    static thread_local std::vector<float> parts;  /* the calling thread's, named before the region */
    std::vector<float> *segments = &parts;
#pragma omp parallel num_threads(num_threads)
    attend_rows(q, q_row_stride, kv, scales, fmt, tables, table_stride, context_lens, tokens, rows, num_heads,
                kv_heads, head_dim, block_size, window, scale, out, head_major, softcap, segments);
    return 0;
}

/* 1 where prefill tiles over a bf16 cache multiply in bf16 (AVX512_BF16; tiled_attention.h), else 0. */
int kvflow_tile_bf16_products(void) { return KVFLOW_TILE_BF16_PRODUCTS; }

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
                     float *scales, int fmt, int kv_heads, int head_dim, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if ((long)rows * kv_heads * head_dim >= PARALLEL_MIN)
    for (int t = 0; t < rows; t++)
        write_kv(kv + t * kv_row_stride, slots[t], cache, scales, fmt, kv_heads, head_dim);
}

}  // extern "C"
