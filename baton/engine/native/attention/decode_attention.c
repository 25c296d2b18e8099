/* Decode-step attention, RoPE and RMSNorm for float32 activations and paged KV caches (AVX2 + FMA).
 *
 * Both read the page table in place: no K/V gather, no padding to the longest row, no mask.
 * Cache layout (KVPool): [pages, page_size, kv_heads, head_dim], a token's K at flat slot
 * page * page_size + offset. head_dim must be a multiple of 8 (the caller checks).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "runtime/thread_pool.h"
#include "runtime/vector_math.h"

/* s[t] = e^(s[t] - top) in place for t in [0, len), with top the largest s[t] and total the
 * sum of the exponentials: a softmax left unnormalized, so parts of a row can be merged. */
static void exponentiate(float *s, int64_t len, float *top_out, float *total_out) {
    float top = s[0];
    for (int64_t t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
    __m256 top_v = _mm256_set1_ps(top), sum_v = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), top_v));
        _mm256_storeu_ps(s + t, e);
        sum_v = _mm256_add_ps(sum_v, e);
    }
    float total = hsum8(sum_v);
    for (; t < len; t++) {
        s[t] = expf(s[t] - top);
        total += s[t];
    }
    *top_out = top;
    *total_out = total;
}

/* out = the softmax-weighted V of one query from `parts` unnormalized parts (stride apart in
 * the part arrays, counted in queries): each part's sums rescaled to the largest maximum. */
static void merge_parts(const float *partial, const float *tops, const float *totals,
                        int64_t parts, int64_t stride, int64_t head_dim, float *out) {
    float top = tops[0];
    for (int64_t p = 1; p < parts; p++) top = tops[p * stride] > top ? tops[p * stride] : top;
    float total = 0.0f;
    for (int64_t d = 0; d < head_dim; d++) out[d] = 0.0f;
    for (int64_t p = 0; p < parts; p++) {
        if (totals[p * stride] == 0.0f) continue; /* an empty part */
        const float weight = expf(tops[p * stride] - top);
        total += weight * totals[p * stride];
        for (int64_t d = 0; d < head_dim; d++)
            out[d] += weight * partial[p * stride * head_dim + d];
    }
    for (int64_t d = 0; d < head_dim; d++) out[d] /= total;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum8(acc);
}

/* q . key for 8 keys (token_stride apart) at once, written to s[0..8): the 8 accumulators are
 * reduced together by a horizontal-add tree, a fraction of eight separate reductions. */
static inline void dot_8_keys(const float *q, const float *keys, int64_t token_stride,
                              int64_t head_dim, float scale, float *s) {
    __m256 acc[8];
    for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 qd = _mm256_loadu_ps(q + d);
        for (int k = 0; k < 8; k++)
            acc[k] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(keys + k * token_stride + d), acc[k]);
    }
    __m256 pair01 = _mm256_hadd_ps(acc[0], acc[1]), pair23 = _mm256_hadd_ps(acc[2], acc[3]);
    __m256 pair45 = _mm256_hadd_ps(acc[4], acc[5]), pair67 = _mm256_hadd_ps(acc[6], acc[7]);
    __m256 quad0 = _mm256_hadd_ps(pair01, pair23), quad1 = _mm256_hadd_ps(pair45, pair67);
    __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(quad0, quad1, 0x20),
                                _mm256_permute2f128_ps(quad0, quad1, 0x31));
    _mm256_storeu_ps(s, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
}

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
 * [positions, head_dim / 2]. */
typedef struct {
    float *qk;
    const float *v, *cos_table, *sin_table;
    const int64_t *positions, *slots;
    float *k_cache, *v_cache;
    int64_t qk_stride, v_stride, tokens, q_heads, kv_heads, head_dim;
} RopeLoop;

static void rope_task(const void *arg, int64_t task) {
    const RopeLoop *a = arg;
    float *qk = a->qk, *k_cache = a->k_cache, *v_cache = a->v_cache;
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
        float *k_out = k_cache + slots[t] * kv_heads * head_dim;
        float *v_out = v_cache + slots[t] * kv_heads * head_dim;
        const float *k_in = qk + t * qk_stride + q_heads * head_dim;
        const float *v_in = v + t * v_stride;
        for (int64_t i = 0; i < kv_heads * head_dim; i++) {
            k_out[i] = k_in[i];
            v_out[i] = v_in[i];
        }
    }
}

