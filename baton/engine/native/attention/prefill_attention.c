/* A prefill row's causal attention in float32 (AVX2 + FMA), where the plan computes in float32
 * (a GGUF, or a checkpoint on a CPU without native bf16): amx_attention.c's float32 twin.
 *
 * torch's CPU flash kernel, with the gathers and copies around it, took a quarter of SmolLM2's
 * prefill of 16 prompts of 128 tokens on the AMX Xeon without its tiles (0.34 ms a prompt and
 * layer for the kernel alone, 0.1 ms more to copy its transposed output back). Here the row's
 * K (transposed) and V are read from the paged cache once per layer into a buffer the calling
 * thread keeps, and each task attends one block of QUERY_BLOCK queries of one head in three
 * passes: the scores of every key the block sees (register tiles of queries by keys), each
 * row's softmax (its maximum known before any exponential: no rescaling; e^(scale * s - max),
 * as torch scales the scores before its softmax), and P V (register tiles of queries by
 * values), divided by the row's sum at the end.
 *
 * Queries are the row's last q_len positions: query i sees keys 0 .. prefix + i (a chunk after
 * a cached prefix, or the whole prompt with prefix 0), with a window only its `window` latest
 * (prefix + i - window + 1 .. prefix + i: Mistral v0.1, Phi-3, Gemma's local layers), whose
 * earlier key blocks a task skips. Gemma 2's scaled scores are soft-capped, softcap *
 * tanh(score / softcap), before the softmax. The cache's elements (kv_cache.h's types) are
 * widened to float32 as they are packed.
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "attention/kv_cache.h"
#include "runtime/thread_buffer.h"
#include "runtime/thread_pool.h"
#include "runtime/vector_math.h"

/* Queries a task attends. Scores take tiles of its 6 rows by 16 keys, P V tiles of 6 rows by 16
 * values: 12 accumulators, two vectors of K or V and a broadcast in the 16 registers. */
#define QUERY_BLOCK 6
#define KEY_BLOCK 16
#define MAX_HEAD_DIM 256

typedef struct {
    const void *k_rows, *v_rows; /* the caches viewed [slots * kv_heads, head_dim] */
    const int64_t *kv_rows;      /* head h's key j is row kv_rows[h * kv_len + j] */
    /* Per KV head: K as [kv_pad / KEY_BLOCK, head_dim, KEY_BLOCK], V as [kv_pad, head_dim]. */
    float *k_t, *v;
    int64_t kv_len, kv_pad, head_dim, kv_type;
} PackLoop;

/* One KV head's block of KEY_BLOCK keys: K transposed within the block (a key per column, so a
 * score tile reads one contiguous block), V as rows; zeros for keys past kv_len, so the last
 * block's tiles read no garbage. */
static void pack_task(const void *arg, int64_t task) {
    const PackLoop *a = arg;
    const int64_t blocks = a->kv_pad / KEY_BLOCK, head = task / blocks, j0 = task % blocks * KEY_BLOCK;
    const int64_t d = a->head_dim;
    float *k_t = a->k_t + head * d * a->kv_pad + j0 * d, *v = a->v + head * a->kv_pad * d;
    for (int64_t j = j0; j < j0 + KEY_BLOCK; j++) {
        if (j < a->kv_len) {
            const int64_t row = a->kv_rows[head * a->kv_len + j];
            float k_row[MAX_HEAD_DIM];
            kv_widen(a->kv_type, a->k_rows, row * d, d, k_row);
            for (int64_t i = 0; i < d; i++) k_t[i * KEY_BLOCK + j - j0] = k_row[i];
            kv_widen(a->kv_type, a->v_rows, row * d, d, v + j * d);
        } else {
            for (int64_t i = 0; i < d; i++) k_t[i * KEY_BLOCK + j - j0] = 0.0f;
            memset(v + j * d, 0, d * sizeof(float));
        }
    }
}

