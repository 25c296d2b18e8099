/* Small-batch matrix products over compact weights, computing in float32 (AVX2 + FMA + F16C).
 *
 * y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for a few rows m, where W is stored as bf16,
 * f16 (read 32 at a time) or one of GGUF's block formats (Q8_0, Q4_0, Q4_1: 32 weights per block sharing an f16
 * scale). Each weight is dequantized to exactly the float32 value the float32 weights hold (bf16
 * and f16 widen exactly; d * q is exact in float32, and Q4_1's d * q + m is one FMA: the same
 * single rounding as gguf's `d * q + m`), so the result differs from a float32 GEMM only in the
 * order of the sum. A decode step reads every weight once per step: reading 2-6x fewer bytes
 * than float32 is the whole point. From two rows, with AVX-512, the sweeps 16 floats a vector
 * take the formats that have them (wide_sweeps512.c); from STAGED_MIN_ROWS rows the staged
 * kernel takes the rest (staged_gemm.c), with these row dequantizers; up to three rows of the
 * common GGUF block formats go to factored_row.c, which factors the sums by block.
 *
 * Rows of W are split into chunks that the engine's threads claim (thread_pool.c). Loading a
 * checkpoint dequantizes with OpenMP: the library is loaded after torch, so its libgomp is
 * torch's own (same soname) and the team is the engine's.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "block_formats.h"
#include "gemv_loop.h"
#include "linear.h"
#include "row_sweeps.h"
#include "runtime/thread_buffer.h"
#include "runtime/thread_pool.h"
#include "runtime/vector_math.h"

/* Rows of x per sweep over W: each sweep dequantizes every weight once, so more rows per sweep
 * amortize it further; 8 accumulators + 4 weight vectors still fit the 16 ymm registers
 * (measured 1.5x faster than 4 at 8-16 rows of Q4_1, equal at 1-4). */
#define ROWS_PER_PASS 8
/* Rows from which the staged kernel (staged_gemm.c) takes a product the 8-float sweeps would:
 * below, its stage's dequantization costs more than it saves. The 1B Llama shape's four layer
 * matrices on AMD EPYC Zen 3 (2 threads), staged / sweeps: 1.4-1.8x the time at 2 rows, 1.2-1.4x
 * at 4, 0.9-1.2x at 6, 0.80-0.99x at 8 (Q6_K the last), 0.67-0.78x at 16, 0.60-0.66x at 32. */
#define STAGED_MIN_ROWS 8


static inline float f16_scalar(const uint8_t *p) { return _cvtsh_ss(*(const uint16_t *)p); }

/* Each dequantizer turns one block of 32 weights into four vectors of 8 float32 weights. */
static inline void dq_bf16(const uint8_t *b, int sub, const SuperScales *ss, __m256 *w) {
    (void)sub;
    (void)ss;
    for (int j = 0; j < 4; j++) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + 16 * j)));
        w[j] = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
}

static inline void dq_f16(const uint8_t *b, int sub, const SuperScales *ss, __m256 *w) {
    (void)sub;
    (void)ss;
    for (int j = 0; j < 4; j++) w[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * j)));
}

static inline void dq_q8_0(const uint8_t *b, int sub, const SuperScales *ss, __m256 *w) {
    (void)sub;
    (void)ss;
    __m256 d = _mm256_set1_ps(f16_scalar(b));
    for (int j = 0; j < 4; j++) {
        __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j));
        w[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
}

static inline void dq_q4_0(const uint8_t *b, int sub, const SuperScales *ss, __m256 *w) {
    (void)sub;
    (void)ss;
    __m256 d = _mm256_set1_ps(f16_scalar(b));
    __m256 eight = _mm256_set1_ps(8.0f);
    __m256i q[4];
    nibbles_to_int32(b + 2, q);
    for (int j = 0; j < 4; j++) w[j] = _mm256_mul_ps(d, _mm256_sub_ps(_mm256_cvtepi32_ps(q[j]), eight));
}

