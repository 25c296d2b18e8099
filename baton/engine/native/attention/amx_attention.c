/* A prefill row's causal attention on AMX, where the plan computes it in bf16 (the float32 plan
 * with bf16 GEMMs on an AMX CPU): flash attention with its two products in the tile unit.
 *
 * torch's CPU flash kernel took 140 ms of the 0.5B shape's 1024-token prefill (375 GFLOP/s),
 * and its inputs and output were gathered and cast around it (35 ms more). Here the row's K and
 * V are read from the paged cache once per layer, rounded to bf16 into tile order (K as the
 * B operand of Q K^T, V as that of P V), and each task attends one block of 32 queries of one
 * head: scores in float32 from the tiles, the online softmax in float32 with AVX-512 (as
 * torch's kernel computes it: scores scaled, then e^(s - running max), sums of the float32
 * probabilities), the probabilities rounded to bf16 for P V, the output kept in float32 (the o
 * projection rounds it to bf16 once, as it rounds every row).
 *
 * Queries are the row's last q_len positions: query i sees keys 0 .. prefix + i (a chunk after
 * a cached prefix, or the whole prompt with prefix 0). The cache's elements (kv_cache.h's
 * types) are widened to float32 as they are packed, then rounded to bf16 as float32 ones are.
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "attention/kv_cache.h"
#include "runtime/amx_tiles.h"
#include "runtime/thread_buffer.h"
#include "runtime/thread_pool.h"
#include "runtime/vector_math512.h"

#define QUERY_BLOCK 32 /* queries a task attends: two tiles of 16 rows */
#define KEY_BLOCK 32   /* keys of one step: two B tiles of Q K^T, one K-block of P V */
#define MAX_HEAD_DIM 256

typedef struct {
    const void *k_rows, *v_rows; /* the caches viewed [slots * kv_heads, head_dim] */
    const int64_t *kv_rows;      /* head h's key j is row kv_rows[h * kv_len + j] */
    uint16_t *k_tiles, *v_tiles; /* per KV head: kv_pad * head_dim bf16 each */
    int64_t kv_len, kv_pad, head_dim, kv_type;
} PackLoop;

/* AMX CPUs convert to bf16 in one instruction (AVX512_BF16), rounding to nearest even as torch
 * does; it flushes subnormals to zero, as the tile unit does with its inputs anyway. */
AMX_TARGET static inline __m256i round16_bf16(__m512 v) {
    return (__m256i)_mm512_cvtneps_pbh(v);
}

/* 16 floats at p rounded to bf16. */
AMX_TARGET static inline __m256i bf16_of16(const float *p) {
    return round16_bf16(_mm512_loadu_ps(p));
}

/* One KV head's block of KEY_BLOCK keys into tile order. K, as a weight of kv_pad "features"
 * (keys) by head_dim inputs: tiles of 16 keys by 32 dims, dims pairwise in each tile row. V, as
 * a weight of head_dim features by kv_pad inputs (keys): tiles of 16 dims by 32 keys, each tile
 * row a pair of keys. Keys past kv_len are zeros. */
AMX_TARGET static void pack_task(const void *arg, int64_t task) {
    const PackLoop *a = arg;
    const int64_t blocks = a->kv_pad / KEY_BLOCK, head = task / blocks, j0 = task % blocks * KEY_BLOCK;
    const int64_t d = a->head_dim, dim_blocks = d / TILE_K, key_blocks = a->kv_pad / KEY_BLOCK;
    uint16_t *k_tiles = a->k_tiles + head * a->kv_pad * d, *v_tiles = a->v_tiles + head * a->kv_pad * d;
    _Alignas(64) uint16_t v16[KEY_BLOCK][MAX_HEAD_DIM];
    for (int64_t j = 0; j < KEY_BLOCK; j++) {
        const int64_t key = j0 + j;
        _Alignas(64) uint16_t k16[MAX_HEAD_DIM];
        if (key < a->kv_len) {
            const int64_t row = a->kv_rows[head * a->kv_len + key];
            _Alignas(64) float k32[MAX_HEAD_DIM], v32[MAX_HEAD_DIM];
            kv_widen(a->kv_type, a->k_rows, row * d, d, k32);
            kv_widen(a->kv_type, a->v_rows, row * d, d, v32);
            for (int64_t i = 0; i < d; i += 16) {
                _mm256_store_si256((__m256i *)(k16 + i), bf16_of16(k32 + i));
                _mm256_store_si256((__m256i *)(v16[j] + i), bf16_of16(v32 + i));
            }
        } else {
            memset(k16, 0, sizeof k16);
            memset(v16[j], 0, sizeof v16[j]);
        }
        /* K: key (j0 + j) is feature (j0 + j) % 16 of tile row-block (j0 + j) / 16. */
        const uint32_t *pairs = (const uint32_t *)k16;
        for (int64_t db = 0; db < dim_blocks; db++) {
            uint32_t *tile = (uint32_t *)(k_tiles + (key / TILE_N * dim_blocks + db) * (TILE_BYTES / 2));
            for (int64_t p = 0; p < TILE_K / 2; p++) tile[p * TILE_N + key % TILE_N] = pairs[db * 16 + p];
        }
    }
    /* V: the tile of dims n0 .. n0 + 15 and this block's keys; row p holds keys 2p and 2p + 1. */
    const int64_t kb = j0 / KEY_BLOCK;
    for (int64_t n0 = 0; n0 < d; n0 += TILE_N) {
        uint16_t *tile = v_tiles + (n0 / TILE_N * key_blocks + kb) * (TILE_BYTES / 2);
        for (int64_t p = 0; p < KEY_BLOCK / 2; p++)
            for (int64_t n = 0; n < TILE_N; n++) {
                tile[p * 2 * TILE_N + 2 * n] = v16[2 * p][n0 + n];
                tile[p * 2 * TILE_N + 2 * n + 1] = v16[2 * p + 1][n0 + n];
            }
    }
}

