/* Decode batches of a few rows on AMX: bf16 weights in tile order, multiplied by Intel's tile
 * unit (TDPBF16PS), for CPUs with AMX-BF16 (Sapphire Rapids and later).
 *
 * The compact GEMV (compact_gemv.c) widens each bf16 weight and multiplies it in float32 with
 * AVX2 FMAs: one row is bound by the bytes it reads, but at 16-32 rows the FMAs bind (0.5B
 * shape, 32 rows: 167 ms a step on two cores against 37 ms of weight reads). One tile product
 * multiplies 16 rows by 16 x 32 weights, so the same step reads the weights once and stays
 * bound by those bytes. The rows are rounded to bf16 first, as every bf16 GEMM rounds them
 * (oneDNN's too, which the same plan uses past the native step's batches); products are exact
 * and summed in float32.
 *
 * Tile order: the weight [n, k] is cut into 16 x 32 blocks (n padded with zero rows to a
 * multiple of 32, k with zero columns to a multiple of 32); the blocks of 16 output features
 * lie together, k-blocks in order, each block as the tile unit's B operand wants it: 16 rows of
 * pairs, row p holding (w[n][2p], w[n][2p + 1]) for n = 0..15.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_tiles.h"
#include "linear.h"
#include "thread_pool.h"
#include "vector_math.h"

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 where this CPU has AMX-BF16 and the kernel let this process use the tile registers (Linux
 * hands out their 8 KB of state only on request), else 0. Asked once, before any thread tiles. */
int baton_amx_enable(void) {
    unsigned int eax, ebx, ecx, edx;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const int amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
    if (!amx_bf16 || !amx_tile) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* Bytes of `baton_pack_bf16_tiles`' output for an [n_dim, k_dim] weight. */
int64_t baton_bf16_tiles_bytes(int64_t n_dim, int64_t k_dim) {
    return round_up(n_dim, 2 * TILE_N) * round_up(k_dim, TILE_K) * 2;
}

/* out = the bf16 weight w [n_dim, k_dim] (rows `row_bytes` apart) in tile order (above). */
void baton_pack_bf16_tiles(const uint8_t *w, int64_t n_dim, int64_t k_dim, int64_t row_bytes,
                           uint16_t *out) {
    const int64_t n_pad = round_up(n_dim, 2 * TILE_N), k_blocks = round_up(k_dim, TILE_K) / TILE_K;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < n_pad / TILE_N; nb++)
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            uint16_t *tile = out + (nb * k_blocks + kb) * (TILE_BYTES / 2);
            for (int64_t i = 0; i < TILE_N; i++)
                for (int64_t j = 0; j < TILE_K; j++) {
                    const int64_t n = nb * TILE_N + i, k = kb * TILE_K + j;
                    tile[tile_offset(i, j)] =
                        n < n_dim && k < k_dim ? ((const uint16_t *)(w + n * row_bytes))[k] : 0;
                }
        }
}

/* Float32 rows to bf16 (vector_math.h's rounding, torch's), into `k_pad`-wide rows whose tail
 * past k_dim is zero. */
static void rows_to_bf16(const float *x, int64_t rows, int64_t k_dim, int64_t k_pad,
                         uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *src = x + r * k_dim;
        uint16_t *dst = out + r * k_pad;
        int64_t i = 0;
        for (; i + 8 <= k_dim; i += 8)
            _mm_storeu_si128((__m128i *)(dst + i), narrow_bf16(_mm256_loadu_ps(src + i)));
        for (; i < k_dim; i++) dst[i] = bf16_of(src[i]);
        for (; i < k_pad; i++) dst[i] = 0;
    }
}

typedef struct {
    const uint16_t *x; /* [rows, k_pad] bf16 */
    const uint16_t *tiles;
    const float *bias;
    float *y;
    int64_t rows, k_pad, n_dim;
} AmxLoop;

/* Two blocks of 16 output features (one chunk) against every row: C tiles 0-1 hold rows 0-15,
 * 2-3 rows 16-31; A tiles 4-5 the rows' 32 inputs, B tiles 6-7 the two blocks' weights. */
