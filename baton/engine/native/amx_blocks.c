/* GGUF block weights (Q8_0, Q4_0, Q4_1) multiplied on AMX in float32 precision.
 *
 * A GGUF model computes in float32 (transformers' reference arithmetic), and from a few rows the
 * compact kernel's float32 FMAs bind (SmolLM2 at 32 rows: 38-45 ms of layers a step, this CPU's
 * FMA peak), as they bind oneDNN's float32 GEMM at prefill. The tile unit multiplies bf16 only,
 * but every number here splits exactly into a few bf16 parts, each taking the next 8
 * significant bits of what the parts before it left:
 *
 * - a weight's d * q (an f16 scale times a small integer: Q4's 15 significant bits, Q8_0's 18)
 *   into two parts (Q4) or three (Q8_0), P = P0 + P1 (+ P2);
 * - Q4_1's minimum m (an f16) into two, a float32 input x (24 bits) into three, x0 + x1 + x2.
 *
 * w = d * q + m, so a row's product is x . P plus, over its blocks, the block's sum of x times
 * m: the minimums are one more block of "weights" whose "inputs" are the block sums (the
 * augmented inputs below). Each product xi * Pj is exact in float32 (16 significant bits) and
 * the tile unit sums them in float32; the terms with i + j >= 3, each below 2^-24 of its product
 * (under float32's own rounding of it), are left out. So the result differs from a float32
 * product of the dequantized weights in the order and rounding of its sums, as the compact
 * kernel's does (for Q4_1 about twice float32's error, as x . P and the minimums' term cancel).
 * 5 tile products per block of Q4 (6 for Q8_0) where bf16 weights take one, and the parts are
 * 4-6 bytes a weight where the blocks are 0.6-1.1: SmolLM2's Q4_1 layers on the AMX Xeon (two
 * threads) multiply 32 rows in 30 ms against the compact kernel's 38, 512 rows in 211 ms
 * against oneDNN float32's 359 (baton_linear's amx_blocks_min_rows picks the faster).
 *
 * Layout (amx_tiles.h's tile order): a matrix of n_dim features has its features padded to
 * pairs of tiles (32) and its inputs augmented: the k_dim weights, then (Q4_1 only) the
 * k_dim / 32 minimums padded to a block of 32. Each tile of 16 features and 32 inputs holds its
 * parts one after another; a feature tile's blocks lie together, in order.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "linear.h"
#include "thread_pool.h"
#include "vector_math.h"

#define ROW_PARTS 3
/* Pairs of feature tiles one chunk of the loop multiplies against a pair of groups of 16 rows:
 * consecutive chunks take the same weights for the next groups of rows, out of cache. */
#define PAIRS_PER_CHUNK 2

static int block_bytes(int fmt) {
    switch (fmt) {
    case FMT_Q8_0: return 34;
    case FMT_Q4_0: return 18;
    case FMT_Q4_1: return 20;
    default: return 0;
    }
}

/* bf16 parts a weight needs to be held exactly (0 for a format without integer blocks). */
static int weight_parts(int fmt) {
    return fmt == FMT_Q8_0 ? 3 : fmt == FMT_Q4_0 || fmt == FMT_Q4_1 ? 2 : 0;
}

/* Inputs of the augmented matrix: the weights, then the minimums' block (Q4_1). */
static int64_t augmented_k(int fmt, int64_t k_dim) {
    return k_dim + (fmt == FMT_Q4_1 ? round_up(k_dim / TILE_K, TILE_K) : 0);
}

/* bf16 values `baton_pack_block_tiles` writes for an [n_dim, k_dim] matrix of format fmt. */
int64_t baton_block_tiles_count(int fmt, int64_t n_dim, int64_t k_dim) {
    return round_up(n_dim, 2 * TILE_N) * augmented_k(fmt, k_dim) * weight_parts(fmt);
}

/* 8 floats into three bf16 parts: x0 rounds them to bf16, x - x0 is exact in float32 with at
 * most 16 significant bits, x1 rounds it to 8 and x2 holds the at most 8 left. (A weight's
 * d * q, of at most 18 bits, leaves x2 zero where it has at most 16, as Q4's do.) */