typedef struct {
    const float *q;
    const uint16_t *k_tiles, *v_tiles;
    float *out;
    int64_t q_stride, out_stride, q_len, prefix, kv_pad, group, head_dim;
    float scale;
    _Atomic int *failed;
} AttendLoop;

/* A thread's scores and probabilities for one block of queries, kept from task to task. */
static __thread ThreadBuffer scores_buffer;

/* Row r's probabilities p = e^(scale * s - max) over its `visible` keys, as bf16 (zeros past
 * them, up to `width`); returns their float32 sum. */
AMX_TARGET static float softmax_row(const float *s, int64_t visible, int64_t width, float scale,
                                    uint16_t *p) {
    const __m512 lane = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 scale16 = _mm512_set1_ps(scale);
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < visible; t += 16) {
        const __mmask16 in = _mm512_cmp_ps_mask(lane, _mm512_set1_ps((float)(visible - t)), _CMP_LT_OQ);
        top = _mm512_mask_max_ps(top, in, top, _mm512_mul_ps(_mm512_load_ps(s + t), scale16));
    }
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < width; t += 16) {
        const __mmask16 in = _mm512_cmp_ps_mask(lane, _mm512_set1_ps((float)(visible - t)), _CMP_LT_OQ);
        const __m512 scaled = _mm512_mul_ps(_mm512_load_ps(s + t), scale16);
        const __m512 e = _mm512_maskz_mov_ps(in, exp_nonpositive16(_mm512_sub_ps(scaled, shift)));
        sum = _mm512_add_ps(sum, e);
        _mm256_store_si256((__m256i *)(p + t), round16_bf16(e));
    }
    return _mm512_reduce_add_ps(sum);
}

/* Queries i0 .. i0 + rows - 1 of one head against every key they see, in three passes: the
 * scores of every key block (tile products, stored), each row's softmax (its maximum known
 * before any exponential: no rescaling), and P V accumulated in the tile registers across the
 * key blocks. */
