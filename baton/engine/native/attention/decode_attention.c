/* Decode-step attention for float32 queries over paged KV caches (AVX2 + FMA).
 *
 * It reads the page table in place: no K/V gather, no padding to the longest row, no mask.
 * Cache layout (KVPool): [pages, page_size, kv_heads, head_dim], a token's K at flat slot
 * page * page_size + offset, in any of kv_cache.h's element types, widened to float32 as they
 * are loaded (each type has its own copy of the kernel, so the float32 one is unchanged).
 * head_dim must be a multiple of 8 (the caller checks). A layer with a window (Mistral v0.1,
 * Phi-3, Gemma's local layers) reads its row's last `window` tokens only; Gemma 2's scores are
 * soft-capped, softcap * tanh(score / softcap), before the softmax.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "attention/kv_cache.h"
#include "runtime/thread_pool.h"
#include "runtime/vector_math.h"

/* The functions below take the cache's element type as their last argument and are inlined
 * into one attend task per type, where it is a constant: the type's loads alone remain. */
#define INLINE static inline __attribute__((always_inline))

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

/* q . the key at element `key` of the cache. */
INLINE float dot(const float *q, const void *cache, int64_t key, int64_t n, int type) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv_load8(type, cache, key + i), acc);
    return hsum8(acc);
}

/* q . key for 8 keys (token_stride elements apart, the first at element `keys` of the cache) at
 * once, written to s[0..8): the 8 accumulators are reduced together by a horizontal-add tree, a
 * fraction of eight separate reductions. */
INLINE void dot_8_keys(const float *q, const void *cache, int64_t keys, int64_t token_stride,
                       int64_t head_dim, float scale, float *s, int type) {
    __m256 acc[8];
    for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 qd = _mm256_loadu_ps(q + d);
        for (int k = 0; k < 8; k++)
            acc[k] = _mm256_fmadd_ps(qd, kv_load8(type, cache, keys + k * token_stride + d), acc[k]);
    }
    __m256 pair01 = _mm256_hadd_ps(acc[0], acc[1]), pair23 = _mm256_hadd_ps(acc[2], acc[3]);
    __m256 pair45 = _mm256_hadd_ps(acc[4], acc[5]), pair67 = _mm256_hadd_ps(acc[6], acc[7]);
    __m256 quad0 = _mm256_hadd_ps(pair01, pair23), quad1 = _mm256_hadd_ps(pair45, pair67);
    __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(quad0, quad1, 0x20),
                                _mm256_permute2f128_ps(quad0, quad1, 0x31));
    _mm256_storeu_ps(s, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
}

/* Ask the cache for `width` bytes of each of a page's `tokens` tokens (token_bytes apart): one
 * head's slice, or with width = token_bytes the whole page. */
static inline void prefetch_page(const char *start, int64_t tokens, int64_t token_bytes,
                                 int64_t width) {
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t i = 0; i < width; i += 64)
            _mm_prefetch(start + t * token_bytes + i, _MM_HINT_T0);
}

/* out[0 .. 8 * vectors) = sum over the tokens t in [begin, end) of p[t - begin] * V[t], V[t]
 * read from element `values` (one head's slice) of token t's slot on; `vectors` is a constant
 * where it is inlined, so the sums stay in registers. */
