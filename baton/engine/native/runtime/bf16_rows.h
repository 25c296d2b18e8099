/* Float32 rows rounded to bf16 for the kernels that multiply bf16 weights in tile order on the
 * bf16 hardware (amx_gemm.c on AMX, bf16_dot_gemm.c with AVX512_BF16): the same rounding for
 * both, so a batch's rows are the same bf16 values whichever unit multiplies them. */
#ifndef BATON_BF16_ROWS_H
#define BATON_BF16_ROWS_H

#include <immintrin.h>
#include <stdint.h>

#include "runtime/thread_buffer.h"
#include "runtime/thread_pool.h"

#define BF16_ROWS_TARGET                                                                       \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))

/* Rows a task of bf16_rows_parallel rounds. */
#define BF16_ROWS_PER_TASK 32

/* Float32 rows to bf16, into `k_pad`-wide rows whose tail past k_dim is zero: one instruction
 * (AVX512_BF16's VCVTNEPS2BF16) rounds 16 to nearest even, as torch rounds, subnormals flushed
 * to zero, as AMX's tile unit takes its inputs anyway. */
BF16_ROWS_TARGET static inline void rows_to_bf16(const float *x, int64_t rows, int64_t k_dim,
                                                 int64_t k_pad, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *src = x + r * k_dim;
        uint16_t *dst = out + r * k_pad;
        for (int64_t i = 0; i < k_pad; i += 16) {
            const int64_t left = k_dim - i;
            const __mmask16 mask = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            _mm256_storeu_si256((__m256i *)(dst + i),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + i)));
        }
    }
}

typedef struct {
    const float *x;
    uint16_t *out;
    int64_t rows, k_dim, k_pad;
} Bf16RowsLoop;

BF16_ROWS_TARGET static void bf16_rows_task(const void *arg, int64_t task) {
    const Bf16RowsLoop *n = arg;
    const int64_t first = task * BF16_ROWS_PER_TASK;
    const int64_t rows = n->rows - first < BF16_ROWS_PER_TASK ? n->rows - first : BF16_ROWS_PER_TASK;
    rows_to_bf16(n->x + first * n->k_dim, rows, n->k_dim, n->k_pad, n->out + first * n->k_pad);
}

/* x [rows, k_dim] rounded into `buffer` (the calling site's own, grown as needed) as
 * [rows, k_pad] bf16, across the engine's threads; NULL if memory ran out. */
static inline const uint16_t *bf16_rows_parallel(ThreadBuffer *buffer, const float *x,
                                                 int64_t rows, int64_t k_dim, int64_t k_pad) {
    uint16_t *out = thread_buffer(buffer, rows * k_pad * 2);
    if (!out) return NULL;
    const Bf16RowsLoop loop = {x, out, rows, k_dim, k_pad};
    baton_parallel(bf16_rows_task, &loop, (rows + BF16_ROWS_PER_TASK - 1) / BF16_ROWS_PER_TASK);
    return out;
}

#endif
