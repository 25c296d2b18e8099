/* The gated MLP's activation, silu(gate) * up (gelu_tanh(gate) * up for Gemma's GeGLU), over
 * rows of [gate | up] (AVX2 + FMA).
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

#include "runtime/thread_pool.h"
#include "runtime/vector_math512.h"

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

/* act[i] = silu(gate[i]) * up[i] for i in [begin, end), 8 floats a vector, then one by one. */
static inline void silu_mul_span(const float *gate, const float *up, float *act, int64_t begin,
                                 int64_t end) {
    int64_t i = begin;
    for (; i + 8 <= end; i += 8)
        _mm256_storeu_ps(act + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(gate + i)),
                                                _mm256_loadu_ps(up + i)));
    for (; i < end; i++) act[i] = silu_mul_scalar(gate[i], up[i]);
}

/* The same from bf16 values, each result rounded to bf16. */
static inline void silu_mul_bf16_span(const uint16_t *gate, const uint16_t *up, uint16_t *act,
                                      int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 8 <= end; i += 8)
        _mm_storeu_si128((__m128i *)(act + i),
                         narrow_bf16(_mm256_mul_ps(silu8(widen_bf16(gate + i)),
                                                   widen_bf16(up + i))));
    for (; i < end; i++)
        act[i] = bf16_of(silu_mul_scalar(float_of_bf16(gate[i]), float_of_bf16(up[i])));
}

/* Each task: one slice of a row, 8 floats a vector (every AVX2 CPU) or 16 (WIDE) with the
 * 8-float span finishing it, so both widths end on the same scalar tail. */
static void silu_mul_task(const void *arg, int64_t task) {
    const ActivationLoop *a = arg;
    int64_t begin, end;
    const int64_t r = slice_of(a, task, &begin, &end), inter = a->inter;
    const float *gate = (const float *)a->gate_up + r * 2 * inter;
    silu_mul_span(gate, gate + inter, (float *)a->out + r * inter, begin, end);
}

static void silu_mul_bf16_task(const void *arg, int64_t task) {
    const ActivationLoop *a = arg;
    int64_t begin, end;
    const int64_t r = slice_of(a, task, &begin, &end), inter = a->inter;
    const uint16_t *gate = (const uint16_t *)a->gate_up + r * 2 * inter;
    silu_mul_bf16_span(gate, gate + inter, (uint16_t *)a->out + r * inter, begin, end);
}

WIDE static void silu_mul16_task(const void *arg, int64_t task) {
    const ActivationLoop *a = arg;
    int64_t begin, end;
    const int64_t r = slice_of(a, task, &begin, &end), inter = a->inter;
    const float *gate = (const float *)a->gate_up + r * 2 * inter, *up = gate + inter;
    float *act = (float *)a->out + r * inter;
    int64_t i = begin;
    for (; i + 16 <= end; i += 16)
        _mm512_storeu_ps(act + i, _mm512_mul_ps(silu16(_mm512_loadu_ps(gate + i)),
                                                _mm512_loadu_ps(up + i)));
    silu_mul_span(gate, up, act, i, end);
}

WIDE static void silu_mul16_bf16_task(const void *arg, int64_t task) {
    const ActivationLoop *a = arg;
    int64_t begin, end;
    const int64_t r = slice_of(a, task, &begin, &end), inter = a->inter;
    const uint16_t *gate = (const uint16_t *)a->gate_up + r * 2 * inter, *up = gate + inter;
    uint16_t *act = (uint16_t *)a->out + r * inter;
    int64_t i = begin;
    for (; i + 16 <= end; i += 16)
        _mm256_storeu_si256((__m256i *)(act + i),
                            narrow16_bf16(_mm512_mul_ps(silu16(widen16_bf16(gate + i)),
                                                        widen16_bf16(up + i))));
    silu_mul_bf16_span(gate, up, act, i, end);
}

/* out [rows, inter] = silu(gate) * up, gate_up [rows, 2 * inter] float32; avx512: 16 floats a
 * vector (the caller checked the CPU has AVX-512). */
void baton_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out,
                    int64_t avx512) {
    const ActivationLoop loop = {gate_up, out, inter, (inter + SLICE - 1) / SLICE};
    baton_parallel(avx512 ? silu_mul16_task : silu_mul_task, &loop, rows * loop.slices);
}

/* out [rows, inter] = bf16(silu(gate) * up), gate_up [rows, 2 * inter] bf16; avx512 as above. */
void baton_silu_mul_bf16(const uint16_t *gate_up, int64_t rows, int64_t inter, uint16_t *out,
                         int64_t avx512) {
    const ActivationLoop loop = {gate_up, out, inter, (inter + SLICE - 1) / SLICE};
    baton_parallel(avx512 ? silu_mul16_bf16_task : silu_mul_bf16_task, &loop,
                   rows * loop.slices);
}

static inline float gelu_tanh_mul_scalar(float gate, float up) {
    const float t = 1.5957691216f * (gate + 0.044715f * gate * gate * gate);
    return gate / (1.0f + expf(-t)) * up;
}

static void gelu_tanh_mul_task(const void *arg, int64_t task) {
    const ActivationLoop *a = arg;
    int64_t begin, end;
    const int64_t r = slice_of(a, task, &begin, &end);
    const float *gate = (const float *)a->gate_up + r * 2 * a->inter, *up = gate + a->inter;
    float *act = (float *)a->out + r * a->inter;
    int64_t i = begin;
    for (; i + 8 <= end; i += 8)
        _mm256_storeu_ps(act + i, _mm256_mul_ps(gelu_tanh8(_mm256_loadu_ps(gate + i)),
                                                _mm256_loadu_ps(up + i)));
    for (; i < end; i++) act[i] = gelu_tanh_mul_scalar(gate[i], up[i]);
}

/* out [rows, inter] = gelu_tanh(gate) * up, gate_up [rows, 2 * inter] float32 (Gemma's GeGLU:
 * the model's forward and the native decode step alike). */
void baton_gelu_tanh_mul(const float *gate_up, int64_t rows, int64_t inter, float *out) {
    const ActivationLoop loop = {gate_up, out, inter, (inter + SLICE - 1) / SLICE};
    baton_parallel(gelu_tanh_mul_task, &loop, rows * loop.slices);
}
