/* Which kernel multiplies a linear layer's batch (linear.h's baton_linear): bf16 tiles (AMX or
 * AVX512_BF16), AMX block tiles, block panels or the compact kernel, by the weight's copies and
 * the batch's rows. The native decode step and Linear.forward both come here, so both multiply
 * a batch the same way.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linear.h"
#include "runtime/thread_buffer.h"

/* Rows from which a layer with tile-ordered weights multiplies them on the bf16 hardware rather
 * than reading its compact weights. bf16 tiles (AMX or AVX512_BF16): from 2 rows, at any number
 * (prefill chunks too); one row stays on the compact kernel, which keeps exact float32
 * arithmetic, as transformers' float32 reference computes it, at the same bytes read. AMX's
 * block formats' tiles widen their integers to bf16 in the kernel, at the same cost for 1 or 16
 * rows of a group, so they pay from a few rows, and then at any number. On the AMX Xeon (2
 * threads), compact against tiles: SmolLM2's Q4_1 layers at 8 rows 10.4-11.5 / 10.6 ms, 10 rows
 * 18.8 / 12.9, 16 rows 19.0-21.3 / 11.5-12.3; its Q8_0 head at 4 rows 1.42 / 1.45, 6 rows 2.05 /
 * -, 8 rows 2.18 / 1.47. */
#define TILES_MIN_ROWS 2

/* Rows from which a block weight's panels (block_panels.c) take a batch rather than the compact
 * kernel: at 2 rows the compact kernel's sweep was faster, at 3 the panels or level. SmolLM2's
 * layer shapes on the AMX Xeon with its tiles off (2 threads, 120 matrices), compact / panels,
 * ms: Q4_1 at 2 rows 7.8 / 8.2-8.8, 3 rows 8.5 / 7.1-8.0, 4 rows 9.5 / 8.2-8.7, 16 rows 23.1 /
 * 19.1-19.8; Q8_0 at 2 rows 8.5 / 9.3, 3 rows 9.1 / 8.6-9.2, 16 rows 22.9 / 18.5-20.3. */
#define PANEL_MIN_ROWS 3

static int64_t amx_blocks_min_rows(int64_t format) { return format == FMT_Q8_0 ? 5 : 9; }

/* A PARTS matrix: each part's product into a buffer, then into its columns of y. */
static int linear_parts(const Matrix *m, const float *x, int64_t rows, float *y) {
    static __thread ThreadBuffer part_buffer;
    if (!rows) return 0;
    int64_t widest = 0;
    for (int64_t p = 0; p < m->num_parts; p++)
        widest = m->parts[p].out_features > widest ? m->parts[p].out_features : widest;
    float *product = thread_buffer(&part_buffer, rows * widest * (int64_t)sizeof(float));
    if (!product) return -1;
    for (int64_t p = 0, column = 0; p < m->num_parts; column += m->parts[p].out_features, p++) {
        const int64_t width = m->parts[p].out_features;
        if (baton_linear(&m->parts[p], x, rows, product)) return -1;
        for (int64_t r = 0; r < rows; r++)
            memcpy(y + r * m->out_features + column, product + r * width, sizeof(float) * width);
    }
    return 0;
}

int baton_linear(const Matrix *m, const float *x, int64_t rows, float *y) {
    if (m->num_parts) return linear_parts(m, x, rows, y);
    if (m->tiles && m->format != FMT_BF16 && rows >= amx_blocks_min_rows(m->format))
        return baton_amx_block_gemm((int)m->format, x, rows, m->in_features, m->tiles,
                                    m->out_features, m->bias, y)
                   ? -1
                   : 0;
    if (m->tiles && m->format == FMT_BF16 && rows >= TILES_MIN_ROWS)
        return baton_bf16_tiles_gemm(m->amx, x, NULL, rows, m->in_features, m->tiles,
                                     m->out_features, m->bias, EPILOGUE_STORE, y)
                   ? -1
                   : 0;
    if (m->panels && rows >= PANEL_MIN_ROWS) {
        baton_block_panel_gemm((int)m->format, x, rows, m->in_features, m->panels,
                               m->out_features, m->bias, y);
        return 0;
    }
    return baton_compact_gemv((int)m->format, (int)m->avx512, x, rows, m->in_features, m->data,
                              m->out_features, m->row_bytes, m->bias, y);
}

int baton_linear_add(const Matrix *m, const float *x, int64_t rows, float *y, float *scratch) {
    if (!m->num_parts && m->tiles && m->format == FMT_BF16 && rows >= TILES_MIN_ROWS && !m->bias)
        return baton_bf16_tiles_gemm(m->amx, x, NULL, rows, m->in_features, m->tiles,
                                     m->out_features, NULL, EPILOGUE_ADD, y)
                   ? -1
                   : 0;
    float *product = scratch ? scratch : malloc(sizeof(float) * rows * m->out_features);
    const int failed = !product || baton_linear(m, x, rows, product);
    if (!failed)
        for (int64_t i = 0; i < rows * m->out_features; i++) y[i] = product[i] + y[i];
    if (!scratch) free(product);
    return failed ? -1 : 0;
}