static inline void split8(__m256 v, uint16_t *x0, uint16_t *x1, uint16_t *x2) {
    _mm_storeu_si128((__m128i *)x0, narrow_bf16(v));
    const __m256 rest = _mm256_sub_ps(v, widen_bf16(x0));
    _mm_storeu_si128((__m128i *)x1, narrow_bf16(rest));
    _mm_storeu_si128((__m128i *)x2, narrow_bf16(_mm256_sub_ps(rest, widen_bf16(x1))));
}

/* One block's d * q (32 values) and its minimum m, exactly as float32. */
static void read_block(int fmt, const uint8_t *block, float *scaled, float *m) {
    const float d = _cvtsh_ss(*(const uint16_t *)block);
    *m = fmt == FMT_Q4_1 ? _cvtsh_ss(*(const uint16_t *)(block + 2)) : 0.0f;
    for (int i = 0; i < TILE_K; i++) {
        int q;
        if (fmt == FMT_Q8_0) {
            q = (int8_t)block[2 + i];
        } else {
            const uint8_t *nibbles = block + (fmt == FMT_Q4_1 ? 4 : 2);
            q = (nibbles[i % 16] >> (i < 16 ? 0 : 4)) & 0x0F;
            if (fmt == FMT_Q4_0) q -= 8;
        }
        scaled[i] = d * (float)q;
    }
}

/* out (baton_block_tiles_count values) = the [n_dim, k_dim] block matrix w (rows `row_bytes`
 * apart) split and in tile order. Returns 0, or -1 for a format without integer blocks. */
int baton_pack_block_tiles(int fmt, const uint8_t *w, int64_t n_dim, int64_t k_dim,
                           int64_t row_bytes, uint16_t *out) {
    const int bytes = block_bytes(fmt), parts = weight_parts(fmt);
    if (!bytes || k_dim % TILE_K) return -1;
    const int64_t n_tiles = round_up(n_dim, 2 * TILE_N) / TILE_N, k_blocks = k_dim / TILE_K;
    const int64_t aug_blocks = augmented_k(fmt, k_dim) / TILE_K;
    memset(out, 0, baton_block_tiles_count(fmt, n_dim, k_dim) * 2);
#pragma omp parallel for schedule(static)
    for (int64_t nt = 0; nt < n_tiles; nt++)
        for (int64_t i = 0; i < TILE_N && nt * TILE_N + i < n_dim; i++) {
            const uint8_t *row = w + (nt * TILE_N + i) * row_bytes;
            uint16_t *tiles = out + nt * aug_blocks * parts * (TILE_BYTES / 2);
            for (int64_t kb = 0; kb < k_blocks; kb++) {
                float scaled[TILE_K], m;
                uint16_t split[3][TILE_K];
                read_block(fmt, row + kb * bytes, scaled, &m);
                for (int64_t k = 0; k < TILE_K; k += 8)
                    split8(_mm256_loadu_ps(scaled + k), split[0] + k, split[1] + k, split[2] + k);
                for (int p = 0; p < parts; p++)
                    for (int64_t k = 0; k < TILE_K; k++)
                        tiles[(kb * parts + p) * (TILE_BYTES / 2) + tile_offset(i, k)] =
                            split[p][k];
                if (fmt == FMT_Q4_1) { /* m is input kb of the minimums' blocks */
                    split8(_mm256_set1_ps(m), split[0], split[1], split[2]);
                    const int64_t mb = k_blocks + kb / TILE_K;
                    for (int p = 0; p < parts; p++)
                        tiles[(mb * parts + p) * (TILE_BYTES / 2) + tile_offset(i, kb % TILE_K)] =
                            split[p][0];
                }
            }
        }
    return 0;
}

/* The rows as the tile unit reads them: parts[p][row][k] over the augmented inputs (Q4_1: each
 * row's block sums after its k_dim values, then zeros). */
