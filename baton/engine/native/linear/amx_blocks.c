/* GGUF block weights (Q8_0, Q4_0, Q4_1) multiplied on AMX in float32 precision.
 *
 * A GGUF model computes in float32 (transformers' reference arithmetic), and from a few rows the
 * compact kernel's float32 FMAs bind (SmolLM2 at 16 rows: 19-23 ms of layers a step, this CPU's
 * FMA peak). The tile unit multiplies bf16 only, but a block's weights are w = d * q (+ m): a
 * block's f16 scale d (and minimum m) times small integers q, which bf16 holds exactly. So the
 * tiles multiply the integers, and each block's sums are scaled afterwards:
 *
 *   x . w over a block = d * (x . q) + m * sum(x),
 *
 * with x, a float32 row, split exactly into three bf16 parts x0 + x1 + x2 (each the next 8
 * significant bits). Every product xi * q is exact in float32 and the tile unit sums a block's
 * 96 of them in float32; the scaling and the sum over blocks are float32 FMAs. The result
 * differs from a float32 product of the dequantized weights only in the order and rounding of
 * its sums (tested: under float32 GEMM's own error against float64).
 *
 * The tiles are read in their GGUF size: each block's integers are stored in tile order as
 * nibbles (Q4) or bytes (Q8_0) (amx_block_records.h) and widened to bf16 in the kernel, a few vector instructions a
 * tile row, just before the tile unit multiplies them. SmolLM2's Q4_1 layers on the AMX Xeon
 * (two threads): 16 rows 11.5 ms against the compact kernel's 19, 32 rows 14 against 33, 512
 * rows 195 (the previous kernel here, weights split into stored bf16 parts of 4-6 bytes a
 * weight: 219); its Q8_0 head at 16 rows 1.7 ms against 4.3. The compact kernel keeps the
 * fewest rows (baton_linear's amx_blocks_min_rows), where the widening costs more than its FMAs.
 */

#include <immintrin.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_block_records.h"
#include "runtime/amx_tiles.h"
#include "linear.h"
#include "runtime/thread_buffer.h"
#include "runtime/thread_pool.h"

#define ROW_PARTS 3
/* A chunk of the loop: up to this many pairs of feature tiles against up to this many pairs of
 * row groups (16 rows each). */
#define PAIRS_PER_CHUNK 3
#define GROUP_PAIRS_PER_CHUNK 8

/* 16 floats into three bf16 parts: x0 rounds them to bf16, x - x0 is exact in float32 with at
 * most 16 significant bits, x1 rounds it to 8 and x2 holds the at most 8 left (one AVX512_BF16
 * instruction each; subnormals flush to zero, as the tile unit reads them anyway). */
AMX_TARGET static inline void split16(__m512 v, uint16_t *x0, uint16_t *x1, uint16_t *x2) {
    __m512 rest = v;
    uint16_t *parts[ROW_PARTS] = {x0, x1, x2};
    for (int p = 0; p < ROW_PARTS; p++) {
        const __m256i part = (__m256i)_mm512_cvtneps_pbh(rest);
        _mm256_storeu_si256((__m256i *)parts[p], part);
        rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(_mm512_slli_epi32(
                                       _mm512_cvtepu16_epi32(part), 16)));
    }
}

/* The rows as the tile unit reads them: for each group of 16 rows and each block, its three
 * parts' A tiles one after another (3 KB, rows past the last zero), and each row's block sums
 * (Q4_1's minimums multiply them). */
typedef struct {
    const float *x;
    uint16_t *parts;
    float *sums;
    int64_t rows, k_dim;
} SplitLoop;

AMX_TARGET static void split_group(const void *arg, int64_t group) {
    const SplitLoop *s = arg;
    const int64_t k_blocks = s->k_dim / TILE_K;
    uint16_t *tiles = s->parts + group * k_blocks * ROW_PARTS * (TILE_BYTES / 2);
    for (int64_t i = 0; i < TILE_N; i++) {
        const int64_t r = group * TILE_N + i;
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            uint16_t *x0 = tiles + kb * ROW_PARTS * (TILE_BYTES / 2) + i * TILE_K;
            __m512 total = _mm512_setzero_ps();
            for (int64_t k = 0; k < TILE_K; k += 16) {
                const __m512 v =
                    r < s->rows ? _mm512_loadu_ps(s->x + r * s->k_dim + kb * TILE_K + k)
                                : _mm512_setzero_ps();
                split16(v, x0 + k, x0 + TILE_BYTES / 2 + k, x0 + TILE_BYTES + k);
                total = _mm512_add_ps(total, v);
            }
            s->sums[r * k_blocks + kb] = _mm512_reduce_add_ps(total);
        }
    }
}