void baton_rope_and_store(float *qk, int64_t qk_stride, const float *v, int64_t v_stride,
                          int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                          const float *cos_table, const float *sin_table,
                          const int64_t *positions, const int64_t *slots, float *k_cache,
                          float *v_cache) {
    const RopeLoop loop = {qk,        v,        cos_table, sin_table, positions,
                           slots,     k_cache,  v_cache,   qk_stride, v_stride,
                           tokens,    q_heads,  kv_heads,  head_dim};
    baton_parallel(rope_task, &loop, (tokens + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
}

/* Ask the cache for `width` floats of each of a page's `tokens` tokens (token_stride apart):
 * one head's slice, or with width = token_stride the whole page. */
static inline void prefetch_page(const float *start, int64_t tokens, int64_t token_stride,
                                 int64_t width) {
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t i = 0; i < width; i += 16)
            _mm_prefetch((const char *)(start + t * token_stride + i), _MM_HINT_T0);
}

/* out[0 .. 8 * vectors) = sum over the tokens t in [begin, end) of p[t - begin] * V[t], V[t]
 * read at `values` (one head's slice) in token t's slot; `vectors` is a constant where it is
 * inlined, so the sums stay in registers. */
static inline __attribute__((always_inline)) void weigh_values(
    int vectors, const float *values, const int32_t *pages, int64_t begin, int64_t end,
    int64_t token_stride, int64_t page_size, const float *p, float *out) {
    __m256 acc[8];
    for (int v = 0; v < vectors; v++) acc[v] = _mm256_setzero_ps();
    for (int64_t t = begin; t < end;) {
        const int64_t offset = t % page_size, run = end - t < page_size - offset
                                                        ? end - t : page_size - offset;
        const float *value = values + ((int64_t)pages[t / page_size] * page_size + offset) *
                                          token_stride;
        const float *weights = p + (t - begin);
        if (t + run < end)
            prefetch_page(values + (int64_t)pages[(t + run) / page_size] * page_size * token_stride,
                          page_size, token_stride, 8 * vectors);
        for (int64_t o = 0; o < run; o++, value += token_stride) {
            const __m256 weight = _mm256_set1_ps(weights[o]);
            for (int v = 0; v < vectors; v++)
                acc[v] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(value + 8 * v), acc[v]);
        }
        t += run;
    }
    for (int v = 0; v < vectors; v++) _mm256_storeu_ps(out + 8 * v, acc[v]);
}

/* One row's attention over its cached tokens [begin, end), left unnormalized: for query head
 * j, top[j] = its largest score,
 * total[j] = sum of e^(score - top[j]) and out[j] = sum of e^(score - top[j]) * V. Tokens are
 * walked page by page (no division per key); the scores token by token across the heads, so
 * each token's K (all heads side by side) is read front to back, and the weighted V query by
 * query (weigh_values), the group's queries re-reading their head's V from the cache. */
static int attend_range(const float *q, const float *k_cache, const float *v_cache,
                        const int32_t *pages, int64_t begin, int64_t end, int64_t group,
                        int64_t kv_heads, int64_t head_dim, int64_t page_size,
                        float scale, float *out, float *top, float *total) {
    const int64_t token_stride = kv_heads * head_dim, queries = kv_heads * group;
    const int64_t len = end - begin;
    float *scores = malloc(sizeof(float) * queries * len);
    if (!scores) return -1;
    /* scores[h * group + g][t - begin]: query head h * group + g against token t. */
    for (int64_t t = begin; t < end;) {
        const int64_t offset = t % page_size, run = end - t < page_size - offset
                                                        ? end - t : page_size - offset;
        const float *keys = k_cache + ((int64_t)pages[t / page_size] * page_size + offset) *
                                          token_stride;
        if (t + run < end) /* the next page's keys, which the prefetcher cannot guess */
            prefetch_page(k_cache + (int64_t)pages[(t + run) / page_size] * page_size *
                                        token_stride, page_size, token_stride, token_stride);
        float *s = scores + (t - begin);
        int64_t o = 0;
        for (; o + 8 <= run; o += 8)
            for (int64_t h = 0; h < kv_heads; h++)
                for (int64_t g = 0; g < group; g++)
                    dot_8_keys(q + (h * group + g) * head_dim, keys + o * token_stride + h * head_dim,
                               token_stride, head_dim, scale, s + (h * group + g) * len + o);
        for (; o < run; o++)
            for (int64_t h = 0; h < kv_heads; h++)
                for (int64_t g = 0; g < group; g++)
                    s[(h * group + g) * len + o] =
                        dot(q + (h * group + g) * head_dim, keys + o * token_stride + h * head_dim,
                            head_dim) * scale;
        t += run;
    }
    for (int64_t j = 0; j < queries; j++)
        exponentiate(scores + j * len, len, &top[j], &total[j]);
    /* Each query's output, a slice of head_dim at a time, accumulates in registers over every
     * token (in token order, as torch's weighted sum runs): one FMA per 8 values, where
     * accumulating in memory cost a load and a store each. */
    for (int64_t j = 0; j < queries; j++) {
        const float *v_head = v_cache + (j / group) * head_dim;
        for (int64_t d = 0; d < head_dim;) {
            const int64_t left = head_dim - d;
            float *out_slice = out + j * head_dim + d;
            const float *p = scores + j * len;
            if (left >= 64) {
                weigh_values(8, v_head + d, pages, begin, end, token_stride, page_size, p, out_slice);
                d += 64;
            } else if (left >= 32) {
                weigh_values(4, v_head + d, pages, begin, end, token_stride, page_size, p, out_slice);
                d += 32;
            } else if (left >= 16) {
                weigh_values(2, v_head + d, pages, begin, end, token_stride, page_size, p, out_slice);
                d += 16;
            } else {
                weigh_values(1, v_head + d, pages, begin, end, token_stride, page_size, p, out_slice);
                d += 8;
            }
        }
    }
    free(scores);
    return 0;
}

