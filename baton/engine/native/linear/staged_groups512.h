/* The staged tiles' AVX-512 kernel for whole groups of 16 rows of x (staged_groups512.c). */
#ifndef BATON_STAGED_GROUPS512_H
#define BATON_STAGED_GROUPS512_H

#include <stdint.h>

/* Rows of x a group holds: one input of each in a vector. */
#define GROUP_ROWS 16
/* Weight rows of the stage the group tile multiplies: staged_gemm.c's STAGE_FEATURES. */
#define GROUP_STAGE_FEATURES 12

/* packed [groups][k_dim][16] = x's first 16 * groups rows [.., k_dim] (rows past x's m_dim
 * zeros), k_dim a multiple of 16 (the thread pool's threads share the work). */
void baton_pack_groups512(const float *x, int64_t m_dim, int64_t groups, int64_t k_dim,
                          float *packed);
/* sums [groups][12][16] += packed groups (1 or 2, from input k0: `packed` points there) times
 * the 12 stage rows (`stage_k` apart) over inputs [0, len). */
void baton_group_tiles512(int64_t groups, const float *packed, int64_t k_dim,
                          const float *stage, int64_t stage_k, int64_t len, float *sums);

#endif
