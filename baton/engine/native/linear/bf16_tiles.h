/* What both bf16 units' kernels (amx_gemm.c, bf16_dot_gemm.c) take from a chunk's columns of a
 * product over bf16 weights in tile order (bf16_tiles.c). */
#ifndef BATON_BF16_TILES_H
#define BATON_BF16_TILES_H

#include <immintrin.h>
#include <stdint.h>

#include "linear.h"
#include "runtime/amx_tiles.h"

/* A chunk's two groups of 16 weight features, where their outputs go and what their sums start
 * from. A plain product's chunk is 32 consecutive features (fewer in the last, `width`); a
 * gated MLP's [gate | up] weight gives 16 of gate's (f) and the same 16 of up's (inter + f). */
typedef struct {
    const uint16_t *w0, *w1; /* the two groups' tiles */
    int64_t n0, width;       /* the first output feature, and how many are written */
    __mmask16 low_mask, high_mask;
    /* The bias's 32 values (gate's then up's), zeros past the width or without a bias. */
    _Alignas(64) float start[2 * TILE_N];
} TileColumns;

static inline void tile_columns(const uint16_t *tiles, int64_t k_pad, int64_t n_dim,
                                int64_t epilogue, const float *bias, int64_t columns,
                                TileColumns *c) {
    const int64_t group_stride = k_pad * TILE_N; /* bf16 values of one group's tiles */
    const int silu = epilogue == EPILOGUE_SILU_MUL;
    const int64_t inter = n_dim / 2;
    c->n0 = silu ? columns * TILE_N : columns * 2 * TILE_N;
    c->w0 = tiles + (silu ? columns : 2 * columns) * group_stride;
    c->w1 = silu ? tiles + (columns + inter / TILE_N) * group_stride : c->w0 + group_stride;
    c->width = silu ? TILE_N : n_dim - c->n0 < 2 * TILE_N ? n_dim - c->n0 : 2 * TILE_N;
    c->low_mask = c->width >= 16 ? 0xFFFF : (__mmask16)((1u << c->width) - 1);
    c->high_mask = c->width >= 32  ? 0xFFFF
                   : c->width > 16 ? (__mmask16)((1u << (c->width - 16)) - 1)
                                   : 0;
    for (int64_t i = 0; i < 2 * TILE_N; i++) {
        const int64_t feature = silu ? (i < TILE_N ? c->n0 + i : inter + c->n0 + i - TILE_N)
                                     : c->n0 + i;
        c->start[i] = bias && (silu || i < c->width) ? bias[feature] : 0.0f;
    }
}

#endif
