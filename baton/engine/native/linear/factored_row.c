/* One to three rows of x against a matrix of GGUF blocks, the sums factored by block: y[n] =
 * sum over blocks s of d_s * (x_s . q_s) + m_s * sum(x_s), where w = d_s * q + m_s is the stored
 * weight (Q4_K, Q5_K: m_s = -dmin * min; Q4_1: its m; Q4_0: -8 d; Q6_K: -32 d, and a d for each
 * half of a sub-block; Q8_0: none). The small integers q are exact in float32 and so are d_s
 * and m_s (gguf's own values, block_formats.h): only the order in which float32 rounds the sum
 * differs from multiplying the dequantized weights (tests/engine/native/test_compact_weights.py
 * bounds it as any float32 sum's). Decode steps of a few sequences are these products, and on
 * AMD EPYC Zen 3 (2 threads) the dequantize-then-multiply sweep (compact_gemv.c) spent its time
 * scaling each weight: at one row, Gemma 2 2B's Q4_K gate/up 16.6 -> 27 G weights/s (1.6x), a
 * 1B Llama's Q5_K 15 -> 19 and Q6_K 16 -> 20, the same in L3 or not; 1.15x at two rows and
 * 1.1x at three (Q4_K, Q5_K and Q6_K; the 32-weight blocks at one row only); from four rows,
 * where the rows share each dequantized weight, the sweep is as fast. With AVX-512, one row of
 * Q4_K or Q6_K (nearly every matrix of a Q4_K_M file) takes 16 floats a vector
 * (factored_row512.c).
 */
#include <immintrin.h>
#include <stdint.h>

#include "block_formats.h"
#include "factored_row.h"
#include "linear.h"
#include "row_sweeps.h"
#include "runtime/thread_buffer.h"
#include "runtime/thread_pool.h"
#include "runtime/vector_math.h"

#define MAX_ROWS 3

/* A sub-block's 32 quants as four vectors of 8 exact floats: Q4_K's 0..15 (w = d * q - m). */
static inline void ints_q4_k(const uint8_t *b, int sub, __m256 *q) {
    __m256i n[4];
    nibbles32_to_int32(b + 16 + 32 * (sub / 2), sub & 1, n);
    for (int j = 0; j < 4; j++) q[j] = _mm256_cvtepi32_ps(n[j]);
}

/* 32 bytes of a register, each 0..127, as four vectors of 8 exact floats, byte j in lane j % 8
 * of vector j / 8: each 128-bit half to both lanes, then an in-lane byte shuffle per 8 (as
 * bytes32_to_int32 does from memory). */
static inline void small_bytes_to_float(__m256i v, __m256 *q) {
    const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1,
                                           -1, 4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1,
                                           -1, -1);
    const __m256i second = _mm256_add_epi32(first, _mm256_set1_epi32(8));
    for (int half = 0; half < 2; half++) {
        const __m256i lane = _mm256_permute2x128_si256(v, v, half ? 0x11 : 0x00);
        q[2 * half] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lane, first));
        q[2 * half + 1] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lane, second));
    }
}

/* Q5_K's 0..31: the nibbles with the fifth bit (bit s of the 32 bytes after the scales). */
static inline void ints_q5_k(const uint8_t *b, int sub, __m256 *q) {
    const __m256i fifth = _mm256_slli_epi16(bit_of_bytes(b + 16, sub), 4);
    small_bytes_to_float(_mm256_or_si256(nibbles32(b + 48 + 32 * (sub / 2), sub & 1), fifth), q);
}

/* Q6_K's 0..63 (w = d * (q - 32), a d for each 16 quants: block_formats.h's dq_q6_k; the 32
 * goes with the sums of x, as a minimum would). */
static inline void ints_q6_k(const uint8_t *b, int sub, __m256 *q) {
    const int h = sub / 4, t = sub % 4;
    const __m256i low = nibbles32(b + 64 * h + 32 * (t % 2), t >= 2);
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(2 * t)),
                                          _mm256_set1_epi8(3));
    small_bytes_to_float(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), q);
}