AMX_TARGET static void amx_chunk(const void *arg, int64_t chunk) {
    const AmxLoop *g = arg;
    const int64_t k_blocks = g->k_pad / TILE_K, a_stride = g->k_pad * 2;
    const int low_rows = g->rows < 16 ? (int)g->rows : 16, high_rows = (int)g->rows - low_rows;
    TileConfig config = {.palette_id = 1};
    for (int t = 0; t < 8; t++) config.colsb[t] = 64;
    config.rows[0] = config.rows[1] = config.rows[4] = (uint8_t)low_rows;
    config.rows[2] = config.rows[3] = config.rows[5] = (uint8_t)high_rows;
    config.rows[6] = config.rows[7] = TILE_K / 2;
    if (!high_rows) config.colsb[2] = config.colsb[3] = config.colsb[5] = 0;
    _tile_loadconfig(&config);
    const uint16_t *b0 = g->tiles + 2 * chunk * k_blocks * (TILE_BYTES / 2);
    const uint16_t *b1 = b0 + k_blocks * (TILE_BYTES / 2);
    _tile_zero(0);
    _tile_zero(1);
    if (high_rows) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            _tile_loadd(4, g->x + kb * TILE_K, a_stride);
            _tile_loadd(5, g->x + 16 * g->k_pad + kb * TILE_K, a_stride);
            _tile_loadd(6, b0 + kb * (TILE_BYTES / 2), 64);
            _tile_loadd(7, b1 + kb * (TILE_BYTES / 2), 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else {
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            _tile_loadd(4, g->x + kb * TILE_K, a_stride);
            _tile_loadd(6, b0 + kb * (TILE_BYTES / 2), 64);
            _tile_loadd(7, b1 + kb * (TILE_BYTES / 2), 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    float c[AMX_MAX_ROWS][2 * TILE_N];
    _tile_stored(0, &c[0][0], sizeof c[0]);
    _tile_stored(1, &c[0][TILE_N], sizeof c[0]);
    if (high_rows) {
        _tile_stored(2, &c[16][0], sizeof c[0]);
        _tile_stored(3, &c[16][TILE_N], sizeof c[0]);
    }
    _tile_release();
    const int64_t n0 = chunk * 2 * TILE_N;
    const int64_t width = g->n_dim - n0 < 2 * TILE_N ? g->n_dim - n0 : 2 * TILE_N;
    for (int64_t r = 0; r < g->rows; r++)
        for (int64_t i = 0; i < width; i++)
            g->y[r * g->n_dim + n0 + i] = c[r][i] + (g->bias ? g->bias[n0 + i] : 0.0f);
}

/* y [rows, n_dim] = bf16(x [rows, k_dim]) @ W^T (+ bias), W in tile order; 1 <= rows <=
 * AMX_MAX_ROWS and
 * AMX enabled (baton_amx_enable). Returns 0, -1 for too many rows, -2 if memory ran out. */
AMX_TARGET int baton_amx_gemm(const float *x, int64_t rows, int64_t k_dim, const uint16_t *tiles,
                              int64_t n_dim, const float *bias, float *y) {
    if (rows < 1 || rows > AMX_MAX_ROWS) return -1;
    /* The rows in bf16, in a buffer each calling thread keeps (and grows) from call to call. */
    static __thread uint16_t *x_bf16;
    static __thread int64_t capacity;
    const int64_t k_pad = round_up(k_dim, TILE_K), needed = round_up(rows * k_pad * 2, 64);
    if (needed > capacity) {
        free(x_bf16);
        x_bf16 = aligned_alloc(64, needed);
        capacity = x_bf16 ? needed : 0;
        if (!x_bf16) return -2;
    }
    rows_to_bf16(x, rows, k_dim, k_pad, x_bf16);
    const AmxLoop loop = {x_bf16, tiles, bias, y, rows, k_pad, n_dim};
    baton_parallel(amx_chunk, &loop, round_up(n_dim, 2 * TILE_N) / (2 * TILE_N));
    return 0;
}
