/* Small-batch products of GGUF block weights (Q8_0, Q4_0, Q4_1) stored in panels of 16
 * features (AVX-512).
 *
 * Why: the compact kernel's sweep (compact_gemv.c) takes one weight row at a time against up to
 * 16 rows of x, so every FMA loads its own vector of x: one load per FMA, which held it near
 * half this CPU's FMA peak (SmolLM2's Q4_1 layers, AMX Xeon with its tiles off). Here a vector
 * holds one input of 16 features, so one broadcast of x[r][k] feeds two such vectors: a tile of
 * up to 12 rows by 32 features is 24 FMAs per input against 12 broadcasts, two weight loads and
 * their dequantization. SmolLM2's 120 Q4_1 layer matrices, 2 threads: 1.2x faster at 8-32 rows.
 *
 * The layout keeps the blocks' bytes: group g of 16 features, block b of 32 inputs is
 * panel_block_bytes at (g * blocks + b) * panel_block_bytes:
 * - Q8_0 (1.0625 bytes a weight): the 16 features' d as f16, then 32 times 16 bytes, byte j of
 *   the k-th holding feature j's weight k.
 * - Q4_0 / Q4_1 (0.625): the 16 features' d as f16, their m as f16 (Q4_0's m is -8 d, exact in
 *   f16), then 16 times 16 bytes, byte j of the p-th holding feature j's weight p in its low
 *   nibble and weight p + 16 in its high one (as a GGUF block's byte p does).
 * A feature past n_dim (the last group's) is all zeros. Each weight is d * q (Q8_0) or
 * d * q + m (one FMA), the value the compact kernel and baton_dequantize give.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "linear.h"
#include "runtime/thread_pool.h"

#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

#define PANEL_FEATURES 16
/* Rows of x per tile: 12 rows by two groups are 24 accumulators, beside the two groups' d and m,
 * their weights for one input and the broadcast: the 32 registers. */
#define MAX_TILE_ROWS 12
/* Blocks ahead of the one being multiplied that each group asks the cache for: at a few rows
 * the panels are read as fast as memory gives them, and the hardware prefetcher follows two
 * interleaved streams a tile less far. */
#define PREFETCH_BLOCKS 4
/* Chunks a thread gets on average (as compact_gemv.c's, for the same reason). */
#define CHUNKS_PER_THREAD 8

static int64_t panel_block_bytes(int fmt) {
    return fmt == FMT_Q8_0 ? 2 * PANEL_FEATURES + 32 * PANEL_FEATURES
                           : 4 * PANEL_FEATURES + 16 * PANEL_FEATURES;
}

static int is_panel_format(int fmt) {
    return fmt == FMT_Q8_0 || fmt == FMT_Q4_0 || fmt == FMT_Q4_1;
}

/* The panels' size in bytes, or -1 for a format that has none. */
int64_t baton_block_panels_bytes(int fmt, int64_t n_dim, int64_t k_dim) {
    if (!is_panel_format(fmt)) return -1;
    return (n_dim + PANEL_FEATURES - 1) / PANEL_FEATURES * (k_dim / 32) * panel_block_bytes(fmt);
}

/* Blocks [n_dim, row_bytes] (k_dim / 32 blocks a row) into panels. Returns 0, or -1 for another
 * format or a k_dim that is not whole blocks. */