/* The d of a sub-block's first and second 16 quants in SuperScales.dl: Q4_K and Q5_K have one
 * for all 32, Q6_K one each. */
#define ONE_SCALE(sub, half) (sub)
#define HALF_SCALES(sub, half) (2 * (sub) + (half))

/* The chunk of weight rows for one format: INTS its quants, PREPARE its super-block scales,
 * SCALE which d a half sub-block takes, MINS what it subtracts: 1, dmin * min * sum(x) by 32
 * (Q4_K, Q5_K); 2, 32 d * sum(x) by 16 (Q6_K). Two accumulators, a half sub-block each, so that
 * no FMA waits on the last one. */
#define DEFINE_ROW_CHUNK(FMT, INTS, SUPER_BYTES, PREPARE, SCALE, MINS)                           \
    static inline __attribute__((always_inline)) void row_sweep_##FMT(                          \
        const RowLoop *g, int64_t n_begin, int64_t n_end, int rows) {                           \
        const int64_t supers = g->k_dim / 256;                                                  \
        for (int64_t n = n_begin; n < n_end; n++) {                                             \
            const uint8_t *row = g->w + n * g->row_bytes;                                       \
            __m256 acc[MAX_ROWS][2], mins[MAX_ROWS];                                            \
            for (int r = 0; r < rows; r++)                                                      \
                acc[r][0] = acc[r][1] = mins[r] = _mm256_setzero_ps();                          \
            for (int64_t super = 0; super < supers; super++) {                                  \
                const uint8_t *block = row + super * (SUPER_BYTES);                             \
                _mm_prefetch((const char *)block + PREFETCH_AHEAD, _MM_HINT_T0);                \
                _mm_prefetch((const char *)block + PREFETCH_FAR, _MM_HINT_T1);                  \
                _mm_prefetch((const char *)block + 64 + PREFETCH_AHEAD, _MM_HINT_T0);           \
                _mm_prefetch((const char *)block + 128 + PREFETCH_AHEAD, _MM_HINT_T0);          \
                SuperScales scales;                                                             \
                PREPARE(block, &scales);                                                        \
                for (int r = 0; r < rows; r++) {                                                \
                    if ((MINS) == 1)                                                            \
                        mins[r] = _mm256_fmadd_ps(_mm256_loadu_ps(scales.ml),                   \
                            _mm256_loadu_ps(g->block_sums + r * (g->k_dim / 32) + super * 8), mins[r]); \
                    if ((MINS) == 2)                                                            \
                        for (int j = 0; j < 2; j++)                                             \
                            mins[r] = _mm256_fmadd_ps(_mm256_loadu_ps(scales.dl + 8 * j),       \
                                _mm256_loadu_ps(g->half_sums + r * (g->k_dim / 16) + super * 16 + 8 * j), mins[r]); \
                }                                                                               \
                _Pragma("GCC unroll 8") for (int sub = 0; sub < 8; sub++) {                     \
                    __m256 q[4];                                                                \
                    INTS(block, sub, q);                                                        \
                    for (int half = 0; half < 2; half++) {                                      \
                        const __m256 d = _mm256_broadcast_ss(scales.dl + SCALE(sub, half));     \
                        for (int r = 0; r < rows; r++) {                                        \
                            const float *xs = g->x + r * g->k_dim + (super * 8 + sub) * 32 + 16 * half; \
                            __m256 dot = _mm256_mul_ps(_mm256_loadu_ps(xs), q[2 * half]);       \
                            dot = _mm256_fmadd_ps(_mm256_loadu_ps(xs + 8), q[2 * half + 1], dot); \
                            acc[r][half] = _mm256_fmadd_ps(d, dot, acc[r][half]);               \
                        }                                                                       \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            const float add = g->bias ? g->bias[n] : 0.0f;                                      \
            for (int r = 0; r < rows; r++) {                                                    \
                const float offset = (MINS) == 2 ? 32.0f * hsum8(mins[r]) : hsum8(mins[r]);     \
                g->y[r * g->n_dim + n] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) - offset + add; \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    static void row_chunk_##FMT(const void *arg, int64_t chunk) {                               \
        const RowLoop *g = arg;                                                                 \
        const int64_t n_begin = chunk * g->rows_per_chunk;                                      \
        const int64_t n_end = n_begin + g->rows_per_chunk < g->n_dim ? n_begin + g->rows_per_chunk : g->n_dim; \
        switch (g->m_dim) {                                                                     \
        case 1: row_sweep_##FMT(g, n_begin, n_end, 1); break;                                   \
        case 2: row_sweep_##FMT(g, n_begin, n_end, 2); break;                                   \
        default: row_sweep_##FMT(g, n_begin, n_end, 3); break;                                  \
        }                                                                                       \
    }

/* A 32-weight block's quants as exact floats, its d and its m (w = d * q + m). */
static inline void ints_q8_0(const uint8_t *b, __m256 *q, float *d, float *m) {
    *d = block_f16(b);
    *m = 0.0f;
    for (int j = 0; j < 4; j++)
        q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j))));
}

