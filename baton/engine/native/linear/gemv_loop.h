/* What the sweeps of compact_gemv.c (8 floats a vector) and wide_sweeps512.c (16, AVX-512)
 * share: a product as a parallel loop over chunks of weight rows, each chunk swept once per
 * pass of rows of x by a sweep specialised for its number of rows. */
#ifndef BATON_GEMV_LOOP_H
#define BATON_GEMV_LOOP_H

#include <stdint.h>

#include "runtime/thread_pool.h"

/* One product as a parallel loop (thread_pool.h) over chunks of weight rows. */
typedef struct {
    const float *x, *bias;
    float *y;
    const uint8_t *w;
    int64_t m_dim, k_dim, n_dim, row_bytes, rows_per_chunk;
    int64_t rows_per_pass; /* rows of x each sweep over the chunk's weight rows takes */
} GemvLoop;


/* The sweep for `rows` rows of x (a compile-time constant in each case, so that SWEEP's loops
 * over rows unroll into registers). */
#define SWEEP_ROWS(SWEEP, N)                                                                     \
    case N: SWEEP(xm, g->k_dim, g->w, g->row_bytes, n_begin, n_end, g->n_dim, N, g->bias, ym); break;
#define SWEEP_ROWS_1_7(SWEEP)                                                                    \
    SWEEP_ROWS(SWEEP, 1) SWEEP_ROWS(SWEEP, 2) SWEEP_ROWS(SWEEP, 3) SWEEP_ROWS(SWEEP, 4)          \
    SWEEP_ROWS(SWEEP, 5) SWEEP_ROWS(SWEEP, 6) SWEEP_ROWS(SWEEP, 7)
#define SWEEP_ROWS_1_15(SWEEP)                                                                   \
    SWEEP_ROWS_1_7(SWEEP) SWEEP_ROWS(SWEEP, 8) SWEEP_ROWS(SWEEP, 9) SWEEP_ROWS(SWEEP, 10)        \
    SWEEP_ROWS(SWEEP, 11) SWEEP_ROWS(SWEEP, 12) SWEEP_ROWS(SWEEP, 13) SWEEP_ROWS(SWEEP, 14)      \
    SWEEP_ROWS(SWEEP, 15)

/* One chunk of weight rows (CHUNK), swept by SWEEP once per rows_per_pass rows of x, at most
 * MAX_ROWS (CASES: the sweeps for fewer rows, SWEEP_ROWS_1_{MAX_ROWS - 1}); ATTRS: the
 * function's target attributes, if any. */
#define DEFINE_CHUNK(CHUNK, SWEEP, ATTRS, MAX_ROWS, CASES)                                      \
    ATTRS static void CHUNK(const void *arg, int64_t chunk) {                                   \
        const GemvLoop *g = arg;                                                                \
        const int64_t n_begin = chunk * g->rows_per_chunk;                                      \
        const int64_t n_end = n_begin + g->rows_per_chunk < g->n_dim ? n_begin + g->rows_per_chunk : g->n_dim; \
        for (int64_t m0 = 0; m0 < g->m_dim; m0 += g->rows_per_pass) {                           \
            const float *xm = g->x + m0 * g->k_dim;                                             \
            float *ym = g->y + m0 * g->n_dim;                                                   \
            switch (g->m_dim - m0 < g->rows_per_pass ? g->m_dim - m0 : g->rows_per_pass) {      \
            CASES(SWEEP)                                                                        \
            default: SWEEP(xm, g->k_dim, g->w, g->row_bytes, n_begin, n_end, g->n_dim, MAX_ROWS, g->bias, ym); break; \
            }                                                                                   \
        }                                                                                       \
    }

/* Rows of x per sweep of the AVX-512 kernels: their 32 registers hold 16 accumulators, the
 * weight vectors and the dequantizer's constants, so each block is dequantized once per 16 rows,
 * not per 8 (where the AVX2 kernel's 16 registers stop), and a 16-row batch reads W once:
 * SmolLM2's Q4_1 layers 8-9 % faster at 16 and 32 rows. Only where 16 rows stay in L1 (48 KB
 * here) beside the weights streaming past (WIDE_PASS_BYTES); longer rows keep 8 a pass: 16 rows
 * of SmolLM2's 1536-long ones, read from L2, ran 25 % slower, and splitting each weight row into
 * spans that fit made the 0.5B shape's bf16 layers 2-4 % slower than 8 a pass. */
#define WIDE_ROWS_PER_PASS 16
#define WIDE_PASS_BYTES (40 * 1024)

/* The AVX-512 sweep's chunk for m_dim rows of x, k_dim long, against `fmt`, or 0 where it has
 * none or another kernel is faster (the caller checked the CPU has AVX-512). */
chunk_fn baton_wide_sweep(int fmt, int64_t m_dim, int64_t k_dim);

/* x's rows as the AVX-512 sweeps read them (see wide_sweeps512.c), into `packed` (m_dim x k_dim
 * floats). */
void baton_pack_rows(const float *x, int64_t m_dim, int64_t k_dim, int64_t rows_per_pass,
                     float *packed);

#endif