static inline void dq_q4_1(const uint8_t *b, int sub, const SuperScales *ss, __m256 *w) {
    (void)sub;
    (void)ss;
    /* d and m are adjacent f16s: one conversion for both. */
    __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)b));
    __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    __m256i q[4];
    nibbles_to_int32(b + 4, q);
    for (int j = 0; j < 4; j++) w[j] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[j]), m);
}

/* Weight rows [n_begin, n_end) against `rows` (a compile-time constant after inlining) rows of
 * x, y[r, n] = x[r] . W[n] (+ bias[n]). A row of x gets 4 / rows accumulators, so at least four
 * FMA chains run at once: one chain would wait out the FMA latency on every vector (measured
 * 2.5x slower at one row). The loop over weight rows is inside the specialised copy: a SmolLM2
 * weight row is only 18 blocks, and dispatching on `rows` per weight row cost 12 % at one row. */
#define DEFINE_SWEEP(FMT, DEQUANT, SUPER_BYTES, SUBS, PREPARE)                                   \
    static inline __attribute__((always_inline)) void sweep_##FMT(                              \
        const float *x, int64_t k_dim, const uint8_t *w, int64_t row_bytes, int64_t n_begin,    \
        int64_t n_end, int64_t n_dim, int rows, const float *bias, float *y) {                  \
        const int chains = rows >= 4 ? 1 : 4 / rows;                                            \
        const int64_t blocks = k_dim / 32;                                                      \
        for (int64_t n = n_begin; n < n_end; n++) {                                             \
            const uint8_t *row = w + n * row_bytes;                                             \
            __m256 acc[ROWS_PER_PASS];                                                          \
            for (int a = 0; a < ROWS_PER_PASS; a++) acc[a] = _mm256_setzero_ps();               \
            for (int64_t super = 0; super < blocks / (SUBS); super++) {                         \
                const uint8_t *block = row + super * (SUPER_BYTES);                             \
                _mm_prefetch((const char *)block + PREFETCH_AHEAD, _MM_HINT_T0);                \
                _mm_prefetch((const char *)block + PREFETCH_FAR, _MM_HINT_T1);                  \
                if ((SUPER_BYTES) > 64) { /* the super-block's other lines */                    \
                    _mm_prefetch((const char *)block + 64 + PREFETCH_AHEAD, _MM_HINT_T0);       \
                    _mm_prefetch((const char *)block + 128 + PREFETCH_AHEAD, _MM_HINT_T0);      \
                }                                                                               \
                SuperScales scales;                                                             \
                PREPARE(block, &scales);                                                        \
                /* Unrolled: each sub-block at constant offsets and lanes. */                   \
                _Pragma("GCC unroll 8") for (int sub = 0; sub < (SUBS); sub++) {                \
                const int64_t blk = super * (SUBS) + sub;                                       \
                __m256 w8[4];                                                                   \
                DEQUANT(block, sub, &scales, w8);                                               \
                for (int j = 0; j < 4; j++) {                                                   \
                    const float *xk = x + blk * 32 + 8 * j;                                     \
                    for (int r = 0; r < rows; r++) {                                            \
                        int a = r * chains + j % chains;                                        \
                        acc[a] = _mm256_fmadd_ps(_mm256_loadu_ps(xk + r * k_dim), w8[j], acc[a]); \
                    }                                                                           \
                }                                                                               \
                }                                                                               \
            }                                                                                   \
            const float add = bias ? bias[n] : 0.0f;                                            \
            for (int r = 0; r < rows; r++) {                                                    \
                __m256 sum = acc[r * chains];                                                   \
                for (int c = 1; c < chains; c++) sum = _mm256_add_ps(sum, acc[r * chains + c]); \
                y[r * n_dim + n] = hsum8(sum) + add;                                            \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    DEFINE_CHUNK(gemv_chunk_##FMT, sweep_##FMT, , ROWS_PER_PASS, SWEEP_ROWS_1_7)

/* The whole matrix as float32 [n_dim, k_dim], the same exact values: what loading a checkpoint
 * needs (gguf's numpy dequantization takes seconds for a 135M-parameter model). */
#define DEFINE_DEQUANTIZE(FMT, DEQUANT, SUPER_BYTES, SUBS, PREPARE)                              \
    static void dequantize_row_##FMT(const uint8_t *row, int64_t k_dim, float *dst) {          \
        for (int64_t super = 0; super < k_dim / 32 / (SUBS); super++) {                         \
            const uint8_t *block = row + super * (SUPER_BYTES);                                 \
            SuperScales scales;                                                                 \
            PREPARE(block, &scales);                                                            \
            _Pragma("GCC unroll 8") for (int sub = 0; sub < (SUBS); sub++) {                    \
                __m256 v[4];                                                                    \
                DEQUANT(block, sub, &scales, v);                                                \
                float *out = dst + (super * (SUBS) + sub) * 32;                                 \
                for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + 8 * j, v[j]);                \
            }                                                                                   \
        }                                                                                       \
    }

/* Each format: its sweeps (8 and 16 floats a vector) and its row dequantizer. A super-block of
 * SUBS blocks of 32 weights takes SUPER_BYTES; the blocks of 32 are what every loop steps by. */
#define DEFINE_FORMAT(FMT, DEQUANT, SUPER_BYTES, SUBS, PREPARE)                                  \
    DEFINE_SWEEP(FMT, DEQUANT, SUPER_BYTES, SUBS, PREPARE)                                      \
    DEFINE_DEQUANTIZE(FMT, DEQUANT, SUPER_BYTES, SUBS, PREPARE)

DEFINE_FORMAT(bf16, dq_bf16, 64, 1, no_super_scales)
DEFINE_FORMAT(f16, dq_f16, 64, 1, no_super_scales)
DEFINE_FORMAT(q8_0, dq_q8_0, 34, 1, no_super_scales)
DEFINE_FORMAT(q4_0, dq_q4_0, 18, 1, no_super_scales)
DEFINE_FORMAT(q4_1, dq_q4_1, 20, 1, no_super_scales)
DEFINE_FORMAT(q4_k, dq_q4_k, 144, 8, k_super_scales)
DEFINE_FORMAT(q5_k, dq_q5_k, 176, 8, k_super_scales)
DEFINE_FORMAT(q6_k, dq_q6_k, 210, 8, q6_k_super_scales)
DEFINE_FORMAT(q3_k, dq_q3_k, 110, 8, no_super_scales)
DEFINE_FORMAT(q2_k, dq_q2_k, 84, 8, no_super_scales)
DEFINE_FORMAT(iq4_nl, dq_iq4_nl, 18, 1, no_super_scales)
DEFINE_FORMAT(iq4_xs, dq_iq4_xs, 136, 8, no_super_scales)
DEFINE_FORMAT(q5_0, dq_q5_0, 22, 1, no_super_scales)
DEFINE_FORMAT(q5_1, dq_q5_1, 24, 1, no_super_scales)

static row_dequantizer row_dequantizers(int fmt, int avx512);

/* y [m_dim, n_dim] = x [m_dim, k_dim] @ W^T (+ bias), 16 floats a vector where `avx512` (the
 * caller checked the CPU has it) and the format has such a sweep for this many rows
 * (wide_sweeps512.c), else 8. Returns 0, -1 for an unknown format, or -2 if the packed rows
 * could not be allocated. The caller guarantees contiguous float32 x and y, and k_dim a
 * multiple of 32 (one block). */
int baton_compact_gemv(int fmt, int avx512, const float *x, int64_t m_dim, int64_t k_dim,
                       const uint8_t *w, int64_t n_dim, int64_t row_bytes, const float *bias,
                       float *y) {
    static const chunk_fn chunk_fns[FMT_COUNT] = {
        gemv_chunk_bf16, gemv_chunk_f16, gemv_chunk_q8_0, gemv_chunk_q4_0, gemv_chunk_q4_1,
        gemv_chunk_q4_k, gemv_chunk_q5_k, gemv_chunk_q6_k, gemv_chunk_q3_k, gemv_chunk_q2_k,
        gemv_chunk_iq4_nl, gemv_chunk_iq4_xs, gemv_chunk_q5_0, gemv_chunk_q5_1};
    if (fmt < 0 || fmt >= FMT_COUNT) return -1;
    const chunk_fn wide = avx512 && m_dim >= 2 ? baton_wide_sweep(fmt, m_dim, k_dim) : 0;
    if (!wide && m_dim <= 3) { /* (a few rows of blocks: sums factored, factored_row.c) */
        const int factored =
            baton_factored_row(fmt, avx512, x, m_dim, k_dim, w, n_dim, row_bytes, bias, y);
        if (factored <= 0) return factored;
    }
    if (!wide && m_dim >= STAGED_MIN_ROWS) {
        baton_staged_gemm(row_dequantizers(fmt, avx512), avx512, x, m_dim, k_dim, w, n_dim, row_bytes,
                          bias, y);
        return 0;
    }
    int64_t rows_per_pass = ROWS_PER_PASS;
    if (wide) {
        if (WIDE_ROWS_PER_PASS * k_dim * (int64_t)sizeof(float) <= WIDE_PASS_BYTES)
            rows_per_pass = WIDE_ROWS_PER_PASS;
        /* The engine thread calls this for every layer of every step: its buffer stays. */
        static __thread ThreadBuffer packed_buffer;
        float *packed = thread_buffer(&packed_buffer, m_dim * k_dim * (int64_t)sizeof(float));
        if (!packed) return -2;
        baton_pack_rows(x, m_dim, k_dim, rows_per_pass, packed);
        x = packed;
    }
    const int64_t chunk_rows = rows_per_chunk(n_dim);
    const GemvLoop loop = {x, bias, y, w, m_dim, k_dim, n_dim, row_bytes, chunk_rows, rows_per_pass};
    baton_parallel(wide ? wide : chunk_fns[fmt], &loop, (n_dim + chunk_rows - 1) / chunk_rows);
    return 0;
}

/* The format's row dequantizer: the AVX-512 one where `avx512` and it has one. */
static row_dequantizer row_dequantizers(int fmt, int avx512) {
    const row_dequantizer wide = avx512 ? baton_row_dequantizer512(fmt) : 0;
    if (wide) return wide;
    static const row_dequantizer by_format[FMT_COUNT] = {
        dequantize_row_bf16, dequantize_row_f16,  dequantize_row_q8_0,   dequantize_row_q4_0,
        dequantize_row_q4_1, dequantize_row_q4_k, dequantize_row_q5_k,   dequantize_row_q6_k,
        dequantize_row_q3_k, dequantize_row_q2_k, dequantize_row_iq4_nl, dequantize_row_iq4_xs,
        dequantize_row_q5_0, dequantize_row_q5_1};
    return fmt >= 0 && fmt < FMT_COUNT ? by_format[fmt] : 0;
}

/* out [n_dim, k_dim] = W as float32, with AVX-512 where `avx512` (the caller checked the CPU
 * has it). Returns 0, or -1 for an unknown format. */
int baton_dequantize(int fmt, int avx512, const uint8_t *w, int64_t n_dim, int64_t k_dim,
                     int64_t row_bytes, float *out) {
    const row_dequantizer row = row_dequantizers(fmt, avx512);
    if (!row) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_dim; n++) row(w + n * row_bytes, k_dim, out + n * k_dim);
    return 0;
}

/* out [count, k_dim] = rows ids[0..count) of W as float32: an embedding's lookups (AVX-512 as
 * for baton_dequantize). Returns 0, or -1 for an unknown format (the caller checked the ids). */
int baton_dequantize_rows(int fmt, int avx512, const uint8_t *w, int64_t k_dim,
                          int64_t row_bytes, const int64_t *ids, int64_t count, float *out) {
    const row_dequantizer row = row_dequantizers(fmt, avx512);
    if (!row) return -1;
    /* A decode step's few rows take microseconds: a thread team would cost more. */
#pragma omp parallel for schedule(static) if (count >= 64)
    for (int64_t i = 0; i < count; i++) row(w + ids[i] * row_bytes, k_dim, out + i * k_dim);
    return 0;
}