typedef struct {
    const float *x;
    uint16_t *parts;
    int64_t rows, rows_pad, k_dim, k_aug;
} SplitLoop;

static void split_group(const void *arg, int64_t group) {
    const SplitLoop *s = arg;
    const int64_t plane = s->rows_pad * s->k_aug, k_blocks = s->k_dim / TILE_K;
    for (int64_t r = group * TILE_N; r < (group + 1) * TILE_N && r < s->rows; r++) {
        const float *row = s->x + r * s->k_dim;
        uint16_t *x0 = s->parts + r * s->k_aug, *x1 = x0 + plane, *x2 = x1 + plane;
        const int64_t extra = s->k_aug - s->k_dim;
        float sums[extra > 0 ? extra : 1];
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            __m256 total = _mm256_setzero_ps();
            for (int64_t k = kb * TILE_K; k < (kb + 1) * TILE_K; k += 8) {
                const __m256 v = _mm256_loadu_ps(row + k);
                split8(v, x0 + k, x1 + k, x2 + k);
                total = _mm256_add_ps(total, v);
            }
            if (extra) sums[kb] = hsum8(total);
        }
        for (int64_t i = k_blocks; i < extra; i++) sums[i] = 0.0f;
        for (int64_t i = 0; i < extra; i += 8)
            split8(_mm256_loadu_ps(sums + i), x0 + s->k_dim + i, x1 + s->k_dim + i,
                   x2 + s->k_dim + i);
    }
}

typedef struct {
    const uint16_t *parts, *tiles;
    const float *bias;
    float *y;
    int64_t rows, rows_pad, k_aug, n_dim, row_groups, weight_parts;
} BlockLoop;

/* Tiles as configure_tiles (amx_tiles.h) shapes them: 0-3 the sums of two groups of rows (0-1,
 * 2-3) by the pair's two feature tiles; 4-5 the two groups' row part i; 6-7 the pair's weight
 * part j. */
#define LOAD_WEIGHT_PART(PART)                                                                  \
    do {                                                                                        \
        _tile_loadd(6, b0 + (kb * parts + (PART)) * (TILE_BYTES / 2), 64);                      \
        _tile_loadd(7, b1 + (kb * parts + (PART)) * (TILE_BYTES / 2), 64);                      \
    } while (0)
#define PRODUCTS(ROW_PART)                                                                      \
    do {                                                                                        \
        _tile_loadd(4, x + (ROW_PART) * plane + kb * TILE_K, a_stride);                         \
        _tile_dpbf16ps(0, 4, 6);                                                                \
        _tile_dpbf16ps(1, 4, 7);                                                                \
        if (two) {                                                                              \
            _tile_loadd(5, x + (ROW_PART) * plane + TILE_N * g->k_aug + kb * TILE_K, a_stride); \
            _tile_dpbf16ps(2, 5, 6);                                                            \
            _tile_dpbf16ps(3, 5, 7);                                                            \
        }                                                                                       \
    } while (0)

/* A group's sums c (its `rows` rows by a pair's 32 features) into y at row r0, feature n0,
 * plus the bias. */
static void store_sums(const BlockLoop *g, const float (*c)[2 * TILE_N], int64_t r0, int rows,
                       int64_t n0) {
    const int64_t width = g->n_dim - n0 < 2 * TILE_N ? g->n_dim - n0 : 2 * TILE_N;
    for (int r = 0; r < rows; r++)
        for (int64_t i = 0; i < width; i++)
            g->y[(r0 + r) * g->n_dim + n0 + i] = c[r][i] + (g->bias ? g->bias[n0 + i] : 0.0f);
}

/* PAIRS_PER_CHUNK pairs of feature tiles against two groups of 16 rows (the last chunk's one
 * group where their number is odd): each weight tile serves both groups and each row tile both
 * feature tiles, half the tile loads per product of one group by one pair. */