typedef struct {
    const float *q, *k_t, *v;
    float *out;
    int64_t q_stride, out_stride, q_len, prefix, kv_pad, group, head_dim;
    int64_t window; /* 0: every earlier key */
    float scale, softcap;
    _Atomic int *failed;
} AttendLoop;

/* A thread's scores (then probabilities) for one block of queries, kept from task to task. */
static __thread ThreadBuffer scores_buffer;

/* s[r, j0 .. j0 + 15] = q_r . k_j for the block's `rows` queries (q rows MAX_HEAD_DIM apart). */
static inline __attribute__((always_inline)) void score_tile(const float *q, int rows,
                                                             const float *k_t, int64_t d,
                                                             int64_t j0, float *s, int64_t width) {
    const float *k_block = k_t + j0 * d;
    /* One flat array that the unrolled loops index with constants, so that it lives in
     * registers: as [rows][2], GCC also stored every accumulator on each iteration. */
    __m256 acc[2 * QUERY_BLOCK];
    for (int a = 0; a < 2 * rows; a++) acc[a] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i++) {
        const __m256 k0 = _mm256_load_ps(k_block + i * KEY_BLOCK);
        const __m256 k1 = _mm256_load_ps(k_block + i * KEY_BLOCK + 8);
        for (int r = 0; r < rows; r++) {
            const __m256 qi = _mm256_broadcast_ss(q + r * MAX_HEAD_DIM + i);
            acc[2 * r] = _mm256_fmadd_ps(qi, k0, acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(qi, k1, acc[2 * r + 1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(s + r * width + j0, acc[2 * r]);
        _mm256_storeu_ps(s + r * width + j0 + 8, acc[2 * r + 1]);
    }
}

/* Lanes t .. t + 7 that are keys first .. visible - 1. */
static inline __m256 keys_in(int64_t t, int64_t first, int64_t visible) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_and_ps(_mm256_cmp_ps(lane, _mm256_set1_ps((float)(first - t)), _CMP_GE_OQ),
                         _mm256_cmp_ps(lane, _mm256_set1_ps((float)(visible - t)), _CMP_LT_OQ));
}

/* A row's scores become its probabilities e^(scale * s - max) over its keys first ..
 * visible - 1, zeros on the others from `start` (a multiple of KEY_BLOCK, at most first) up to
 * `width` (a multiple of KEY_BLOCK); returns their sum. softcap > 0: the scaled scores are
 * capped first. */
static float softmax_row(float *s, int64_t start, int64_t first, int64_t visible, int64_t width,
                         float scale, float softcap) {
    if (softcap > 0.0f) {
        for (int64_t t = first; t < visible; t++) s[t] = softcap * tanhf(s[t] * scale / softcap);
        scale = 1.0f;
    }
    const __m256 scale8 = _mm256_set1_ps(scale);
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t t = start; t < visible; t += 8) {
        const __m256 in = keys_in(t, first, visible);
        const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(s + t), scale8);
        top = _mm256_max_ps(top, _mm256_blendv_ps(top, scaled, in));
    }
    const __m256 shift = _mm256_set1_ps(hmax8(top));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = start; t < width; t += 8) {
        const __m256 in = keys_in(t, first, visible);
        const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(s + t), scale8);
        /* Masked before the exponential: a key outside the row's may hold any score. */
        const __m256 shifted = _mm256_sub_ps(_mm256_min_ps(scaled, shift), shift);
        const __m256 e = _mm256_and_ps(in, exp_nonpositive(shifted));
        sum = _mm256_add_ps(sum, e);
        _mm256_storeu_ps(s + t, e);
    }
    return hsum8(sum);
}

/* o[r, n0 .. n0 + 15] (+)= sum over keys j0 .. j1 - 1 of p[r, j] v[j, n0 .. n0 + 15]: the first
 * span of keys (`fresh`) starts o, the others add to it. */
