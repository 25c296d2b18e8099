/* The gated MLP's activation, silu(gate) * up, over rows of [gate | up] (AVX2 + FMA).
 *
 * One float32 formula for every path: the native decode step's float32 rows, and a prefill's
 * bf16 GEMM rows (ComputePlan.gemm_dtype), which stay bf16 from the gate/up product to the
 * down product: read as bf16, computed in float32, rounded once to bf16 as torch rounds, where
 * torch's ops would widen the whole [rows, 2 * intermediate] product to float32 in memory and
 * narrow the result back (a fifth of a 0.5B prefill's time).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "thread_pool.h"
#include "vector_math.h"

static inline float silu_mul_scalar(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

/* One task: a slice of SLICE values of one row (the threads share a row's slices, so one
 * decode row is spread over them too). */
#define SLICE 1024

typedef struct {
    const void *gate_up;
    void *out;
    int64_t inter, slices;
} ActivationLoop;

/* Task `task`'s row, and its slice [*begin, *end) of the row's values. */
static inline int64_t slice_of(const ActivationLoop *a, int64_t task, int64_t *begin,
                               int64_t *end) {
    *begin = task % a->slices * SLICE;
    *end = *begin + SLICE < a->inter ? *begin + SLICE : a->inter;
    return task / a->slices;
}

static void silu_mul_task(const void *arg, int64_t task) {
    const ActivationLoop *a = arg;
    int64_t begin, end;
    const int64_t r = slice_of(a, task, &begin, &end), inter = a->inter;
    const float *gate = (const float *)a->gate_up + r * 2 * inter, *up = gate + inter;
    float *act = (float *)a->out + r * inter;
    int64_t i = begin;
    for (; i + 8 <= end; i += 8)
        _mm256_storeu_ps(act + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(gate + i)),
                                                _mm256_loadu_ps(up + i)));
    for (; i < end; i++) act[i] = silu_mul_scalar(gate[i], up[i]);
}

static void silu_mul_bf16_task(const void *arg, int64_t task) {
    const ActivationLoop *a = arg;
    int64_t begin, end;
    const int64_t r = slice_of(a, task, &begin, &end), inter = a->inter;
    const uint16_t *gate = (const uint16_t *)a->gate_up + r * 2 * inter, *up = gate + inter;
    uint16_t *act = (uint16_t *)a->out + r * inter;
    int64_t i = begin;
    for (; i + 8 <= end; i += 8)
        _mm_storeu_si128((__m128i *)(act + i),
                         narrow_bf16(_mm256_mul_ps(silu8(widen_bf16(gate + i)),
                                                   widen_bf16(up + i))));
    for (; i < end; i++)
        act[i] = bf16_of(silu_mul_scalar(float_of_bf16(gate[i]), float_of_bf16(up[i])));
}

/* out [rows, inter] = silu(gate) * up, gate_up [rows, 2 * inter] float32. */
void baton_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out) {
    const ActivationLoop loop = {gate_up, out, inter, (inter + SLICE - 1) / SLICE};
    baton_parallel(silu_mul_task, &loop, rows * loop.slices);
}

/* out [rows, inter] = bf16(silu(gate) * up), gate_up [rows, 2 * inter] bf16. */
void baton_silu_mul_bf16(const uint16_t *gate_up, int64_t rows, int64_t inter, uint16_t *out) {
    const ActivationLoop loop = {gate_up, out, inter, (inter + SLICE - 1) / SLICE};
    baton_parallel(silu_mul_bf16_task, &loop, rows * loop.slices);
}