AMX_TARGET static void block_chunk(const void *arg, int64_t chunk) {
    const BlockLoop *g = arg;
    const int64_t group_pairs = (g->row_groups + 1) / 2;
    const int64_t group = chunk % group_pairs * 2, first_pair = chunk / group_pairs * PAIRS_PER_CHUNK;
    const int64_t r0 = group * TILE_N, a_stride = g->k_aug * 2, plane = g->rows_pad * g->k_aug;
    const int64_t aug_blocks = g->k_aug / TILE_K, parts = g->weight_parts;
    const int64_t pairs = round_up(g->n_dim, 2 * TILE_N) / (2 * TILE_N);
    const int rows = g->rows - r0 < TILE_N ? (int)(g->rows - r0) : TILE_N;
    const int two = group + 1 < g->row_groups;
    const int rows1 = two ? (g->rows - r0 - TILE_N < TILE_N ? (int)(g->rows - r0 - TILE_N) : TILE_N)
                          : 0;
    configure_tiles(rows + rows1); /* (rows is 16 where there is a second group) */
    const uint16_t *x = g->parts + r0 * g->k_aug;
    float c[2 * TILE_N][2 * TILE_N] __attribute__((aligned(64)));
    for (int64_t pair = first_pair; pair < first_pair + PAIRS_PER_CHUNK && pair < pairs; pair++) {
        const uint16_t *b0 = g->tiles + 2 * pair * aug_blocks * parts * (TILE_BYTES / 2);
        const uint16_t *b1 = b0 + aug_blocks * parts * (TILE_BYTES / 2);
        zero_accumulators(rows + rows1);
        for (int64_t kb = 0; kb < aug_blocks; kb++) {
            /* x . P over this block: xi * Pj for i + j <= 2. */
            LOAD_WEIGHT_PART(0);
            PRODUCTS(0);
            PRODUCTS(1);
            PRODUCTS(2);
            LOAD_WEIGHT_PART(1);
            PRODUCTS(0);
            PRODUCTS(1);
            if (parts == 3) {
                LOAD_WEIGHT_PART(2);
                PRODUCTS(0);
            }
        }
        const int64_t n0 = pair * 2 * TILE_N;
        store_accumulators(rows + rows1, &c[0][0], 2 * TILE_N);
        store_sums(g, c, r0, rows, n0);
        if (two) store_sums(g, c + TILE_N, r0 + TILE_N, rows1, n0);
    }
    _tile_release();
}

/* y [rows, n_dim] = x [rows, k_dim] @ W^T (+ bias), W a block matrix of format fmt packed by
 * baton_pack_block_tiles; any number of rows; AMX enabled (baton_amx_enable). Returns 0, or -2
 * if memory ran out. */
int baton_amx_block_gemm(int fmt, const float *x, int64_t rows, int64_t k_dim,
                         const uint16_t *tiles, int64_t n_dim, const float *bias, float *y) {
    /* The rows' parts, in a buffer each calling thread keeps (and grows) from call to call. */
    static __thread uint16_t *buffer;
    static __thread int64_t capacity;
    const int64_t rows_pad = round_up(rows, TILE_N), k_aug = augmented_k(fmt, k_dim);
    const int64_t needed = round_up(ROW_PARTS * rows_pad * k_aug * 2, 64);
    if (needed > capacity) {
        free(buffer);
        buffer = aligned_alloc(64, needed);
        capacity = buffer ? needed : 0;
        if (!buffer) return -2;
    }
    const int64_t row_groups = rows_pad / TILE_N;
    const SplitLoop split = {x, buffer, rows, rows_pad, k_dim, k_aug};
    baton_parallel(split_group, &split, row_groups);
    const BlockLoop loop = {buffer, tiles, bias,      y, rows, rows_pad, k_aug, n_dim, row_groups,
                            weight_parts(fmt)};
    const int64_t pairs = round_up(n_dim, 2 * TILE_N) / (2 * TILE_N);
    baton_parallel(block_chunk, &loop,
                   (pairs + PAIRS_PER_CHUNK - 1) / PAIRS_PER_CHUNK * ((row_groups + 1) / 2));
    return 0;
}
