/* The staged tiles' AVX-512 kernel for whole groups of 16 rows of x (staged_gemm.c): x packed
 * once per product as [group][k][16 rows], so that a vector holds one input of 16 rows, and
 * each stage weight is broadcast against it. A tile of 2 groups by the stage's 12 weight rows
 * keeps 24 sums in registers over a whole 256-input slice (12 broadcasts and 2 loads for 24
 * FMAs an input); the k-vectorised tiles, which rows not in a whole group keep, reload their
 * sums every 16 inputs and add each sum's 16 lanes at the end. */
#include <immintrin.h>
#include <stdint.h>

#include "runtime/thread_pool.h"
#include "staged_groups512.h"

#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

typedef struct {
    const float *x;
    float *packed;
    int64_t m_dim, k_dim;
} PackLoop;

/* Group `chunk` of x: 16 rows (those past x's last as zeros) transposed 16 inputs at a time,
 * in registers. */
WIDE static void pack_group(const void *arg, int64_t chunk) {
    const PackLoop *p = arg;
    const float *rows = p->x + chunk * GROUP_ROWS * p->k_dim;
    const int64_t held = p->m_dim - chunk * GROUP_ROWS; /* x's rows from the group's first */
    float *out = p->packed + chunk * GROUP_ROWS * p->k_dim;
    for (int64_t k = 0; k < p->k_dim; k += 16) {
        __m512 v[16], t[16];
        for (int r = 0; r < 16; r++)
            v[r] = r < held ? _mm512_loadu_ps(rows + r * p->k_dim + k) : _mm512_setzero_ps();
        /* 16 x 16 transpose: 2 x 2 blocks of floats, then of pairs, of 4 and of 8. */
        for (int r = 0; r < 16; r += 2) {
            t[r] = _mm512_unpacklo_ps(v[r], v[r + 1]);
            t[r + 1] = _mm512_unpackhi_ps(v[r], v[r + 1]);
        }
        for (int r = 0; r < 16; r += 4)
            for (int i = 0; i < 2; i++) {
                v[r + i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[r + i]),
                                                               _mm512_castps_pd(t[r + 2 + i])));
                v[r + 2 + i] = _mm512_castpd_ps(_mm512_unpackhi_pd(
                    _mm512_castps_pd(t[r + i]), _mm512_castps_pd(t[r + 2 + i])));
            }
        for (int r = 0; r < 16; r += 8)
            for (int i = 0; i < 4; i++) {
                t[r + i] = _mm512_shuffle_f32x4(v[r + i], v[r + 4 + i], 0x88);
                t[r + 4 + i] = _mm512_shuffle_f32x4(v[r + i], v[r + 4 + i], 0xDD);
            }
        for (int i = 0; i < 8; i++) {
            v[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
            v[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
        }
        /* v[i] holds input i of the 16 with its bits 0 and 1 swapped (the 64-bit unpacks put
         * inputs 1 and 2 of each 4 in each other's place). */
        for (int i = 0; i < 16; i++) {
            const int input = (i & ~3) | ((i & 1) << 1) | ((i >> 1) & 1);
            _mm512_storeu_ps(out + (k + input) * GROUP_ROWS, v[i]);
        }
    }
}

void baton_pack_groups512(const float *x, int64_t m_dim, int64_t groups, int64_t k_dim,
                          float *packed) {
    const PackLoop loop = {x, packed, m_dim, k_dim};
    baton_parallel(pack_group, &loop, groups);
}

/* sums[g][j] (16 rows' partial sums each) += the groups' inputs [0, len) times stage rows j,
 * for `groups` (1 or 2, a compile-time constant after inlining) of x and every stage row. */
WIDE static inline __attribute__((always_inline)) void group_tile(
    int groups, const float *packed, int64_t group_stride, const float *stage, int64_t stage_k,
    int64_t len, float *sums) {
    __m512 acc[2][GROUP_STAGE_FEATURES];
    for (int g = 0; g < groups; g++)
        for (int j = 0; j < GROUP_STAGE_FEATURES; j++)
            acc[g][j] = _mm512_load_ps(sums + (g * GROUP_STAGE_FEATURES + j) * GROUP_ROWS);
    for (int64_t k = 0; k < len; k++) {
        const __m512 x0 = _mm512_load_ps(packed + k * GROUP_ROWS);
        const __m512 x1 = groups > 1 ? _mm512_load_ps(packed + group_stride + k * GROUP_ROWS) : x0;
        for (int j = 0; j < GROUP_STAGE_FEATURES; j++) {
            const __m512 w = _mm512_set1_ps(stage[j * stage_k + k]);
            acc[0][j] = _mm512_fmadd_ps(x0, w, acc[0][j]);
            if (groups > 1) acc[1][j] = _mm512_fmadd_ps(x1, w, acc[1][j]);
        }
    }
    for (int g = 0; g < groups; g++)
        for (int j = 0; j < GROUP_STAGE_FEATURES; j++)
            _mm512_store_ps(sums + (g * GROUP_STAGE_FEATURES + j) * GROUP_ROWS, acc[g][j]);
}

WIDE void baton_group_tiles512(int64_t groups, const float *packed, int64_t k_dim,
                               const float *stage, int64_t stage_k, int64_t len, float *sums) {
    const int64_t stride = k_dim * GROUP_ROWS;
    if (groups == 2)
        group_tile(2, packed, stride, stage, stage_k, len, sums);
    else
        group_tile(1, packed, stride, stage, stage_k, len, sums);
}