AMX_TARGET static void attend_task(const void *arg, int64_t task) {
    const AttendLoop *a = arg;
    const int64_t q_blocks = (a->q_len + QUERY_BLOCK - 1) / QUERY_BLOCK;
    const int64_t head = task / q_blocks, i0 = task % q_blocks * QUERY_BLOCK, d = a->head_dim;
    const int rows = (int)(a->q_len - i0 < QUERY_BLOCK ? a->q_len - i0 : QUERY_BLOCK);
    const int64_t kv_head = head / a->group, dim_blocks = d / TILE_K;
    const int64_t key_blocks = a->kv_pad / KEY_BLOCK;
    const uint16_t *k_tiles = a->k_tiles + kv_head * a->kv_pad * d;
    const uint16_t *v_tiles = a->v_tiles + kv_head * a->kv_pad * d;
    /* Keys the block's last query sees; query r sees prefix + i0 + r + 1 of them. */
    const int64_t seen = a->prefix + i0 + rows, blocks = (seen + KEY_BLOCK - 1) / KEY_BLOCK;
    const int64_t width = blocks * KEY_BLOCK;
    float *s = thread_buffer(&scores_buffer, QUERY_BLOCK * width * 3 / 2 * sizeof(float));
    if (!s) {
        atomic_store(a->failed, 1);
        return;
    }
    uint16_t *p = (uint16_t *)(s + QUERY_BLOCK * width);
    _Alignas(64) uint16_t q16[QUERY_BLOCK][MAX_HEAD_DIM];
    _Alignas(64) float o[QUERY_BLOCK][MAX_HEAD_DIM];
    float total[QUERY_BLOCK];
    for (int r = 0; r < rows; r++) {
        const float *q = a->q + (i0 + r) * a->q_stride + head * d;
        for (int64_t i = 0; i < d; i += 16)
            _mm256_store_si256((__m256i *)(q16[r] + i), bf16_of16(q + i));
    }
    configure_tiles(rows);
    for (int64_t kb = 0; kb < blocks; kb++) {
        zero_accumulators(rows);
        for (int64_t db = 0; db < dim_blocks; db++) {
            _tile_loadd(4, &q16[0][db * TILE_K], MAX_HEAD_DIM * 2);
            _tile_loadd(6, k_tiles + (2 * kb * dim_blocks + db) * (TILE_BYTES / 2), 64);
            _tile_loadd(7, k_tiles + ((2 * kb + 1) * dim_blocks + db) * (TILE_BYTES / 2), 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (rows > 16) {
                _tile_loadd(5, &q16[16][db * TILE_K], MAX_HEAD_DIM * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        store_accumulators(rows, s + kb * KEY_BLOCK, width);
    }
    for (int r = 0; r < rows; r++)
        total[r] = softmax_row(s + r * width, a->prefix + i0 + r + 1, width, a->scale, p + r * width);
    for (int64_t n0 = 0; n0 < d; n0 += 2 * TILE_N) {
        zero_accumulators(rows);
        for (int64_t kb = 0; kb < blocks; kb++) {
            _tile_loadd(4, p + kb * KEY_BLOCK, width * 2);
            _tile_loadd(6, v_tiles + (n0 / TILE_N * key_blocks + kb) * (TILE_BYTES / 2), 64);
            _tile_loadd(7, v_tiles + ((n0 / TILE_N + 1) * key_blocks + kb) * (TILE_BYTES / 2), 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (rows > 16) {
                _tile_loadd(5, p + 16 * width + kb * KEY_BLOCK, width * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        store_accumulators(rows, &o[0][n0], MAX_HEAD_DIM);
    }
    _tile_release();
    for (int r = 0; r < rows; r++) {
        float *out = a->out + (i0 + r) * a->out_stride + head * d;
        const __m512 inverse = _mm512_set1_ps(1.0f / total[r]);
        for (int64_t i = 0; i < d; i += 16)
            _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_load_ps(o[r] + i), inverse));
    }
}

/* out [q_len, q_heads, head_dim] (rows out_stride floats apart) = causal attention of q
 * [q_len, q_heads, head_dim] (rows q_stride apart) over the prefix + q_len keys at kv_rows of
 * the caches, of kv_type elements (KvType); AMX enabled (baton_amx_enable). Returns 0, -2 if
 * memory ran out, -3 for a head_dim that is not a multiple of 32 up to MAX_HEAD_DIM. */
int baton_prefill_attention(const float *q, int64_t q_stride, int64_t q_len, int64_t prefix,
                            const void *k_cache, const void *v_cache, const int64_t *kv_rows,
                            int64_t q_heads, int64_t kv_heads, int64_t head_dim, float scale,
                            float *out, int64_t out_stride, int64_t kv_type) {
    if (head_dim % TILE_K || head_dim > MAX_HEAD_DIM || q_heads % kv_heads || q_len < 1)
        return -3;
    const int64_t kv_len = prefix + q_len, kv_pad = round_up(kv_len, KEY_BLOCK);
    /* The row's K and V in tile order, in a buffer the calling thread keeps from call to call. */
    static __thread ThreadBuffer tiles_buffer;
    uint16_t *tiles = thread_buffer(&tiles_buffer, kv_heads * kv_pad * head_dim * 2 * 2);
    if (!tiles) return -2;
    uint16_t *v_tiles = tiles + kv_heads * kv_pad * head_dim;
    const PackLoop pack = {k_cache, v_cache,  kv_rows, tiles, v_tiles,
                           kv_len,  kv_pad,   head_dim, kv_type};
    baton_parallel(pack_task, &pack, kv_heads * (kv_pad / KEY_BLOCK));
    _Atomic int failed = 0;
    const AttendLoop attend = {q,      tiles,  v_tiles,           out,      q_stride,
                               out_stride, q_len, prefix, kv_pad, q_heads / kv_heads,
                               head_dim, scale,  &failed};
    baton_parallel(attend_task, &attend, q_heads * ((q_len + QUERY_BLOCK - 1) / QUERY_BLOCK));
    return atomic_load(&failed) ? -2 : 0;
}
