/* Batches of two rows or more of bf16 weights on CPUs with AVX512_BF16 but no AMX (AMD Zen 4
 * and Zen 5): the weights in tile order (bf16_tiles.c), multiplied by VDPBF16PS, decode steps
 * and prefill chunks alike.
 *
 * Why: the compact kernel (compact_gemv.c) widens each bf16 weight and multiplies it in float32
 * FMAs, so at 16-32 rows the FMAs bind: on a Zen 4 the 0.5B shape's linear layers ran 232
 * GFLOP/s at 32 rows, the float32 FMA peak of its two cores, and past 16 rows the step went to
 * oneDNN's bf16 GEMMs. VDPBF16PS multiplies 16 pairs of bf16 and adds them into 16 float32
 * sums: twice an FMA's products per instruction, read straight from the weights' bf16 bytes.
 *
 * A 64-byte row of a tile is one such operand: 16 output features by one pair of inputs
 * (w[n][2p], w[n][2p + 1]), and a group of 16 features' tiles lie one after another, so a
 * group's weights are one stream of those vectors, pair after pair. One broadcast of a row's
 * pair of inputs feeds one product per group: a tile of up to 12 rows by two groups is 24 sums
 * in registers, beside the two groups' weights and the broadcast.
 *
 * The rows are rounded to bf16 first (bf16_tiles.c), as for the AMX kernel and as every bf16
 * GEMM round them; the products of bf16 values are exact in float32. Each output starts from
 * its bias, its residual row or zero and adds its pairs in input order, whatever tile, group or
 * thread it falls in, so a row's result does not depend on the other rows of its batch.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "bf16_tiles.h"
#include "linear.h"
#include "runtime/amx_tiles.h"
#include "runtime/thread_pool.h"
#include "runtime/vector_math512.h"

#define DOT_TARGET                                                                             \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))

/* Rows per register tile: 12 rows by two groups are 24 sums, two weight vectors and the
 * broadcast: 27 of the 32 registers. */
#define DOT_TILE_ROWS 12
/* Vectors (64-byte lines) ahead of the one multiplied that each group's stream asks the cache
 * for: a decode step reads its weights from memory once. */
#define PREFETCH_LINES 16
/* Rows of x a chunk multiplies, in bf16 bytes: a group of rows stays in the core's L2 (1 MB on
 * Zen 5, Zen 4's too) beside the chunk's two weight groups, which sweep every tile of it. */
#define GROUP_BYTES (512 << 10)

/* 1 where this CPU has AVX512_BF16 and the AVX-512 the kernel uses beside it (F, DQ, BW, VL),
 * else 0. */
int baton_bf16_dot_supported(void) {
    unsigned int eax, ebx, ecx, edx;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const unsigned int avx512 = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31); /* F DQ BW VL */
    if ((ebx & avx512) != avx512 || eax < 1) return 0;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(1));
    return (eax >> 5) & 1;
}

/* sums[r][0..31] += rows r of x (bf16, k_pad wide) times the two groups' weights: the k loop of
 * one tile, `rows` a compile-time constant after inlining so the sums stay in registers. */
DOT_TARGET static inline __attribute__((always_inline)) void dot_tile(
    int rows, const uint16_t *x, int64_t k_pad, const uint16_t *w0, const uint16_t *w1,
    float (*sums)[2 * TILE_N]) {
    __m512 acc[DOT_TILE_ROWS][2];
    for (int r = 0; r < rows; r++) {
        acc[r][0] = _mm512_load_ps(&sums[r][0]);
        acc[r][1] = _mm512_load_ps(&sums[r][TILE_N]);
    }
    const int32_t *pairs = (const int32_t *)x;
    const int64_t pair_stride = k_pad / 2;
    for (int64_t p = 0; p < k_pad / 2; p++) {
        _mm_prefetch((const char *)(w0 + (p + PREFETCH_LINES) * 2 * TILE_N), _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + (p + PREFETCH_LINES) * 2 * TILE_N), _MM_HINT_T0);
        const __m512bh a = (__m512bh)_mm512_loadu_si512(w0 + p * 2 * TILE_N);
        const __m512bh b = (__m512bh)_mm512_loadu_si512(w1 + p * 2 * TILE_N);
        for (int r = 0; r < rows; r++) {
            const __m512bh xr = (__m512bh)_mm512_set1_epi32(pairs[r * pair_stride + p]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, a);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, b);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_store_ps(&sums[r][0], acc[r][0]);
        _mm512_store_ps(&sums[r][TILE_N], acc[r][1]);
    }
}

#define TILE_CASE(R)                                                                             \
    case R:                                                                                      \
        dot_tile(R, x, k_pad, w0, w1, sums);                                                     \
        break;

