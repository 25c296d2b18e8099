/* What the two AMX kernels (amx_gemm.c, amx_blocks.c) share: the tile unit's configuration and
 * the shape of a weight tile. */
#ifndef BATON_AMX_TILES_H
#define BATON_AMX_TILES_H

#include <stdint.h>

#define TILE_N 16 /* output features per tile */
#define TILE_K 32 /* bf16 inputs per tile row */
#define TILE_BYTES 1024

/* The tile unit's configuration (ldtilecfg's 64-byte layout). */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* Where weight w[n][k] of a matrix cut into tiles lies within its tile: a tile holds 16 output
 * features by 32 inputs as the tile unit's B operand wants them, 16 rows of pairs, row p holding
 * (w[n][2p], w[n][2p + 1]) for n = 0..15. */
static inline int64_t tile_offset(int64_t n_in_tile, int64_t k_in_tile) {
    return (k_in_tile / 2) * 2 * TILE_N + 2 * n_in_tile + (k_in_tile & 1);
}

#endif
