/* Batches of two rows or more on AMX: bf16 weights in tile order, multiplied by Intel's tile
 * unit (TDPBF16PS), for CPUs with AMX-BF16 (Sapphire Rapids and later), decode steps and
 * prefill chunks alike.
 *
 * The compact GEMV (compact_gemv.c) widens each bf16 weight and multiplies it in float32 with
 * AVX2 FMAs: one row is bound by the bytes it reads, but at 16-32 rows the FMAs bind (0.5B
 * shape, 32 rows: 167 ms a step on two cores against 37 ms of weight reads). One tile product
 * multiplies 16 rows by 16 x 32 weights, so the same step reads the weights once and stays
 * bound by those bytes. The rows are rounded to bf16 first, as every bf16 GEMM rounds them;
 * products are exact and summed in float32, k-block after k-block, so a row's result does not
 * depend on the other rows of its batch.
 *
 * Prefill chunks: oneDNN's bf16 GEMM reached 1.3-2.2 TFLOP/s on the 0.5B shape's layers alone
 * and less between the model's other kernels, then the model widened its bf16 products to
 * float32 and wrote the gate/up product out whole for the activation. Here the rows are cut
 * into groups that stay in a core's L2 while the weights stream past them (GROUP_BYTES), and a
 * product's epilogue writes float32 with its bias, or for the gated MLP the activation itself
 * (silu(gate) * up in bf16: the down product's rows), from the tile registers.
 *
 * The weights are in tile order (bf16_tiles.c), each 16 x 32 block as the tile unit's B operand
 * wants it.
 */
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16_tiles.h"
#include "linear.h"
#include "runtime/amx_tiles.h"
#include "runtime/thread_pool.h"
#include "runtime/vector_math512.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 where this CPU has AMX-BF16 (and the AVX-512 the kernels use beside it: F, DQ, BW, VL and
 * BF16, which every AMX CPU has) and the kernel let this process use the tile registers (Linux
 * hands out their 8 KB of state only on request), else 0. Asked once, before any thread tiles. */