typedef struct {
    const uint16_t *parts;
    const float *sums;
    const uint8_t *records;
    const float *bias;
    float *y;
    int64_t rows, k_dim, n_dim, row_groups, pairs, group_chunks;
    _Atomic int *out_of_memory;
} BlockLoop;

/* A block's sums of one or two groups (tiles 0-3, as configure_tiles shapes them) by the pair
 * of feature tiles in tiles 6-7: x0 q + x1 q + x2 q, the A tiles through 4-5. */
AMX_TARGET static inline void block_products(const uint16_t *x, int two, int64_t group_stride) {
    for (int p = 0; p < ROW_PARTS; p++) {
        _tile_loadd(4, x + p * (TILE_BYTES / 2), 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, x + group_stride + p * (TILE_BYTES / 2), 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* sum[r] += d * c[r] (+ m * the row's block sum) for a block's stored sums c of `rows` rows by
 * 32 features; dm holds the pair's d (32 floats) then m (32). */
AMX_TARGET static inline void scale_block(float (*sum)[2 * TILE_N], float (*c)[2 * TILE_N],
                                          const float *dm, const float *block_sums,
                                          int64_t sums_stride, int rows, int minimums) {
    const __m512 d0 = _mm512_load_ps(dm), d1 = _mm512_load_ps(dm + TILE_N);
    const __m512 m0 = _mm512_load_ps(dm + 2 * TILE_N), m1 = _mm512_load_ps(dm + 3 * TILE_N);
    for (int r = 0; r < rows; r++) {
        __m512 s0 = _mm512_fmadd_ps(d0, _mm512_load_ps(c[r]), _mm512_load_ps(sum[r]));
        __m512 s1 = _mm512_fmadd_ps(d1, _mm512_load_ps(c[r] + TILE_N),
                                    _mm512_load_ps(sum[r] + TILE_N));
        if (minimums) {
            const __m512 block_sum = _mm512_set1_ps(block_sums[r * sums_stride]);
            s0 = _mm512_fmadd_ps(block_sum, m0, s0);
            s1 = _mm512_fmadd_ps(block_sum, m1, s1);
        }
        _mm512_store_ps(sum[r], s0);
        _mm512_store_ps(sum[r] + TILE_N, s1);
    }
}

/* A pair's widened tiles (1024 values a block) and d, m (64 floats a block), kept per thread. */
typedef struct {
    uint16_t *tiles;
    float *scales;
    int64_t blocks;
} Widened;

static int reserve_widened(Widened *w, int64_t blocks) {
    if (blocks <= w->blocks) return 0;
    free(w->tiles);
    free(w->scales);
    w->tiles = aligned_alloc(64, blocks * 2 * TILE_BYTES);
    w->scales = aligned_alloc(64, blocks * 4 * TILE_N * 4);
    w->blocks = w->tiles && w->scales ? blocks : 0;
    return w->blocks ? 0 : -1;
}

/* One chunk, for format fmt (a constant where the callers below inline it). Where the chunk
 * has one pair of row groups (a decode batch), each block is widened just before its products,
 * into two slots that stay in L1; with more, a pair's blocks are widened once and every group
 * pair reads them from L2. */
__attribute__((always_inline)) AMX_TARGET static inline void block_chunk(const BlockLoop *g,
                                                                        int64_t chunk,
                                                                        const int fmt) {
    static __thread Widened widened;
    const int64_t k_blocks = g->k_dim / TILE_K, record = record_bytes(fmt);
    const int64_t group_pairs = (g->row_groups + 1) / 2;
    const int64_t first_pair = chunk / g->group_chunks * PAIRS_PER_CHUNK;
    const int64_t first = chunk % g->group_chunks * GROUP_PAIRS_PER_CHUNK;
    const int64_t end = first + GROUP_PAIRS_PER_CHUNK < group_pairs ? first + GROUP_PAIRS_PER_CHUNK
                                                                   : group_pairs;
    const int just_in_time = end - first == 1;
    if (reserve_widened(&widened, just_in_time ? 2 : k_blocks)) {
        atomic_store(g->out_of_memory, 1);
        return;
    }
    /* Read once: each access to a thread-local variable is a call in a shared library. */
    uint16_t *const tiles = widened.tiles;
    float *const scales = widened.scales;
    const int64_t group_stride = k_blocks * ROW_PARTS * (TILE_BYTES / 2);
    float c[2 * TILE_N][2 * TILE_N] __attribute__((aligned(64)));
    float sum[2 * TILE_N][2 * TILE_N] __attribute__((aligned(64)));
    int configured = 0;
    for (int64_t pair = first_pair; pair < first_pair + PAIRS_PER_CHUNK && pair < g->pairs;
         pair++) {
        const uint8_t *r0 = g->records + 2 * pair * k_blocks * record;
        const uint8_t *r1 = r0 + k_blocks * record;
#define WIDEN(KB, SLOT)                                                                         \
    do {                                                                                        \
        float *dm = scales + (SLOT) * 4 * TILE_N;                                               \
        uint16_t *t = tiles + (SLOT) * 2 * (TILE_BYTES / 2);                                    \
        widen_record(fmt, r0 + (KB) * record, t, dm, dm + 2 * TILE_N);                          \
        widen_record(fmt, r1 + (KB) * record, t + TILE_BYTES / 2, dm + TILE_N, dm + 3 * TILE_N); \
    } while (0)
        if (!just_in_time)
            for (int64_t kb = 0; kb < k_blocks; kb++) WIDEN(kb, kb);
        for (int64_t gp = first; gp < end; gp++) {
            const int64_t group = 2 * gp, r_first = group * TILE_N;
            const int two = group + 1 < g->row_groups, rows = two ? 2 * TILE_N : TILE_N;
            if (configured != rows) configure_tiles(configured = rows);
            memset(sum, 0, sizeof sum);
            const uint16_t *x = g->parts + group * group_stride;
            for (int64_t kb = 0; kb < k_blocks; kb++) {
                const int64_t slot = just_in_time ? kb & 1 : kb;
                if (just_in_time) WIDEN(kb, slot);
                zero_accumulators(rows);
                _tile_loadd(6, tiles + slot * 2 * (TILE_BYTES / 2), 64);
                _tile_loadd(7, tiles + slot * 2 * (TILE_BYTES / 2) + TILE_BYTES / 2, 64);
                block_products(x + kb * ROW_PARTS * (TILE_BYTES / 2), two, group_stride);
                store_accumulators(rows, &c[0][0], 2 * TILE_N);
                scale_block(sum, c, scales + slot * 4 * TILE_N, g->sums + r_first * k_blocks + kb,
                            k_blocks, rows, fmt == FMT_Q4_1);
            }
            const int64_t n0 = pair * 2 * TILE_N;
            const int64_t width = g->n_dim - n0 < 2 * TILE_N ? g->n_dim - n0 : 2 * TILE_N;
            for (int r = 0; r < rows && r_first + r < g->rows; r++)
                for (int64_t i = 0; i < width; i++)
                    g->y[(r_first + r) * g->n_dim + n0 + i] =
                        sum[r][i] + (g->bias ? g->bias[n0 + i] : 0.0f);
        }
#undef WIDEN
    }
    _tile_release();
}

AMX_TARGET static void q8_0_chunk(const void *g, int64_t chunk) { block_chunk(g, chunk, FMT_Q8_0); }
AMX_TARGET static void q4_0_chunk(const void *g, int64_t chunk) { block_chunk(g, chunk, FMT_Q4_0); }
AMX_TARGET static void q4_1_chunk(const void *g, int64_t chunk) { block_chunk(g, chunk, FMT_Q4_1); }

/* y [rows, n_dim] = x [rows, k_dim] @ W^T (+ bias), W a block matrix of format fmt packed by
 * baton_pack_block_tiles; any number of rows; AMX enabled (baton_amx_enable). Returns 0, or -2
 * if memory ran out. */
int baton_amx_block_gemm(int fmt, const float *x, int64_t rows, int64_t k_dim,
                         const uint8_t *records, int64_t n_dim, const float *bias, float *y) {
    /* The rows' parts and block sums, in buffers each calling thread keeps (and grows). */
    static __thread ThreadBuffer parts_buffer, sums_buffer;
    const int64_t row_groups = round_up(rows, TILE_N) / TILE_N, k_blocks = k_dim / TILE_K;
    uint16_t *parts = thread_buffer(&parts_buffer, row_groups * TILE_N * k_dim * ROW_PARTS * 2);
    float *sums = thread_buffer(&sums_buffer, row_groups * TILE_N * k_blocks * 4);
    if (!parts || !sums) return -2;
    const SplitLoop split = {x, parts, sums, rows, k_dim};
    baton_parallel(split_group, &split, row_groups);
    const int64_t pairs = round_up(n_dim, 2 * TILE_N) / (2 * TILE_N);
    const int64_t group_chunks =
        ((row_groups + 1) / 2 + GROUP_PAIRS_PER_CHUNK - 1) / GROUP_PAIRS_PER_CHUNK;
    _Atomic int out_of_memory = 0;
    const BlockLoop loop = {parts, sums,         records, bias,          y,
                            rows,  k_dim,        n_dim,   row_groups,    pairs,
                            group_chunks, &out_of_memory};
    const chunk_fn chunk = fmt == FMT_Q8_0 ? q8_0_chunk : fmt == FMT_Q4_0 ? q4_0_chunk : q4_1_chunk;
    baton_parallel(chunk, &loop, (pairs + PAIRS_PER_CHUNK - 1) / PAIRS_PER_CHUNK * group_chunks);
    return atomic_load(&out_of_memory) ? -2 : 0;
}
