/* The row-wise ops around a decoder layer's attention (AVX2 + FMA), for float32 activations:
 * RMSNorm, and RoPE with the store of each token's K and V into the paged cache, rounded into
 * its element type (attention/kv_cache.h) as KVPool.write rounds them.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "attention/kv_cache.h"
#include "runtime/thread_pool.h"
#include "runtime/vector_math.h"

/* Rows (of a norm) or tokens (of RoPE) one task of a parallel loop takes: a prefill's thousand
 * rows spread over the threads, a decode step's few stay on the calling one. */
#define ROWS_PER_TASK 32

typedef struct {
    const float *x, *weight;
    float *out;
    int64_t rows, dim;
    float eps;
} NormLoop;

static void rms_norm_task(const void *arg, int64_t task) {
    const NormLoop *n = arg;
    const int64_t end = (task + 1) * ROWS_PER_TASK < n->rows ? (task + 1) * ROWS_PER_TASK : n->rows;
    for (int64_t r = task * ROWS_PER_TASK; r < end; r++) {
        const float *xr = n->x + r * n->dim;
        float *outr = n->out + r * n->dim;
        __m256 squares = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n->dim; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            squares = _mm256_fmadd_ps(v, v, squares);
        }
        float total = hsum8(squares);
        for (; i < n->dim; i++) total += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(total / (float)n->dim + n->eps);
        for (i = 0; i < n->dim; i++) outr[i] = xr[i] * inv * n->weight[i];
    }
}

/* out = x / sqrt(mean(x^2) + eps) * weight for each of `rows` rows of `dim` (contiguous),
 * the order of operations of torch's float32 rms_norm. */
void baton_rms_norm(const float *x, int64_t rows, int64_t dim, const float *weight, float eps,
                    float *out) {
    const NormLoop loop = {x, weight, out, rows, dim, eps};
    baton_parallel(rms_norm_task, &loop, (rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
}

/* Rotate each token's q and k heads by its position (rotate-half RoPE, as layers.apply_rope)
 * in place, and store its K and V at its slot. qk: [tokens, q_heads + kv_heads, head_dim] with
 * token stride qk_stride; v: [tokens, kv_heads, head_dim] with token stride v_stride; cos/sin:
 * [positions, head_dim / 2]; the caches' elements of kv_type (KvType). */
typedef struct {
    float *qk;
    const float *v, *cos_table, *sin_table;
    const int64_t *positions, *slots;
    void *k_cache, *v_cache;
    int64_t qk_stride, v_stride, tokens, q_heads, kv_heads, head_dim, kv_type;
} RopeLoop;

static void rope_task(const void *arg, int64_t task) {
    const RopeLoop *a = arg;
    float *qk = a->qk;
    const float *v = a->v, *cos_table = a->cos_table, *sin_table = a->sin_table;
    const int64_t *positions = a->positions, *slots = a->slots;
    const int64_t qk_stride = a->qk_stride, v_stride = a->v_stride, q_heads = a->q_heads;
    const int64_t kv_heads = a->kv_heads, head_dim = a->head_dim;
    const int64_t half = head_dim / 2, heads = q_heads + kv_heads;
    const int64_t end = (task + 1) * ROWS_PER_TASK < a->tokens ? (task + 1) * ROWS_PER_TASK : a->tokens;
    for (int64_t t = task * ROWS_PER_TASK; t < end; t++) {
        const float *cos_row = cos_table + positions[t] * half;
        const float *sin_row = sin_table + positions[t] * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x = qk + t * qk_stride + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * cos_row[i] - x2 * sin_row[i];
                x[i + half] = x2 * cos_row[i] + x1 * sin_row[i];
            }
        }
        const int64_t first = slots[t] * kv_heads * head_dim;
        kv_store(a->kv_type, a->k_cache, first, qk + t * qk_stride + q_heads * head_dim,
                 kv_heads * head_dim);
        kv_store(a->kv_type, a->v_cache, first, v + t * v_stride, kv_heads * head_dim);
    }
}

void baton_rope_and_store(float *qk, int64_t qk_stride, const float *v, int64_t v_stride,
                          int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                          const float *cos_table, const float *sin_table,
                          const int64_t *positions, const int64_t *slots, void *k_cache,
                          void *v_cache, int64_t kv_type) {
    const RopeLoop loop = {qk,        v,        cos_table, sin_table, positions,
                           slots,     k_cache,  v_cache,   qk_stride, v_stride,
                           tokens,    q_heads,  kv_heads,  head_dim,  kv_type};
    baton_parallel(rope_task, &loop, (tokens + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
}
