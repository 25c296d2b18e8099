/* Products of a few rows to a few dozen by compact weights, staged: a stage of weight rows is
 * dequantized to float32 once, a slice of inputs at a time, into a buffer that stays in the L1
 * cache, and every row of x is multiplied from it (AVX2 + FMA).
 *
 * Why: the compact kernel's sweep (compact_gemv.c) dequantizes each weight once per pass of up
 * to 8 rows of x and loads a vector of x for every FMA; past a few rows its x rows (8 KB each
 * for 2048 inputs) no longer fit the L1 cache, and every FMA waits on L2. On AMD EPYC Zen 3 (2
 * threads, the 1B Llama shape's layer matrices) it ran 34-46 GFMA/s at 4-32 rows, every format
 * alike, where torch's float32 GEMM reaches 86 at 512 rows. Here dequantization is paid once
 * for up to 32 rows, and a tile of 4 rows of x by 3 weight rows runs 12 FMAs for 7 loads from
 * L1: 62-66 GFMA/s at 16-32 rows, 1.3-1.6x the sweep's rate.
 *
 * With AVX-512 (the k-quants and IQ4, whose 16-float sweeps, where any, stop at 7 rows) the
 * tiles take 16 inputs a vector, 6 rows of x by 4 weight rows: 24 sums in the 32 zmm
 * registers, 10 loads for 24 FMAs, on the same stage; and whole groups of 16 rows (and a last
 * group of 14 or 15, padded) take the group tiles instead (staged_groups512.c: 16 rows a
 * vector, each stage weight broadcast, 1.13-1.42x at 16-128 rows on a Zen 5), a block of 128
 * rows a pass, so that a stage is dequantized once for it.
 *
 * Each weight is the exact float32 value the compact kernel and baton_dequantize give (the
 * same row dequantizers), so the result differs from a float32 GEMM only in the order of the
 * sums, as the compact kernel's does.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "linear.h"
#include "runtime/thread_buffer.h"
#include "runtime/thread_pool.h"
#include "runtime/vector_math.h"
#include "staged_groups512.h"

/* Inputs per slice: one k-quant super-block (every format's blocks divide it). */
#define STAGE_K 256
/* Weight rows a stage dequantizes: 4 groups of TILE_FEATURES; with STAGE_K, 12 KB of float32. */
#define STAGE_FEATURES 12
/* A tile: TILE_ROWS rows of x by TILE_FEATURES weight rows, 12 accumulators, 3 weight vectors
 * and one of x: the 16 ymm registers. */
#define TILE_ROWS 4
#define TILE_FEATURES 3
/* The AVX-512 tile: WIDE_TILE_ROWS rows by WIDE_TILE_FEATURES weight rows of 16 floats. */
#define WIDE_TILE_ROWS 6
#define WIDE_TILE_FEATURES 4
/* Rows of x per pass over a stage: their partial sums (a vector each, 8 or 16 floats of a
 * 16-float slot) stay on the stack. */
#define PASS_ROWS 32
/* Rows of x whose passes go over a stage before the next stage's (staged_chunk): 128 rows of
 * 2048-8192 inputs, 1-4 MB, stay in L2/L3, where a 512-row prefill chunk's whole x (16 MB
 * for 8192 inputs) came from memory for every stage. A multiple of PASS_ROWS. */
#define BLOCK_ROWS 128
/* Rows past the last whole group from which they take the group tiles as a group of their own,
 * padded with zero rows (whose sums are not stored), rather than the k-vectorised tiles. On a
 * Zen 5 (2 threads, the 1B Llama's four Q4_K layer matrices): 12 rows 0.95x, 13 level, 14
 * 1.04-1.12x, 15 1.13x (Q6_K 15: 1.13x), 30 rows 1.16x, 62 1.09x. */
#define PADDED_GROUP_MIN_ROWS 14
/* Chunks a thread gets on average (as compact_gemv.c's, for the same reason). */
#define CHUNKS_PER_THREAD 8
#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

typedef float PassSums[PASS_ROWS][STAGE_FEATURES][16];
/* A block is whole groups, the rows after its groups fit a pass, and the group tiles take
 * a whole stage. */
_Static_assert(BLOCK_ROWS % GROUP_ROWS == 0 && GROUP_ROWS <= PASS_ROWS &&
                   STAGE_FEATURES == GROUP_STAGE_FEATURES,
               "the group tiles take whole groups of a block by a whole stage");