DOT_TARGET static void run_tile(int rows, const uint16_t *x, int64_t k_pad, const uint16_t *w0,
                                const uint16_t *w1, float (*sums)[2 * TILE_N]) {
    switch (rows) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
        TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
    }
}

typedef struct {
    const uint16_t *x; /* [rows, k_pad] bf16 */
    const uint16_t *tiles;
    const float *bias;
    void *y;
    int64_t rows, k_pad, n_dim, epilogue, group_rows, feature_chunks;
} DotLoop;

/* One chunk: a group of rows (GROUP_BYTES) by two groups of 16 weight features, in tiles of
 * rows as even as they divide (16 rows: two of 8, not 12 and 4).
 * - EPILOGUE_STORE: 32 output features, y float32 [rows, n_dim] = bias + product.
 * - EPILOGUE_ADD: the same without a bias, added to y: the sums start from y.
 * - EPILOGUE_SILU_MUL: the gated MLP's [gate | up] weight, 16 features of each (gate f, up
 *   inter + f): y bf16 [rows, inter] = silu(gate) * up, each rounded once, as amx_gemm.c's
 *   epilogue and baton_silu_mul's 16-float path compute it from float32 products. */
DOT_TARGET static void dot_chunk(const void *arg, int64_t chunk) {
    const DotLoop *g = arg;
    const int64_t group = chunk / g->feature_chunks, columns = chunk % g->feature_chunks;
    const int silu = g->epilogue == EPILOGUE_SILU_MUL, add = g->epilogue == EPILOGUE_ADD;
    const int64_t inter = g->n_dim / 2;
    TileColumns c;
    tile_columns(g->tiles, g->k_pad, g->n_dim, g->epilogue, g->bias, columns, &c);
    const int64_t n0 = c.n0;
    float *const y = g->y;
    const int64_t first = group * g->group_rows;
    const int64_t last = first + g->group_rows < g->rows ? first + g->group_rows : g->rows;
    const int64_t tiles = (last - first + DOT_TILE_ROWS - 1) / DOT_TILE_ROWS;
    _Alignas(64) float sums[DOT_TILE_ROWS][2 * TILE_N];
    for (int64_t t = 0, r0 = first; t < tiles; t++) {
        const int rows = (int)((last - r0) / (tiles - t));
        for (int r = 0; r < rows; r++) {
            if (add) {
                const float *from = y + (r0 + r) * g->n_dim + n0;
                _mm512_store_ps(&sums[r][0], _mm512_maskz_loadu_ps(c.low_mask, from));
                _mm512_store_ps(&sums[r][TILE_N], _mm512_maskz_loadu_ps(c.high_mask, from + TILE_N));
            } else {
                memcpy(sums[r], c.start, sizeof c.start);
            }
        }
        run_tile(rows, g->x + r0 * g->k_pad, g->k_pad, c.w0, c.w1, sums);
        for (int r = 0; r < rows; r++) {
            const __m512 low = _mm512_load_ps(&sums[r][0]), high = _mm512_load_ps(&sums[r][TILE_N]);
            if (silu) {
                uint16_t *out = (uint16_t *)g->y + (r0 + r) * inter + n0;
                _mm256_storeu_si256((__m256i *)out, narrow16_bf16(_mm512_mul_ps(silu16(low), high)));
            } else {
                float *out = y + (r0 + r) * g->n_dim + n0;
                _mm512_mask_storeu_ps(out, c.low_mask, low);
                _mm512_mask_storeu_ps(out + TILE_N, c.high_mask, high);
            }
        }
        r0 += rows;
    }
}

/* y = x @ W^T (+ bias) through `epilogue` (dot_chunk), W in tile order, x bf16 rows [rows,
 * k_pad], on a CPU with AVX512_BF16; rows >= 1, the arguments checked by
 * baton_bf16_tiles_gemm (bf16_tiles.c). */
DOT_TARGET void baton_bf16_dot_gemm(const uint16_t *x_bf16, int64_t rows, int64_t k_pad,
                                    const uint16_t *tiles, int64_t n_dim, const float *bias,
                                    int64_t epilogue, void *y) {
    const int64_t fitting = GROUP_BYTES / (k_pad * 2) / DOT_TILE_ROWS * DOT_TILE_ROWS;
    const int64_t group_rows = fitting > DOT_TILE_ROWS ? fitting : DOT_TILE_ROWS;
    const int64_t feature_chunks = epilogue == EPILOGUE_SILU_MUL
                                       ? n_dim / 2 / TILE_N
                                       : round_up(n_dim, 2 * TILE_N) / (2 * TILE_N);
    const DotLoop loop = {x_bf16, tiles, bias, y, rows, k_pad, n_dim, epilogue, group_rows,
                          feature_chunks};
    baton_parallel(dot_chunk, &loop, (rows + group_rows - 1) / group_rows * feature_chunks);
}