int baton_pack_block_panels(int fmt, const uint8_t *w, int64_t n_dim, int64_t k_dim,
                            int64_t row_bytes, uint8_t *panels) {
    if (!is_panel_format(fmt) || k_dim % 32) return -1;
    const int64_t blocks = k_dim / 32, groups = (n_dim + PANEL_FEATURES - 1) / PANEL_FEATURES;
    const int64_t panel_bytes = panel_block_bytes(fmt);
    const int64_t block_bytes = fmt == FMT_Q8_0 ? 34 : fmt == FMT_Q4_0 ? 18 : 20;
    /* Where the block's quants start, and where they go in the panel block. */
    const int64_t quants_at = fmt == FMT_Q4_1 ? 4 : 2, quant_bytes = fmt == FMT_Q8_0 ? 32 : 16;
    const int64_t panel_quants_at = fmt == FMT_Q8_0 ? 2 * PANEL_FEATURES : 4 * PANEL_FEATURES;
    memset(panels, 0, (size_t)(groups * blocks * panel_bytes));
    for (int64_t n = 0; n < n_dim; n++) {
        const int64_t g = n / PANEL_FEATURES, j = n % PANEL_FEATURES;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *block = w + n * row_bytes + b * block_bytes;
            uint8_t *panel = panels + (g * blocks + b) * panel_bytes;
            memcpy(panel + 2 * j, block, 2); /* d */
            if (fmt != FMT_Q8_0) {
                uint16_t m, d;
                memcpy(&d, block, 2);
                if (fmt == FMT_Q4_1)
                    memcpy(&m, block + 2, 2);
                else /* w = d * (q - 8) = d * q + (-8 d); times 8 only moves the exponent */
                    m = _cvtss_sh(-8.0f * _cvtsh_ss(d), _MM_FROUND_TO_NEAREST_INT);
                memcpy(panel + 2 * PANEL_FEATURES + 2 * j, &m, 2);
            }
            for (int64_t p = 0; p < quant_bytes; p++)
                panel[panel_quants_at + p * PANEL_FEATURES + j] = block[quants_at + p];
        }
    }
    return 0;
}

/* y[r][n0 .. n0 + 16 * groups) (+ bias) for `rows` rows of x from `groups` consecutive groups
 * (rows, groups and q8 compile-time constants after inlining, so the sums stay in registers);
 * only features below n_dim are written. */
WIDE static inline __attribute__((always_inline)) void panel_tile(
    int rows, int groups, int q8, const float *x, int64_t k_dim, const uint8_t *panel,
    int64_t group_bytes, const float *bias, int64_t n0, int64_t n_dim, float *y) {
    __m512 acc[MAX_TILE_ROWS][2];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < groups; v++) acc[r][v] = _mm512_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0F);
    const int64_t block_bytes = panel_block_bytes(q8 ? FMT_Q8_0 : FMT_Q4_1);
    for (int64_t b = 0; b < k_dim / 32; b++) {
        const uint8_t *block[2], *quants[2];
        __m512 d[2], m[2];
        for (int v = 0; v < groups; v++) {
            block[v] = panel + v * group_bytes + b * block_bytes;
            d[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block[v]));
            if (!q8) m[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block[v] + 32)));
            quants[v] = block[v] + (q8 ? 2 : 4) * PANEL_FEATURES;
            for (int64_t line = 0; line < block_bytes; line += 64)
                _mm_prefetch((const char *)block[v] + PREFETCH_BLOCKS * block_bytes + line,
                             _MM_HINT_T0);
        }
        const float *xb = x + b * 32;
        /* Q8_0: byte row p is input p. Q4: row p's low nibbles are input p, its high ones
         * input p + 16, taken from the same load. */
        for (int p = 0; p < (q8 ? 32 : 16); p++) {
            __m128i bytes[2];
            for (int v = 0; v < groups; v++)
                bytes[v] = _mm_loadu_si128((const __m128i *)(quants[v] + p * PANEL_FEATURES));
            for (int half = 0; half < (q8 ? 1 : 2); half++) {
                __m512 wv[2];
                for (int v = 0; v < groups; v++) {
                    if (q8) {
                        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes[v]));
                        wv[v] = _mm512_mul_ps(d[v], q);
                    } else {
                        const __m128i nibbles = half ? _mm_srli_epi16(bytes[v], 4) : bytes[v];
                        const __m512 q =
                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(nibbles, low)));
                        wv[v] = _mm512_fmadd_ps(d[v], q, m[v]);
                    }
                }
                for (int r = 0; r < rows; r++) {
                    const __m512 xr = _mm512_set1_ps(xb[r * k_dim + p + 16 * half]);
                    for (int v = 0; v < groups; v++)
                        acc[r][v] = _mm512_fmadd_ps(xr, wv[v], acc[r][v]);
                }
            }
        }
    }
    for (int v = 0; v < groups; v++) {
        const int64_t n = n0 + PANEL_FEATURES * v;
        const __mmask16 valid =
            n_dim - n >= PANEL_FEATURES ? 0xFFFF : (__mmask16)((1u << (n_dim - n)) - 1);
        const __m512 add = bias ? _mm512_maskz_loadu_ps(valid, bias + n) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm512_mask_storeu_ps(y + r * n_dim + n, valid, _mm512_add_ps(acc[r][v], add));
    }
}