/* sums[r][j] += x[r] . w[j] over `len` inputs, for `rows` rows of x (x_stride apart) and
 * `features` stage rows (STAGE_K apart), both compile-time constants after inlining; 8 floats
 * of each sum's slot. */
static inline __attribute__((always_inline)) void tile(int rows, int features, const float *x,
                                                       int64_t x_stride, const float *w,
                                                       int64_t len,
                                                       float (*sums)[STAGE_FEATURES][16]) {
    __m256 acc[TILE_ROWS][TILE_FEATURES];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < features; j++) acc[r][j] = _mm256_load_ps(sums[r][j]);
    for (int64_t k = 0; k < len; k += 8) {
        __m256 wv[TILE_FEATURES];
        for (int j = 0; j < features; j++) wv[j] = _mm256_load_ps(w + j * STAGE_K + k);
        for (int r = 0; r < rows; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * x_stride + k);
            for (int j = 0; j < features; j++) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < features; j++) _mm256_store_ps(sums[r][j], acc[r][j]);
}

/* The same with AVX-512: 16 floats of each slot. */
WIDE static inline __attribute__((always_inline)) void wide_tile(
    int rows, int features, const float *x, int64_t x_stride, const float *w, int64_t len,
    float (*sums)[STAGE_FEATURES][16]) {
    __m512 acc[WIDE_TILE_ROWS][WIDE_TILE_FEATURES];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < features; j++) acc[r][j] = _mm512_load_ps(sums[r][j]);
    for (int64_t k = 0; k < len; k += 16) {
        __m512 wv[WIDE_TILE_FEATURES];
        for (int j = 0; j < features; j++) wv[j] = _mm512_load_ps(w + j * STAGE_K + k);
        for (int r = 0; r < rows; r++) {
            const __m512 xv = _mm512_loadu_ps(x + r * x_stride + k);
            for (int j = 0; j < features; j++) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < features; j++) _mm512_store_ps(sums[r][j], acc[r][j]);
}

#define TILE_CASE(R, F)                                                                          \
    case (R) * 8 + (F): tile(R, F, x, x_stride, w, len, sums); break;
#define WIDE_TILE_CASE(R, F)                                                                     \
    case (R) * 8 + (F): wide_tile(R, F, x, x_stride, w, len, sums); break;

/* The tile for `rows` (1-4) by `features` (1-3), each a specialised copy. */
static void run_tile(int rows, int features, const float *x, int64_t x_stride, const float *w,
                     int64_t len, float (*sums)[STAGE_FEATURES][16]) {
    switch (rows * 8 + features) {
        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(2, 1) TILE_CASE(2, 2)
        TILE_CASE(2, 3) TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(3, 3) TILE_CASE(4, 1)
        TILE_CASE(4, 2) TILE_CASE(4, 3)
    }
}

/* The AVX-512 tile for `rows` (1-6) by `features` (1-4). */
WIDE static void run_wide_tile(int rows, int features, const float *x, int64_t x_stride,
                               const float *w, int64_t len, float (*sums)[STAGE_FEATURES][16]) {
    switch (rows * 8 + features) {
        WIDE_TILE_CASE(1, 1) WIDE_TILE_CASE(1, 2) WIDE_TILE_CASE(1, 3) WIDE_TILE_CASE(1, 4)
        WIDE_TILE_CASE(2, 1) WIDE_TILE_CASE(2, 2) WIDE_TILE_CASE(2, 3) WIDE_TILE_CASE(2, 4)
        WIDE_TILE_CASE(3, 1) WIDE_TILE_CASE(3, 2) WIDE_TILE_CASE(3, 3) WIDE_TILE_CASE(3, 4)
        WIDE_TILE_CASE(4, 1) WIDE_TILE_CASE(4, 2) WIDE_TILE_CASE(4, 3) WIDE_TILE_CASE(4, 4)
        WIDE_TILE_CASE(5, 1) WIDE_TILE_CASE(5, 2) WIDE_TILE_CASE(5, 3) WIDE_TILE_CASE(5, 4)
        WIDE_TILE_CASE(6, 1) WIDE_TILE_CASE(6, 2) WIDE_TILE_CASE(6, 3) WIDE_TILE_CASE(6, 4)
    }
}