/* Tokens per part below which a row is not split further: a part's fixed costs (its scores
 * buffer, the merge) outweigh the parallelism on shorter ranges. */
#define MIN_TOKENS_PER_PART 32

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int32_t *rows, *kv_indptr, *kv_indices, *kv_lens;
    int64_t q_stride, parts, group, q_heads, kv_heads, head_dim, page_size;
    float scale;
    float *partial, *tops, *totals, *out;
    _Atomic int *failed; /* set by any task whose scores buffer could not be allocated */
} AttentionLoop;

/* One (row, part) of the rows' tokens. */
static void attend_task(const void *arg, int64_t task) {
    const AttentionLoop *a = arg;
    const int64_t i = task / a->parts, part = task % a->parts, len = a->kv_lens[a->rows[i]];
    int64_t used = len / MIN_TOKENS_PER_PART < a->parts ? len / MIN_TOKENS_PER_PART : a->parts;
    used = used > 1 ? used : 1;
    const int64_t share = (len + used - 1) / used;
    const int64_t begin = part * share, end = begin + share < len ? begin + share : len;
    float *top = a->tops + task * a->q_heads, *total = a->totals + task * a->q_heads;
    if (begin >= end) { /* an unused part: empty, weighs nothing in the merge */
        for (int64_t j = 0; j < a->q_heads; j++) top[j] = -INFINITY, total[j] = 0.0f;
        return;
    }
    if (attend_range(a->q + i * a->q_stride, a->k_cache, a->v_cache,
                     a->kv_indices + a->kv_indptr[a->rows[i]], begin, end, a->group, a->kv_heads,
                     a->head_dim, a->page_size, a->scale,
                     a->partial + task * a->q_heads * a->head_dim, top, total))
        atomic_store(a->failed, 1);
}

/* One row: its parts merged into its output. */
static void merge_row(const void *arg, int64_t i) {
    const AttentionLoop *a = arg;
    const int64_t parts = a->parts, q_heads = a->q_heads, head_dim = a->head_dim;
    for (int64_t j = 0; j < q_heads; j++)
        merge_parts(a->partial + (i * parts * q_heads + j) * head_dim,
                    a->tops + i * parts * q_heads + j, a->totals + i * parts * q_heads + j, parts,
                    q_heads, head_dim, a->out + (i * q_heads + j) * head_dim);
}

/* One query per row: out[i, h] = softmax(scale * q[i, h] . K_row) V_row over the row's
 * kv_lens[rows[i]] cached tokens. q: [n, q_heads, head_dim] with row stride q_stride; rows: the
 * batch row of each query (its pages are kv_indices[kv_indptr[row] : kv_indptr[row + 1]]);
 * out: [n, q_heads, head_dim], contiguous. Returns 0, or -1 if memory ran out.
 *
 * A row is one task while there are rows for every thread. Fewer rows are each split into
 * parts of their tokens, all heads in each (split-K, as flash-decoding does): every thread gets
 * an equal share of the K/V to read, and the parts' softmaxes are merged by their maxima. */
int baton_decode_attention(const float *q, int64_t q_stride, const int32_t *rows, int64_t n,
                           const float *k_cache, const float *v_cache, const int32_t *kv_indptr,
                           const int32_t *kv_indices, const int32_t *kv_lens, int64_t q_heads,
                           int64_t kv_heads, int64_t head_dim, int64_t page_size, float scale,
                           float *out) {
    const int64_t threads = omp_get_max_threads();
    const int64_t parts = n >= threads ? 1 : (threads + n - 1) / n;
    /* Per (row, part): q_heads unnormalized outputs, maxima and totals. */
    float *partial = malloc(sizeof(float) * n * parts * q_heads * (head_dim + 2));
    if (!partial) return -1;
    float *tops = partial + n * parts * q_heads * head_dim, *totals = tops + n * parts * q_heads;
    _Atomic int any_failed = 0;
    const AttentionLoop loop = {
        .q = q, .k_cache = k_cache, .v_cache = v_cache, .rows = rows, .kv_indptr = kv_indptr,
        .kv_indices = kv_indices, .kv_lens = kv_lens, .q_stride = q_stride, .parts = parts,
        .group = q_heads / kv_heads, .q_heads = q_heads, .kv_heads = kv_heads,
        .head_dim = head_dim, .page_size = page_size, .scale = scale, .partial = partial,
        .tops = tops, .totals = totals, .out = out, .failed = &any_failed};
    baton_parallel(attend_task, &loop, n * parts);
    const int failed = atomic_load(&any_failed);
    if (!failed) baton_parallel(merge_row, &loop, n);
    free(partial);
    return failed ? -1 : 0;
}