static inline __attribute__((always_inline)) void value_tile(const float *p, int rows,
                                                             int64_t width, int64_t j0, int64_t j1,
                                                             const float *v, int64_t d, int64_t n0,
                                                             float *o, int fresh) {
    __m256 acc[2 * QUERY_BLOCK]; /* flat, as in score_tile */
    for (int a = 0; a < 2 * rows; a++)
        acc[a] = fresh ? _mm256_setzero_ps() : _mm256_load_ps(o + a / 2 * MAX_HEAD_DIM + n0 + 8 * (a % 2));
    for (int64_t j = j0; j < j1; j++) {
        const __m256 v0 = _mm256_loadu_ps(v + j * d + n0), v1 = _mm256_loadu_ps(v + j * d + n0 + 8);
        for (int r = 0; r < rows; r++) {
            const __m256 pj = _mm256_broadcast_ss(p + r * width + j);
            acc[2 * r] = _mm256_fmadd_ps(pj, v0, acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(pj, v1, acc[2 * r + 1]);
        }
    }
    for (int a = 0; a < 2 * rows; a++) _mm256_store_ps(o + a / 2 * MAX_HEAD_DIM + n0 + 8 * (a % 2), acc[a]);
}

/* Keys whose V rows P V takes through all of a head's values before the next span: 64 keys of
 * head_dim 64 are 16 KB, which stay in L1 for the head_dim / 16 tiles that read them. */
#define VALUE_SPAN 64

/* Both passes' tiles specialised for each number of rows, so that their loops over rows unroll
 * into registers: the scores of every key block from `start` on, and P V for every 16 values. */
#define DEFINE_PASSES(ROWS)                                                                      \
    static void scores_##ROWS(const float *q, const float *k_t, int64_t d, int64_t start,       \
                              int64_t width, float *s) {                                         \
        for (int64_t j0 = start; j0 < width; j0 += KEY_BLOCK)                                    \
            score_tile(q, ROWS, k_t, d, j0, s, width);                                           \
    }                                                                                            \
    static void values_##ROWS(const float *p, int64_t start, int64_t width, const float *v,     \
                              int64_t d, float *o) {                                             \
        for (int64_t j0 = start; j0 < width; j0 += VALUE_SPAN)                                   \
            for (int64_t n0 = 0; n0 < d; n0 += 16)                                               \
                value_tile(p, ROWS, width, j0, j0 + VALUE_SPAN < width ? j0 + VALUE_SPAN : width, \
                           v, d, n0, o, j0 == start);                                            \
    }
DEFINE_PASSES(1)
DEFINE_PASSES(2)
DEFINE_PASSES(3)
DEFINE_PASSES(4)
DEFINE_PASSES(5)
DEFINE_PASSES(6)

typedef void (*scores_fn)(const float *, const float *, int64_t, int64_t, int64_t, float *);
typedef void (*values_fn)(const float *, int64_t, int64_t, const float *, int64_t, float *);
static const scores_fn SCORES[QUERY_BLOCK + 1] = {NULL,     scores_1, scores_2, scores_3,
                                                  scores_4, scores_5, scores_6};
static const values_fn VALUES[QUERY_BLOCK + 1] = {NULL,     values_1, values_2, values_3,
                                                  values_4, values_5, values_6};

