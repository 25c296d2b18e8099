/* Packing GGUF block matrices into amx_block_records.h's records, once at load. */
#include <stdint.h>
#include <string.h>

#include "amx_block_records.h"

static int block_bytes(int fmt) {
    switch (fmt) {
    case FMT_Q8_0: return 34;
    case FMT_Q4_0: return 18;
    case FMT_Q4_1: return 20;
    default: return 0;
    }
}

/* Bytes `baton_pack_block_tiles` writes for an [n_dim, k_dim] matrix of format fmt. */
int64_t baton_block_tiles_bytes(int fmt, int64_t n_dim, int64_t k_dim) {
    return round_up(n_dim, 2 * TILE_N) / TILE_N * (k_dim / TILE_K) * record_bytes(fmt);
}

/* Integer i (0-31) of a block as stored: Q4_0's nibble unshifted (the kernel subtracts 8). */
static int stored_integer(int fmt, const uint8_t *block, int i) {
    if (fmt == FMT_Q8_0) return (int8_t)block[2 + i];
    const uint8_t *nibbles = block + (fmt == FMT_Q4_1 ? 4 : 2);
    return (nibbles[i % 16] >> (i < 16 ? 0 : 4)) & 0x0F;
}

/* out (baton_block_tiles_bytes) = the [n_dim, k_dim] block matrix w (rows `row_bytes` apart) in
 * records (amx_block_records.h). Returns 0, or -1 for a format without integer blocks or partial blocks. */
int baton_pack_block_tiles(int fmt, const uint8_t *w, int64_t n_dim, int64_t k_dim,
                           int64_t row_bytes, uint8_t *out) {
    const int bytes = block_bytes(fmt);
    if (!bytes || k_dim % TILE_K) return -1;
    const int64_t n_tiles = round_up(n_dim, 2 * TILE_N) / TILE_N, k_blocks = k_dim / TILE_K;
    const int64_t record = record_bytes(fmt);
    memset(out, 0, baton_block_tiles_bytes(fmt, n_dim, k_dim));
#pragma omp parallel for schedule(static)
    for (int64_t nt = 0; nt < n_tiles; nt++)
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            uint8_t *integers = out + (nt * k_blocks + kb) * record;
            uint16_t *scales = (uint16_t *)(integers + integer_bytes(fmt));
            for (int n = 0; n < TILE_N && nt * TILE_N + n < n_dim; n++) {
                const uint8_t *block = w + (nt * TILE_N + n) * row_bytes + kb * bytes;
                memcpy(scales + n, block, 2);
                if (fmt == FMT_Q4_1) memcpy(scales + TILE_N + n, block + 2, 2);
                for (int k = 0; k < TILE_K; k++) {
                    const int64_t at = tile_offset(n, k), row = at / 32, j = at % 32;
                    const int q = stored_integer(fmt, block, k);
                    if (fmt == FMT_Q8_0)
                        integers[at] = (uint8_t)q;
                    else
                        integers[row * 16 + j % 16] |= (uint8_t)(q << (j < 16 ? 0 : 4));
                }
            }
        }
    return 0;
}
