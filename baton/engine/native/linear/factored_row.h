/* What factored_row.c's sweeps and their AVX-512 ones (factored_row512.c) share: the product's
 * arguments, with each row's sums of x by 32 and by 16. */
#ifndef BATON_FACTORED_ROW_H
#define BATON_FACTORED_ROW_H

#include <stdint.h>

typedef struct {
    const float *x, *block_sums, *half_sums, *bias; /* sums of x by 32 and by 16, each row's */
    /* x with each 64 inputs in the order the Q6_K sweep's lanes take them (x_in_lane_order):
     * input 4i + j of the 64 at 16j + i. Set for that sweep only. */
    const float *x_by_lane;
    float *y;
    const uint8_t *w;
    int64_t m_dim, k_dim, n_dim, row_bytes, rows_per_chunk;
} RowLoop;

/* One chunk of weight rows against one row of x, 16 floats a vector (factored_row512.c). */
void baton_factored_q4_k_row512(const void *arg, int64_t chunk);
void baton_factored_q6_k_row512(const void *arg, int64_t chunk);
/* out [k_dim] = x [k_dim] in the Q6_K sweep's lane order (RowLoop.x_by_lane); k_dim a multiple
 * of 64. */
void baton_x_in_lane_order(const float *x, int64_t k_dim, float *out);

#endif