/* Q4_0's w = d * (q - 8): the 8 goes with the block's sum of x (m = -8d, exact). */
static inline void ints_q4_0(const uint8_t *b, __m256 *q, float *d, float *m) {
    __m256i n[4];
    nibbles_to_int32(b + 2, n);
    for (int j = 0; j < 4; j++) q[j] = _mm256_cvtepi32_ps(n[j]);
    *d = block_f16(b);
    *m = -8.0f * *d;
}

static inline void ints_q4_1(const uint8_t *b, __m256 *q, float *d, float *m) {
    __m256i n[4];
    nibbles_to_int32(b + 4, n);
    for (int j = 0; j < 4; j++) q[j] = _mm256_cvtepi32_ps(n[j]);
    *d = block_f16(b);
    *m = block_f16(b + 2);
}

/* The chunk of weight rows for a format of 32-weight blocks (INTS), each with one d and m. */
#define DEFINE_BLOCK_ROW_CHUNK(FMT, INTS, BLOCK_BYTES)                                           \
    static void row_chunk_##FMT(const void *arg, int64_t chunk) {                               \
        const RowLoop *g = arg;                                                                 \
        const int64_t n_begin = chunk * g->rows_per_chunk;                                      \
        const int64_t n_end = n_begin + g->rows_per_chunk < g->n_dim ? n_begin + g->rows_per_chunk : g->n_dim; \
        const int64_t blocks = g->k_dim / 32;                                                   \
        for (int64_t n = n_begin; n < n_end; n++) {                                             \
            const uint8_t *row = g->w + n * g->row_bytes;                                       \
            __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                         \
            float offset = 0.0f;                                                                \
            for (int64_t blk = 0; blk < blocks; blk++) {                                        \
                const uint8_t *block = row + blk * (BLOCK_BYTES);                               \
                _mm_prefetch((const char *)block + PREFETCH_AHEAD, _MM_HINT_T0);                \
                _mm_prefetch((const char *)block + PREFETCH_FAR, _MM_HINT_T1);                  \
                const float *xs = g->x + blk * 32;                                              \
                __m256 q[4];                                                                    \
                float d, m;                                                                     \
                INTS(block, q, &d, &m);                                                         \
                const __m256 dv = _mm256_set1_ps(d);                                            \
                for (int half = 0; half < 2; half++) {                                          \
                    __m256 dot = _mm256_mul_ps(_mm256_loadu_ps(xs + 16 * half), q[2 * half]);   \
                    dot = _mm256_fmadd_ps(_mm256_loadu_ps(xs + 16 * half + 8), q[2 * half + 1], dot); \
                    acc[half] = _mm256_fmadd_ps(dv, dot, acc[half]);                            \
                }                                                                               \
                offset += m * g->block_sums[blk];                                               \
            }                                                                                   \
            const float add = g->bias ? g->bias[n] : 0.0f;                                      \
            g->y[n] = hsum8(_mm256_add_ps(acc[0], acc[1])) + offset + add;                      \
        }                                                                                       \
    }

