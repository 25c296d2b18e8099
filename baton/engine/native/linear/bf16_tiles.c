/* bf16 weights in tile order, the one layout both bf16 units multiply: AMX's tile unit
 * (amx_gemm.c) and AVX512_BF16's VDPBF16PS (bf16_dot_gemm.c).
 *
 * Tile order: the weight [n, k] is cut into 16 x 32 blocks (n padded with zero rows to a
 * multiple of 32, k with zero columns to a multiple of 32); the blocks of 16 output features
 * lie together, k-blocks in order, each block as the tile unit's B operand wants it: 16 rows of
 * pairs, row p holding (w[n][2p], w[n][2p + 1]) for n = 0..15. Each such 64-byte row is also
 * one VDPBF16PS operand, so a group of 16 features is one stream of them, pair after pair.
 */
#include <stdint.h>

#include "linear.h"
#include "runtime/amx_tiles.h"
#include "runtime/bf16_rows.h"
#include "runtime/thread_buffer.h"

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

int baton_bf16_tiles_gemm(int64_t amx, const float *x, const uint16_t *x_bf16, int64_t rows,
                          int64_t k_dim, const uint16_t *tiles, int64_t n_dim, const float *bias,
                          int64_t epilogue, void *y) {
    const int64_t k_pad = round_up(k_dim, TILE_K);
    if (rows < 1 || (x_bf16 && k_pad != k_dim)) return -3;
    if (epilogue == EPILOGUE_SILU_MUL && n_dim % (2 * TILE_N)) return -3;
    if (epilogue == EPILOGUE_ADD && bias) return -3;
    if (!x_bf16) {
        /* The rows in bf16, in a buffer each calling thread keeps (and grows) from call to call:
         * the same values whichever unit multiplies them. */
        static __thread ThreadBuffer rows_buffer;
        x_bf16 = bf16_rows_parallel(&rows_buffer, x, rows, k_dim, k_pad);
        if (!x_bf16) return -2;
    }
    (amx ? baton_amx_gemm : baton_bf16_dot_gemm)(x_bf16, rows, k_pad, tiles, n_dim, bias,
                                                 epilogue, y);
    return 0;
}