int baton_amx_enable(void) {
    unsigned int eax, ebx, ecx, edx;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const int amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
    if (!amx_bf16 || !amx_tile || !baton_bf16_dot_supported()) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* Rows of A one chunk multiplies, in bf16 bytes: a group stays in the core's 2 MB L2 while
 * the chunk's 32 weight columns stream past it. On the AMX Xeon (2 threads), the 0.5B shape's
 * gate/up layer at 512 rows: 1.23 TFLOP/s for groups of 32 rows, 2.08 for 512 (0.9 MB); its
 * down layer (4864 inputs): 1.76 for 128 rows (1.2 MB), 1.68 for 512. */
#define GROUP_BYTES (1 << 20)

typedef struct {
    const uint16_t *x; /* [rows, k_pad] bf16 */
    const uint16_t *tiles;
    const float *bias;
    void *y;
    int64_t rows, k_pad, n_dim, epilogue, group_rows, feature_chunks;
} AmxLoop;

/* The block of rows at x times the weight columns b0 and b1, into C tiles 0-3 (above), which
 * start from the [rows][32] floats at `start` (rows `start_stride` floats apart; 0: the same 32
 * in every row, a bias) or from zero (NULL). */
AMX_TARGET static void multiply_block(const uint16_t *x, int rows, int64_t k_pad,
                                      const uint16_t *b0, const uint16_t *b1, const float *start,
                                      int64_t start_stride) {
    const int64_t k_blocks = k_pad / TILE_K, a_stride = k_pad * 2;
    if (!start) {
        zero_accumulators(rows);
    } else {
        _tile_loadd(0, start, start_stride * 4);
        _tile_loadd(1, start + TILE_N, start_stride * 4);
        if (rows > 16) {
            _tile_loadd(2, start + 16 * start_stride, start_stride * 4);
            _tile_loadd(3, start + 16 * start_stride + TILE_N, start_stride * 4);
        }
    }
    if (rows > 16) {
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            _tile_loadd(4, x + kb * TILE_K, a_stride);
            _tile_loadd(6, b0 + kb * (TILE_BYTES / 2), 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b1 + kb * (TILE_BYTES / 2), 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, x + 16 * k_pad + kb * TILE_K, a_stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else {
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            _tile_loadd(4, x + kb * TILE_K, a_stride);
            _tile_loadd(6, b0 + kb * (TILE_BYTES / 2), 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b1 + kb * (TILE_BYTES / 2), 64);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
}

/* One chunk: a group of rows (GROUP_BYTES) by one chunk of weight columns.
 * - EPILOGUE_STORE: 32 output features, y float32 [rows, n_dim] = bias + product.
 * - EPILOGUE_ADD: the same without a bias, added to y: y = y + product (the tiles start from y).
 * - EPILOGUE_SILU_MUL: the gated MLP's [gate | up] weight, 16 features of each (gate f, up
 *   inter + f): y bf16 [rows, inter] = silu(gate) * up, each rounded once, as
 *   baton_silu_mul's 16-float path computes it from float32 products.
 * Each output sums its start (bias or y) and its products in one order whatever the chunk, so
 * a row's result does not depend on its batch. Whole tiles of a plain product go straight
 * between y and the tile registers; the rest (the gated activation, a last chunk of fewer
 * features) pass through `c`, where a block's epilogue runs while the tile unit multiplies the
 * next block: its products are issued first, so the vector work overlaps them. */
AMX_TARGET static void amx_chunk(const void *arg, int64_t chunk) {
    const AmxLoop *g = arg;
    const int64_t group = chunk / g->feature_chunks, columns = chunk % g->feature_chunks;
    const int silu = g->epilogue == EPILOGUE_SILU_MUL, add = g->epilogue == EPILOGUE_ADD;
    const int64_t inter = g->n_dim / 2;
    TileColumns cols;
    tile_columns(g->tiles, g->k_pad, g->n_dim, g->epilogue, g->bias, columns, &cols);
    const int64_t n0 = cols.n0, width = cols.width;
    const __mmask16 low_mask = cols.low_mask, high_mask = cols.high_mask;
    const uint16_t *b0 = cols.w0, *b1 = cols.w1;
    const float *bias = cols.start;
    const int direct = !silu && width == 2 * TILE_N;
    float *const y = g->y;
    const int64_t first = group * g->group_rows;
    const int64_t last = first + g->group_rows < g->rows ? first + g->group_rows : g->rows;
    _Alignas(64) float c[2][AMX_BLOCK_ROWS][2 * TILE_N];
    int configured = 0, pending_rows = 0;
    int64_t pending_r0 = 0;
    for (int64_t r0 = first; r0 < last || pending_rows; r0 += AMX_BLOCK_ROWS) {
        const int rows = r0 < last ? (int)(last - r0 < AMX_BLOCK_ROWS ? last - r0 : AMX_BLOCK_ROWS) : 0;
        float(*buffer)[2 * TILE_N] = c[(r0 / AMX_BLOCK_ROWS) & 1];
        if (rows) {
            if (rows != configured) configure_tiles(configured = rows);
            const float *start = g->bias ? bias : NULL;
            int64_t start_stride = 0;
            if (add && direct) {
                start = y + r0 * g->n_dim + n0;
                start_stride = g->n_dim;
            } else if (add) { /* y's partial block, zero-padded, from `c` */
                for (int r = 0; r < rows; r++) {
                    const float *from = y + (r0 + r) * g->n_dim + n0;
                    _mm512_store_ps(&buffer[r][0], _mm512_maskz_loadu_ps(low_mask, from));
                    _mm512_store_ps(&buffer[r][TILE_N], _mm512_maskz_loadu_ps(high_mask, from + TILE_N));
                }
                start = &buffer[0][0];
                start_stride = 2 * TILE_N;
            }
            multiply_block(g->x + r0 * g->k_pad, rows, g->k_pad, b0, b1, start, start_stride);
        }
        if (direct) {
            store_accumulators(rows, y + r0 * g->n_dim + n0, g->n_dim);
            continue;
        }
        if (pending_rows) {
            float(*done)[2 * TILE_N] = c[(pending_r0 / AMX_BLOCK_ROWS) & 1];
            for (int r = 0; r < pending_rows; r++) {
                const __m512 first16 = _mm512_load_ps(&done[r][0]);
                const __m512 second16 = _mm512_load_ps(&done[r][TILE_N]);
                if (silu) {
                    uint16_t *out = (uint16_t *)g->y + (pending_r0 + r) * inter + n0;
                    _mm256_storeu_si256((__m256i *)out,
                                        narrow16_bf16(_mm512_mul_ps(silu16(first16), second16)));
                } else {
                    float *out = y + (pending_r0 + r) * g->n_dim + n0;
                    _mm512_mask_storeu_ps(out, low_mask, first16);
                    _mm512_mask_storeu_ps(out + TILE_N, high_mask, second16);
                }
            }
        }
        if (rows) store_accumulators(rows, &buffer[0][0], 2 * TILE_N);
        pending_rows = rows;
        pending_r0 = r0;
    }
    _tile_release();
}

/* y = x @ W^T (+ bias) through `epilogue` (amx_chunk), W in tile order, x bf16 rows [rows,
 * k_pad]; rows >= 1, AMX enabled (baton_amx_enable), the arguments checked by
 * baton_bf16_tiles_gemm (bf16_tiles.c). */
AMX_TARGET void baton_amx_gemm(const uint16_t *x_bf16, int64_t rows, int64_t k_pad,
                               const uint16_t *tiles, int64_t n_dim, const float *bias,
                               int64_t epilogue, void *y) {
    const int64_t fitting = GROUP_BYTES / (k_pad * 2) / AMX_BLOCK_ROWS * AMX_BLOCK_ROWS;
    const int64_t group_rows = fitting > AMX_BLOCK_ROWS ? fitting : AMX_BLOCK_ROWS;
    const int64_t feature_chunks = epilogue == EPILOGUE_SILU_MUL
                                       ? n_dim / 2 / TILE_N
                                       : round_up(n_dim, 2 * TILE_N) / (2 * TILE_N);
    const AmxLoop loop = {x_bf16, tiles, bias, y, rows, k_pad, n_dim, epilogue, group_rows,
                          feature_chunks};
    baton_parallel(amx_chunk, &loop, (rows + group_rows - 1) / group_rows * feature_chunks);
}