#define TILE_CASE(R)                                                                             \
    case R:                                                                                      \
        if (q8 && groups == 2)                                                                   \
            panel_tile(R, 2, 1, x, k_dim, panel, group_bytes, bias, n0, n_dim, y);               \
        else if (q8)                                                                             \
            panel_tile(R, 1, 1, x, k_dim, panel, group_bytes, bias, n0, n_dim, y);               \
        else if (groups == 2)                                                                    \
            panel_tile(R, 2, 0, x, k_dim, panel, group_bytes, bias, n0, n_dim, y);               \
        else                                                                                     \
            panel_tile(R, 1, 0, x, k_dim, panel, group_bytes, bias, n0, n_dim, y);               \
        break;

WIDE static void run_tile(int rows, int groups, int q8, const float *x, int64_t k_dim,
                          const uint8_t *panel, int64_t group_bytes, const float *bias, int64_t n0,
                          int64_t n_dim, float *y) {
    switch (rows) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
        TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
    }
}

typedef struct {
    const float *x, *bias;
    float *y;
    const uint8_t *panels;
    int64_t q8, rows, k_dim, n_dim, groups, groups_per_chunk;
} PanelLoop;

/* One chunk: its groups, two at a time, each pair against all rows of x in tiles of at most
 * MAX_TILE_ROWS rows, as even as they divide (16 rows: two of 8, not 12 and 4). */
WIDE static void panel_chunk(const void *arg, int64_t chunk) {
    const PanelLoop *l = arg;
    const int64_t group_bytes = l->k_dim / 32 * panel_block_bytes(l->q8 ? FMT_Q8_0 : FMT_Q4_1);
    const int64_t first = chunk * l->groups_per_chunk;
    const int64_t end =
        first + l->groups_per_chunk < l->groups ? first + l->groups_per_chunk : l->groups;
    const int64_t tiles = (l->rows + MAX_TILE_ROWS - 1) / MAX_TILE_ROWS;
    for (int64_t g = first; g < end; g += 2) {
        const int groups = end - g >= 2 ? 2 : 1;
        for (int64_t t = 0, r0 = 0; t < tiles; t++) {
            const int64_t rows = (l->rows - r0) / (tiles - t);
            run_tile((int)rows, groups, (int)l->q8, l->x + r0 * l->k_dim, l->k_dim,
                     l->panels + g * group_bytes, group_bytes, l->bias, g * PANEL_FEATURES,
                     l->n_dim, l->y + r0 * l->n_dim);
            r0 += rows;
        }
    }
}

/* y [rows, n_dim] = x [rows, k_dim] @ W^T (+ bias), W in panels of format `fmt`
 * (baton_pack_block_panels). The caller checked the CPU has AVX-512. */
void baton_block_panel_gemm(int fmt, const float *x, int64_t rows, int64_t k_dim,
                            const uint8_t *panels, int64_t n_dim, const float *bias, float *y) {
    const int64_t groups = (n_dim + PANEL_FEATURES - 1) / PANEL_FEATURES;
    const int64_t chunks_wanted = CHUNKS_PER_THREAD * (int64_t)omp_get_max_threads();
    int64_t per_chunk = (groups + chunks_wanted - 1) / chunks_wanted;
    per_chunk += per_chunk % 2; /* whole pairs, so only the last group can go alone */
    const PanelLoop loop = {x,    bias,  y,     panels, fmt == FMT_Q8_0, rows,
                            k_dim, n_dim, groups, per_chunk};
    baton_parallel(panel_chunk, &loop, (groups + per_chunk - 1) / per_chunk);
}