DEFINE_BLOCK_ROW_CHUNK(q8_0, ints_q8_0, 34)
DEFINE_BLOCK_ROW_CHUNK(q4_0, ints_q4_0, 18)
DEFINE_BLOCK_ROW_CHUNK(q4_1, ints_q4_1, 20)
DEFINE_ROW_CHUNK(q4_k, ints_q4_k, 144, k_super_scales, ONE_SCALE, 1)
DEFINE_ROW_CHUNK(q5_k, ints_q5_k, 176, k_super_scales, ONE_SCALE, 1)
DEFINE_ROW_CHUNK(q6_k, ints_q6_k, 210, q6_k_super_scales, HALF_SCALES, 2)

/* y [m_dim, n_dim] = x [m_dim, k_dim] @ W^T (+ bias) for W in `fmt`, one row of Q4_K or Q6_K with
 * AVX-512 where `avx512` (the caller checked the CPU has it). Returns 0, 1 for rows or a format
 * this file does not cover (the caller sweeps them), or -2 if the sums of x could not be
 * allocated. */
int baton_factored_row(int fmt, int avx512, const float *x, int64_t m_dim, int64_t k_dim,
                       const uint8_t *w, int64_t n_dim, int64_t row_bytes, const float *bias,
                       float *y) {
    chunk_fn fn;
    if (m_dim < 1 || m_dim > MAX_ROWS || (m_dim > 1 && fmt != FMT_Q4_K && fmt != FMT_Q5_K && fmt != FMT_Q6_K))
        return 1;
    switch (fmt) {
    case FMT_Q8_0: fn = row_chunk_q8_0; break;
    case FMT_Q4_0: fn = row_chunk_q4_0; break;
    case FMT_Q4_1: fn = row_chunk_q4_1; break;
    case FMT_Q4_K: fn = avx512 && m_dim == 1 ? baton_factored_q4_k_row512 : row_chunk_q4_k; break;
    case FMT_Q5_K: fn = row_chunk_q5_k; break;
    case FMT_Q6_K: fn = avx512 && m_dim == 1 ? baton_factored_q6_k_row512 : row_chunk_q6_k; break;
    default: return 1;
    }
    /* Each 16 and each 32 of x summed once, for every weight row's m_s * sum(x_s). The engine
     * thread calls this for every layer of every step: its buffer stays. */
    static __thread ThreadBuffer sums_buffer;
    const int lane_order = fn == baton_factored_q6_k_row512;
    const int64_t per_row = k_dim / 32 + k_dim / 16 + (lane_order ? k_dim : 0);
    float *sums = thread_buffer(&sums_buffer, m_dim * per_row * (int64_t)sizeof(float));
    if (!sums) return -2;
    float *half_sums = sums + m_dim * (k_dim / 32);
    float *x_by_lane = lane_order ? half_sums + k_dim / 16 : 0;
    if (lane_order) baton_x_in_lane_order(x, k_dim, x_by_lane);
    for (int64_t b = 0; b < m_dim * (k_dim / 16); b++)
        half_sums[b] = hsum8(_mm256_add_ps(_mm256_loadu_ps(x + 16 * b), _mm256_loadu_ps(x + 16 * b + 8)));
    for (int64_t b = 0; b < m_dim * (k_dim / 32); b++) sums[b] = half_sums[2 * b] + half_sums[2 * b + 1];
    const int64_t chunk_rows = rows_per_chunk(n_dim);
    const RowLoop loop = {x, sums, half_sums, bias, x_by_lane, y, w, m_dim, k_dim, n_dim,
                          row_bytes, chunk_rows};
    baton_parallel(fn, &loop, (n_dim + chunk_rows - 1) / chunk_rows);
    return 0;
}
