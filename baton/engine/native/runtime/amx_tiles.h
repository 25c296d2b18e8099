/* What the AMX kernels (amx_gemm.c, amx_attention.c, amx_blocks.c) share: the tile unit's
 * configuration and the shape of a weight tile. */
#ifndef BATON_AMX_TILES_H
#define BATON_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>

/* Every AMX CPU has AVX-512 and AVX512_BF16 (baton_amx_enable checks): the kernels' epilogues
 * and conversions use them. */
#define AMX_TARGET                                                                             \
    __attribute__((target(                                                                     \
        "amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))

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

/* The tile unit shaped for a block of `rows` (1-32) rows: C tiles 0-1 hold rows 0-15, 2-3 rows
 * 16-31; A tiles 4-5 those rows' 32 inputs; B tiles 6-7 two blocks of 16 weight columns. */
AMX_TARGET static inline void configure_tiles(int rows) {
    const int low = rows < 16 ? rows : 16, high = rows - low;
    TileConfig config = {.palette_id = 1};
    for (int t = 0; t < 8; t++) config.colsb[t] = 64;
    config.rows[0] = config.rows[1] = config.rows[4] = (uint8_t)low;
    config.rows[2] = config.rows[3] = config.rows[5] = (uint8_t)high;
    config.rows[6] = config.rows[7] = TILE_K / 2;
    if (!high) config.colsb[2] = config.colsb[3] = config.colsb[5] = 0;
    _tile_loadconfig(&config);
}

/* C tiles 0-3 (2-3 only for more than 16 rows) to zero. */
AMX_TARGET static inline void zero_accumulators(int rows) {
    _tile_zero(0);
    _tile_zero(1);
    if (rows > 16) {
        _tile_zero(2);
        _tile_zero(3);
    }
}

/* C tiles 0-3 of a block of `rows` rows into [rows][32] floats at `out`, rows `stride` floats
 * apart. */
AMX_TARGET static inline void store_accumulators(int rows, float *out, int64_t stride) {
    _tile_stored(0, out, stride * 4);
    _tile_stored(1, out + TILE_N, stride * 4);
    if (rows > 16) {
        _tile_stored(2, out + 16 * stride, stride * 4);
        _tile_stored(3, out + 16 * stride + TILE_N, stride * 4);
    }
}

#endif
