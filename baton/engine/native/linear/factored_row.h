/* What factored_row.c's sweeps and their AVX-512 ones (factored_row512.c) share: the product's
 * arguments, with each row's sums of x by 32 and by 16. */
#ifndef BATON_FACTORED_ROW_H
#define BATON_FACTORED_ROW_H

#include <stdint.h>

typedef struct {
    const float *x, *block_sums, *half_sums, *bias; /* sums of x by 32 and by 16, each row's */
    float *y;
    const uint8_t *w;
    int64_t m_dim, k_dim, n_dim, row_bytes, rows_per_chunk;
} RowLoop;

/* One chunk of weight rows against one row of x, 16 floats a vector (factored_row512.c). */
void baton_factored_q4_k_row512(const void *arg, int64_t chunk);
void baton_factored_q6_k_row512(const void *arg, int64_t chunk);

#endif