typedef struct {
    row_dequantizer dequantize;
    const float *x, *bias;
    float *y;
    const uint8_t *w;
    int64_t m_dim, k_dim, n_dim, row_bytes, features_per_chunk, wide;
    /* x's whole groups of 16 rows packed for the group tiles (staged_groups512.c), or NULL:
     * then every row takes the k-vectorised tiles. */
    const float *groups;
} StagedLoop;

/* Rows [m0, m0 + rows) of x against weight rows [n0, n0 + features): slice by slice, the
 * features dequantized into the stage, then every tile of x multiplied from it. With the
 * group tiles a pass is a block (up to BLOCK_ROWS rows, from a multiple of it), whose whole
 * groups take them, two at a time, and whose last rows (fewer than a group) the k-vectorised
 * tiles; else up to PASS_ROWS rows, all in those. */
static void stage_pass(const StagedLoop *l, int64_t m0, int64_t rows, int64_t n0,
                       int64_t features) {
    float stage[STAGE_FEATURES * STAGE_K] __attribute__((aligned(64)));
    PassSums sums __attribute__((aligned(64)));
    float group_sums[BLOCK_ROWS / GROUP_ROWS][GROUP_STAGE_FEATURES][GROUP_ROWS]
        __attribute__((aligned(64)));
    /* The group tiles multiply every stage row: rows past the weight's end are zeros. */
    const int64_t padded = l->groups && rows % GROUP_ROWS >= PADDED_GROUP_MIN_ROWS;
    const int64_t groups = l->groups ? rows / GROUP_ROWS + padded : 0;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t j = 0; j < GROUP_STAGE_FEATURES; j++)
            for (int i = 0; i < GROUP_ROWS; i++) group_sums[g][j][i] = 0.0f;
    if (groups && features < STAGE_FEATURES)
        for (int64_t i = features * STAGE_K; i < STAGE_FEATURES * STAGE_K; i++) stage[i] = 0.0f;
    /* The rest's first row in the pass (past its end with a padded group: no rest). */
    const int64_t first = padded ? rows : groups * GROUP_ROWS;
    rows -= first;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < features; j++)
            for (int i = 0; i < 16; i++) sums[r][j][i] = 0.0f;
    const int64_t tile_rows_most = l->wide ? WIDE_TILE_ROWS : TILE_ROWS;
    const int64_t tile_features_most = l->wide ? WIDE_TILE_FEATURES : TILE_FEATURES;
    /* Rows of x in tiles as even as they divide (5 rows: 3 and 2, not 4 and 1), so that
     * every tile keeps enough FMA chains in flight. */
    const int64_t tiles = (rows + tile_rows_most - 1) / tile_rows_most;
    for (int64_t k0 = 0; k0 < l->k_dim; k0 += STAGE_K) {
        const int64_t len = l->k_dim - k0 < STAGE_K ? l->k_dim - k0 : STAGE_K;
        /* Whole blocks (k0 is a multiple of every super-block), so the bytes are exact. */
        const int64_t byte0 = k0 * l->row_bytes / l->k_dim;
        const int64_t slice_bytes = len * l->row_bytes / l->k_dim;
        for (int64_t j = 0; j < features; j++) {
            const uint8_t *slice = l->w + (n0 + j) * l->row_bytes + byte0;
            /* The stage reads its rows a slice each in turn, a pattern the hardware prefetcher
             * does not follow (strided by whole rows): each row's next slice is asked for
             * while this one is multiplied. A request past the matrix's end is harmless. */
            for (int64_t line = 0; line < slice_bytes; line += 64)
                _mm_prefetch((const char *)slice + slice_bytes + line, _MM_HINT_T0);
            l->dequantize(slice, len, stage + j * STAGE_K);
        }
        for (int64_t g = 0; g < groups; g += 2)
            baton_group_tiles512(groups - g < 2 ? groups - g : 2,
                                 l->groups + ((m0 / GROUP_ROWS + g) * l->k_dim + k0) * GROUP_ROWS,
                                 l->k_dim, stage, STAGE_K, len, &group_sums[g][0][0]);
        for (int64_t t = 0, r0 = 0; t < tiles; t++) {
            const int64_t tile_rows = (rows - r0) / (tiles - t);
            for (int64_t j = 0; j < features; j += tile_features_most) {
                const int64_t tile_features =
                    features - j < tile_features_most ? features - j : tile_features_most;
                (l->wide ? run_wide_tile : run_tile)((int)tile_rows, (int)tile_features,
                                                     l->x + (m0 + first + r0) * l->k_dim + k0,
                                                     l->k_dim,
                                                     stage + j * STAGE_K, len,
                                                     /* rows from r0, their sums from j */
                                                     (float(*)[STAGE_FEATURES][16])sums[r0][j]);
            }
            r0 += tile_rows;
        }
    }
    /* Row by row, each row's features side by side: a row's stores land in one or two lines
     * (feature by feature, each went to 16 rows' lines: on a Zen 5, 10 % of a 128-token
     * prefill of the Qwen3-30B-A3B shape; the 1B Llama's Q4_K layers ran 1.10x at 128 and
     * 512 rows, the 30B's expert matrices 1.24x at 128, once the stores went row by row). */
    for (int64_t g = 0; g < groups; g++)
        for (int64_t i = 0; i < GROUP_ROWS && g * GROUP_ROWS + i < first; i++) {
            float *y = l->y + (m0 + g * GROUP_ROWS + i) * l->n_dim + n0;
            for (int64_t j = 0; j < features; j++)
                y[j] = group_sums[g][j][i] + (l->bias ? l->bias[n0 + j] : 0.0f);
        }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < features; j++) {
            const float *slot = sums[r][j];
            const float sum = hsum8(_mm256_load_ps(slot)) +
                              (l->wide ? hsum8(_mm256_load_ps(slot + 8)) : 0.0f);
            l->y[(m0 + first + r) * l->n_dim + n0 + j] =
                sum + (l->bias ? l->bias[n0 + j] : 0.0f);
        }
}