INLINE void weigh_values(int vectors, const void *cache, int64_t values, const int32_t *pages,
                         int64_t begin, int64_t end, int64_t token_stride, int64_t page_size,
                         const float *p, float *out, int type) {
    const int64_t bytes = kv_element_bytes(type);
    __m256 acc[8];
    for (int v = 0; v < vectors; v++) acc[v] = _mm256_setzero_ps();
    for (int64_t t = begin; t < end;) {
        const int64_t offset = t % page_size, run = end - t < page_size - offset
                                                        ? end - t : page_size - offset;
        int64_t value = values + ((int64_t)pages[t / page_size] * page_size + offset) *
                                     token_stride;
        const float *weights = p + (t - begin);
        if (t + run < end) {
            const int64_t next = values + (int64_t)pages[(t + run) / page_size] * page_size *
                                              token_stride;
            prefetch_page((const char *)cache + next * bytes, page_size, token_stride * bytes,
                          8 * vectors * bytes);
        }
        for (int64_t o = 0; o < run; o++, value += token_stride) {
            const __m256 weight = _mm256_set1_ps(weights[o]);
            for (int v = 0; v < vectors; v++)
                acc[v] = _mm256_fmadd_ps(weight, kv_load8(type, cache, value + 8 * v), acc[v]);
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
INLINE int attend_range(const float *q, const void *k_cache, const void *v_cache,
                        const int32_t *pages, int64_t begin, int64_t end, int64_t group,
                        int64_t kv_heads, int64_t head_dim, int64_t page_size,
                        float scale, float softcap, float *out, float *top, float *total,
                        int type) {
    const int64_t token_stride = kv_heads * head_dim, queries = kv_heads * group;
    const int64_t token_bytes = token_stride * kv_element_bytes(type);
    const int64_t len = end - begin;
    float *scores = malloc(sizeof(float) * queries * len);
    if (!scores) return -1;
    /* scores[h * group + g][t - begin]: query head h * group + g against token t. */
    for (int64_t t = begin; t < end;) {
        const int64_t offset = t % page_size, run = end - t < page_size - offset
                                                        ? end - t : page_size - offset;
        const int64_t keys = ((int64_t)pages[t / page_size] * page_size + offset) * token_stride;
        if (t + run < end) /* the next page's keys, which the prefetcher cannot guess */
            prefetch_page((const char *)k_cache + (int64_t)pages[(t + run) / page_size] *
                                                      page_size * token_bytes,
                          page_size, token_bytes, token_bytes);
        float *s = scores + (t - begin);
        int64_t o = 0;
        for (; o + 8 <= run; o += 8)
            for (int64_t h = 0; h < kv_heads; h++)
                for (int64_t g = 0; g < group; g++)
                    dot_8_keys(q + (h * group + g) * head_dim, k_cache,
                               keys + o * token_stride + h * head_dim, token_stride, head_dim,
                               scale, s + (h * group + g) * len + o, type);
        for (; o < run; o++)
            for (int64_t h = 0; h < kv_heads; h++)
                for (int64_t g = 0; g < group; g++)
                    s[(h * group + g) * len + o] =
                        dot(q + (h * group + g) * head_dim, k_cache,
                            keys + o * token_stride + h * head_dim, head_dim, type) * scale;
        t += run;
    }
    if (softcap > 0.0f) /* the scaled scores capped, as transformers' Gemma 2 computes them */
        for (int64_t i = 0; i < queries * len; i++) scores[i] = softcap * tanhf(scores[i] / softcap);
    for (int64_t j = 0; j < queries; j++)
        exponentiate(scores + j * len, len, &top[j], &total[j]);
    /* Each query's output, a slice of head_dim at a time, accumulates in registers over every
     * token (in token order, as torch's weighted sum runs): one FMA per 8 values, where
     * accumulating in memory cost a load and a store each. */
    for (int64_t j = 0; j < queries; j++) {
        const int64_t v_head = (j / group) * head_dim;
        for (int64_t d = 0; d < head_dim;) {
            const int64_t left = head_dim - d;
            float *out_slice = out + j * head_dim + d;
            const float *p = scores + j * len;
            if (left >= 64) {
                weigh_values(8, v_cache, v_head + d, pages, begin, end, token_stride, page_size, p,
                             out_slice, type);
                d += 64;
            } else if (left >= 32) {
                weigh_values(4, v_cache, v_head + d, pages, begin, end, token_stride, page_size, p,
                             out_slice, type);
                d += 32;
            } else if (left >= 16) {
                weigh_values(2, v_cache, v_head + d, pages, begin, end, token_stride, page_size, p,
                             out_slice, type);
                d += 16;
            } else {
                weigh_values(1, v_cache, v_head + d, pages, begin, end, token_stride, page_size, p,
                             out_slice, type);
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
    const float *q;
    const void *k_cache, *v_cache;
    const int32_t *rows, *kv_indptr, *kv_indices, *kv_lens;
    int64_t q_stride, parts, group, q_heads, kv_heads, head_dim, page_size;
    int64_t window; /* the tokens a query sees, its own included; 0: all of them */
    float scale, softcap;
    float *partial, *tops, *totals, *out;
    _Atomic int *failed; /* set by any task whose scores buffer could not be allocated */
} AttentionLoop;

/* One (row, part) of the tokens the rows' queries see, over a cache of `type`. */
INLINE void attend_task(const void *arg, int64_t task, int type) {
    const AttentionLoop *a = arg;
    const int64_t i = task / a->parts, part = task % a->parts, kv_len = a->kv_lens[a->rows[i]];
    /* The query (the row's last token) sees the tokens kv_len - window .. kv_len - 1. */
    const int64_t first = a->window > 0 && kv_len > a->window ? kv_len - a->window : 0;
    const int64_t len = kv_len - first;
    int64_t used = len / MIN_TOKENS_PER_PART < a->parts ? len / MIN_TOKENS_PER_PART : a->parts;
    used = used > 1 ? used : 1;
    const int64_t share = (len + used - 1) / used;
    const int64_t begin = first + part * share;
    const int64_t end = begin + share < kv_len ? begin + share : kv_len;
    float *top = a->tops + task * a->q_heads, *total = a->totals + task * a->q_heads;
    if (begin >= end) { /* an unused part: empty, weighs nothing in the merge */
        for (int64_t j = 0; j < a->q_heads; j++) top[j] = -INFINITY, total[j] = 0.0f;
        return;
    }
    if (attend_range(a->q + i * a->q_stride, a->k_cache, a->v_cache,
                     a->kv_indices + a->kv_indptr[a->rows[i]], begin, end, a->group, a->kv_heads,
                     a->head_dim, a->page_size, a->scale, a->softcap,
                     a->partial + task * a->q_heads * a->head_dim, top, total, type))
        atomic_store(a->failed, 1);
}

#define DEFINE_ATTEND_TASK(NAME, TYPE) \
    static void NAME(const void *arg, int64_t task) { attend_task(arg, task, TYPE); }
DEFINE_ATTEND_TASK(attend_f32, KV_F32)
DEFINE_ATTEND_TASK(attend_bf16, KV_BF16)
DEFINE_ATTEND_TASK(attend_f16, KV_F16)
DEFINE_ATTEND_TASK(attend_e4m3, KV_E4M3)
DEFINE_ATTEND_TASK(attend_e5m2, KV_E5M2)
static const chunk_fn ATTEND_TASKS[] = {attend_f32, attend_bf16, attend_f16, attend_e4m3,
                                         attend_e5m2}; /* by KvType */

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
 * kv_lens[rows[i]] cached tokens, its last `window` of them where window > 0, the scaled scores
 * soft-capped where softcap > 0. q: [n, q_heads, head_dim] with row stride q_stride; rows: the
 * batch row of each query (its pages are kv_indices[kv_indptr[row] : kv_indptr[row + 1]]); the
 * caches' elements of kv_type (KvType); out: [n, q_heads, head_dim], contiguous. Returns 0, or
 * -1 if memory ran out.
 *
 * A row is one task while there are rows for every thread. Fewer rows are each split into
 * parts of their tokens, all heads in each (split-K, as flash-decoding does): every thread gets
 * an equal share of the K/V to read, and the parts' softmaxes are merged by their maxima. */
int baton_decode_attention(const float *q, int64_t q_stride, const int32_t *rows, int64_t n,
                           const void *k_cache, const void *v_cache, const int32_t *kv_indptr,
                           const int32_t *kv_indices, const int32_t *kv_lens, int64_t q_heads,
                           int64_t kv_heads, int64_t head_dim, int64_t page_size, float scale,
                           float softcap, int64_t window, int64_t kv_type, float *out) {
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
        .head_dim = head_dim, .page_size = page_size, .window = window, .scale = scale,
        .softcap = softcap, .partial = partial,
        .tops = tops, .totals = totals, .out = out, .failed = &any_failed};
    baton_parallel(ATTEND_TASKS[kv_type], &loop, n * parts);
    const int failed = atomic_load(&any_failed);
    if (!failed) baton_parallel(merge_row, &loop, n);
    free(partial);
    return failed ? -1 : 0;
}