static void attend_task(const void *arg, int64_t task) {
    const AttendLoop *a = arg;
    const int64_t q_blocks = (a->q_len + QUERY_BLOCK - 1) / QUERY_BLOCK;
    const int64_t head = task / q_blocks, i0 = task % q_blocks * QUERY_BLOCK, d = a->head_dim;
    const int rows = (int)(a->q_len - i0 < QUERY_BLOCK ? a->q_len - i0 : QUERY_BLOCK);
    const int64_t kv_head = head / a->group;
    const float *k_t = a->k_t + kv_head * d * a->kv_pad, *v = a->v + kv_head * a->kv_pad * d;
    /* Keys the block's last query sees; query r sees prefix + i0 + r + 1 of them. */
    const int64_t seen = a->prefix + i0 + rows, blocks = (seen + KEY_BLOCK - 1) / KEY_BLOCK;
    const int64_t width = blocks * KEY_BLOCK;
    /* Query r sees keys from first_r = prefix + i0 + r + 1 - window on (0 without a window);
     * the key blocks before the block's first query's are skipped. */
    const int64_t first0 = a->window > 0 && a->prefix + i0 + 1 > a->window
                               ? a->prefix + i0 + 1 - a->window : 0;
    const int64_t start = first0 / KEY_BLOCK * KEY_BLOCK;
    float *s = thread_buffer(&scores_buffer, QUERY_BLOCK * width * sizeof(float));
    if (!s) {
        atomic_store(a->failed, 1);
        return;
    }
    _Alignas(32) float q[QUERY_BLOCK][MAX_HEAD_DIM];
    _Alignas(32) float o[QUERY_BLOCK][MAX_HEAD_DIM];
    float total[QUERY_BLOCK];
    for (int r = 0; r < rows; r++) memcpy(q[r], a->q + (i0 + r) * a->q_stride + head * d, d * sizeof(float));
    SCORES[rows](&q[0][0], k_t, d, start, width, s);
    for (int r = 0; r < rows; r++) {
        const int64_t seen_r = a->prefix + i0 + r + 1;
        const int64_t first_r = a->window > 0 && seen_r > a->window ? seen_r - a->window : 0;
        total[r] = softmax_row(s + r * width, start, first_r, seen_r, width, a->scale, a->softcap);
    }
    VALUES[rows](s, start, width, v, d, &o[0][0]);
    for (int r = 0; r < rows; r++) {
        float *out = a->out + (i0 + r) * a->out_stride + head * d;
        const __m256 inverse = _mm256_set1_ps(1.0f / total[r]);
        for (int64_t i = 0; i < d; i += 8)
            _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_load_ps(o[r] + i), inverse));
    }
}

/* out [q_len, q_heads, head_dim] (rows out_stride floats apart) = causal attention of q
 * [q_len, q_heads, head_dim] (rows q_stride apart) over the prefix + q_len keys at kv_rows of
 * the caches, of kv_type elements (KvType); within a query's `window` latest keys where
 * window > 0, its scaled scores soft-capped where softcap > 0. Returns 0, -2 if memory ran out,
 * -3 for a head_dim that is not a multiple of 16 up to MAX_HEAD_DIM. */
int baton_prefill_attention_f32(const float *q, int64_t q_stride, int64_t q_len, int64_t prefix,
                                const void *k_cache, const void *v_cache,
                                const int64_t *kv_rows, int64_t q_heads, int64_t kv_heads,
                                int64_t head_dim, float scale, float *out, int64_t out_stride,
                                int64_t kv_type, int64_t window, float softcap) {
    if (head_dim % 16 || head_dim > MAX_HEAD_DIM || q_heads % kv_heads || q_len < 1) return -3;
    const int64_t kv_len = prefix + q_len;
    const int64_t kv_pad = (kv_len + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    /* The row's K and V, in a buffer the calling thread keeps from call to call. */
    static __thread ThreadBuffer packed_buffer;
    float *packed = thread_buffer(&packed_buffer, 2 * kv_heads * kv_pad * head_dim * sizeof(float));
    if (!packed) return -2;
    float *v = packed + kv_heads * kv_pad * head_dim;
    const PackLoop pack = {k_cache, v_cache, kv_rows, packed, v, kv_len, kv_pad, head_dim, kv_type};
    baton_parallel(pack_task, &pack, kv_heads * (kv_pad / KEY_BLOCK));
    _Atomic int failed = 0;
    const AttendLoop attend = {q,      packed,  v,       out,    q_stride, out_stride,
                               q_len,  prefix,  kv_pad,  q_heads / kv_heads, head_dim,
                               window, scale,   softcap, &failed};
    baton_parallel(attend_task, &attend, q_heads * ((q_len + QUERY_BLOCK - 1) / QUERY_BLOCK));
    return atomic_load(&failed) ? -2 : 0;
}
