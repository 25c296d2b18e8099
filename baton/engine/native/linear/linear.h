/* A linear layer's weights as the native kernels read them, and its product (baton_linear). */
#ifndef BATON_LINEAR_H
#define BATON_LINEAR_H

#include <stdint.h>

/* The compact formats (formats.py's FORMATS' kernel ids). */
enum {
    FMT_BF16, FMT_F16, FMT_Q8_0, FMT_Q4_0, FMT_Q4_1, FMT_Q4_K, FMT_Q5_K, FMT_Q6_K, FMT_Q3_K,
    FMT_Q2_K, FMT_IQ4_NL, FMT_IQ4_XS, FMT_Q5_0, FMT_Q5_1, FMT_COUNT,
    FMT_PARTS = 100 /* formats.py's PARTS */
};

/* A linear layer's compact weight (formats.py's CompactWeight), its bias (or NULL) and the same
 * weight in tile order (NULL where there is none): a bf16 weight as bf16 (bf16_tiles.c), on AMX
 * or AVX512_BF16 CPUs; a block format's integers and scales as records (amx_blocks.c), on AMX
 * CPUs; panels: a block format's weight in panels of 16 features (block_panels.c), on AVX-512
 * CPUs (NULL where there are none); avx512: the compact kernel may use AVX-512 (the CPU has it
 * and the plan's ISA allows it); amx: bf16 tiles are multiplied on AMX, else with AVX512_BF16
 * (bf16_dot_gemm.c). Mirrored by structs.py's Matrix: keep the field order in step. */
typedef struct Matrix {
    int64_t format, in_features, out_features, row_bytes;
    const uint8_t *data;
    const float *bias;
    const void *tiles;
    const uint8_t *panels;
    int64_t avx512, amx;
    /* A fused weight whose parts are stored in different formats: num_parts matrices stacked
     * row-wise (each with its share of the bias), format FMT_PARTS, no data of its own. */
    const struct Matrix *parts;
    int64_t num_parts;
} Matrix;

/* y [rows, out_features] = x [rows, in_features] @ W^T (+ bias). Returns 0, or -1 if memory ran
 * out or the format is unknown. */
int baton_linear(const Matrix *m, const float *x, int64_t rows, float *y);

/* y [rows, out_features] += x @ W^T (+ bias): a layer whose output joins the residual stream.
 * With bf16 tiles, no bias and 2 rows or more, the tiles start from y (y + products); else the
 * product, into `scratch` [rows, out_features] (NULL: a buffer of its own), then y = product +
 * y. Returns as baton_linear. */
int baton_linear_add(const Matrix *m, const float *x, int64_t rows, float *y, float *scratch);

/* Rows one AMX product takes at a time: two tiles of 16 (amx_gemm.c). */
#define AMX_BLOCK_ROWS 32

/* What a bf16 tiles product writes (NativeKernels mirrors the values): the product, float32,
 * with its bias; the gated MLP's activation of a [gate | up] product, bf16; or the product added
 * to y. */
enum { EPILOGUE_STORE = 0, EPILOGUE_SILU_MUL = 1, EPILOGUE_ADD = 2 };

/* 1 where the CPU has AVX512_BF16 and AVX-512 F, DQ, BW and VL (bf16_dot_gemm.c), else 0. */
int baton_bf16_dot_supported(void);
/* The bf16 tiles' products on each unit (amx_gemm.c, bf16_dot_gemm.c): x bf16 rows [rows,
 * k_pad], the arguments checked by baton_bf16_tiles_gemm. */
void baton_amx_gemm(const uint16_t *x_bf16, int64_t rows, int64_t k_pad, const uint16_t *tiles,
                    int64_t n_dim, const float *bias, int64_t epilogue, void *y);
void baton_bf16_dot_gemm(const uint16_t *x_bf16, int64_t rows, int64_t k_pad,
                         const uint16_t *tiles, int64_t n_dim, const float *bias,
                         int64_t epilogue, void *y);
/* y = x @ W^T (+ bias) through `epilogue`, W a bf16 weight in tile order (bf16_tiles.c), on AMX
 * where `amx`, else with AVX512_BF16; rows >= 1. x: float32 rows [rows, k_dim], rounded to
 * bf16 here; or x_bf16 (x NULL): bf16 rows already, k_dim a multiple of 32. Returns 0, -2 if
 * memory ran out, -3 for what the epilogue cannot take (bf16 rows of partial tiles, a gated
 * weight of partial tiles, a bias to add to y). */
int baton_bf16_tiles_gemm(int64_t amx, const float *x, const uint16_t *x_bf16, int64_t rows,
                          int64_t k_dim, const uint16_t *tiles, int64_t n_dim, const float *bias,
                          int64_t epilogue, void *y);
/* The first k_dim weights of a compact row (from a super-block boundary) as float32: each
 * format's exact values (compact_gemv.c). */
typedef void (*row_dequantizer)(const uint8_t *row, int64_t k_dim, float *dst);
/* y [m_dim, n_dim] = x @ W^T (+ bias) from W's rows dequantized a stage at a time
 * (staged_gemm.c), 16 floats a vector where `avx512` (the caller checked the CPU has it); k_dim
 * a multiple of 32, and of 256 for the 256-weight super-blocks. */
void baton_staged_gemm(row_dequantizer dequantize, int avx512, const float *x, int64_t m_dim,
                       int64_t k_dim, const uint8_t *w, int64_t n_dim, int64_t row_bytes,
                       const float *bias, float *y);
int baton_compact_gemv(int fmt, int avx512, const float *x, int64_t m_dim, int64_t k_dim,
                       const uint8_t *w, int64_t n_dim, int64_t row_bytes, const float *bias,
                       float *y);
/* A few rows against a matrix of GGUF blocks, the sums factored by block (factored_row.c),
 * with AVX-512 where `avx512`; 1 for rows or a format it does not cover. */
int baton_factored_row(int fmt, int avx512, const float *x, int64_t m_dim, int64_t k_dim,
                       const uint8_t *w, int64_t n_dim, int64_t row_bytes, const float *bias,
                       float *y);
int baton_dequantize_rows(int fmt, int avx512, const uint8_t *w, int64_t k_dim,
                          int64_t row_bytes, const int64_t *ids, int64_t count, float *out);
/* The AVX-512 row dequantizer of `fmt` (row_dequantize512.c: Q4_K, Q6_K), or NULL. */
row_dequantizer baton_row_dequantizer512(int fmt);
void baton_block_panel_gemm(int fmt, const float *x, int64_t rows, int64_t k_dim,
                            const uint8_t *panels, int64_t n_dim, const float *bias, float *y);
int baton_amx_block_gemm(int fmt, const float *x, int64_t rows, int64_t k_dim,
                         const uint8_t *records, int64_t n_dim, const float *bias, float *y);

#endif