static void staged_chunk(const void *arg, int64_t chunk) {
    const StagedLoop *l = arg;
    const int64_t first = chunk * l->features_per_chunk;
    const int64_t end = first + l->features_per_chunk < l->n_dim ? first + l->features_per_chunk
                                                                 : l->n_dim;
    /* A block of rows of x at a time, each stage's passes over it, so that the block's rows
     * stay in cache from stage to stage (the chunk's weights are read once a block). With
     * the group tiles the block is one pass: each stage dequantized once for all its rows. */
    const int64_t pass_rows = l->groups ? BLOCK_ROWS : PASS_ROWS;
    for (int64_t block = 0; block < l->m_dim; block += BLOCK_ROWS) {
        const int64_t block_end = block + BLOCK_ROWS < l->m_dim ? block + BLOCK_ROWS : l->m_dim;
        for (int64_t n0 = first; n0 < end; n0 += STAGE_FEATURES)
            for (int64_t m0 = block; m0 < block_end; m0 += pass_rows)
                stage_pass(l, m0, block_end - m0 < pass_rows ? block_end - m0 : pass_rows, n0,
                           end - n0 < STAGE_FEATURES ? end - n0 : STAGE_FEATURES);
    }
}

void baton_staged_gemm(row_dequantizer dequantize, int avx512, const float *x, int64_t m_dim,
                       int64_t k_dim, const uint8_t *w, int64_t n_dim, int64_t row_bytes,
                       const float *bias, float *y) {
    const int64_t chunks_wanted = CHUNKS_PER_THREAD * (int64_t)omp_get_max_threads();
    int64_t per_chunk = (n_dim + chunks_wanted - 1) / chunks_wanted;
    /* Whole stages, so that only the last chunk's last stage is short. */
    per_chunk = (per_chunk + STAGE_FEATURES - 1) / STAGE_FEATURES * STAGE_FEATURES;
    /* The caller's thread packs x's groups for every thread; without the memory, every row
     * takes the k-vectorised tiles. */
    static __thread ThreadBuffer group_buffer;
    const int64_t groups =
        avx512 ? m_dim / GROUP_ROWS + (m_dim % GROUP_ROWS >= PADDED_GROUP_MIN_ROWS) : 0;
    float *packed =
        groups ? thread_buffer(&group_buffer, groups * GROUP_ROWS * k_dim * (int64_t)sizeof(float))
               : 0;
    if (packed) baton_pack_groups512(x, m_dim, groups, k_dim, packed);
    const StagedLoop loop = {dequantize, x,     bias,      y,         w,     m_dim, k_dim,
                             n_dim,      row_bytes, per_chunk, avx512, packed};
    baton_parallel(staged_chunk, &loop, (n_dim + per_chunk - 1) / per_chunk);
}
