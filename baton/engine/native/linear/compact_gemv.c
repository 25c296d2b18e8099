/* Small-batch matrix products over compact weights, computing in float32 (AVX2 + FMA + F16C).
 *
 * y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for a few rows m, where W is stored as bf16,
 * f16 (read 32 at a time) or one of GGUF's block formats (Q8_0, Q4_0, Q4_1: 32 weights per block sharing an f16
 * scale). Each weight is dequantized to exactly the float32 value the float32 weights hold (bf16
 * and f16 widen exactly; d * q is exact in float32, and Q4_1's d * q + m is one FMA: the same
 * single rounding as gguf's `d * q + m`), so the result differs from a float32 GEMM only in the
 * order of the sum. A decode step reads every weight once per step: reading 2-6x fewer bytes
 * than float32 is the whole point. From STAGED_MIN_ROWS rows (without AVX-512's wide sweeps)
 * the staged kernel takes the product instead (staged_gemm.c), with these row dequantizers; up to
 * three rows of the common GGUF block formats go to factored_row.c, which factors the sums by
 * block.
 *
 * Rows of W are split into chunks that the engine's threads claim (thread_pool.c). Loading a
 * checkpoint dequantizes with OpenMP: the library is loaded after torch, so its libgomp is
 * torch's own (same soname) and the team is the engine's.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "block_formats.h"
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

/* The same sweeps 16 floats a vector, for CPUs with AVX-512 (the engine asks for them where its
 * plan's ISA allows: --max-cpu-isa, torch's and oneDNN's caps), from two rows: half the
 * instructions per weight. SmolLM2's Q4_1 layers on the AMX Xeon (2 threads): 1.13x faster at 2
 * rows, 1.25x at 16 and 32; no faster at one row, which reads the bytes (0.9x: it keeps 8). Each
 * block dequantizes to the same float32 weights as above, in two vectors of 16. */
#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

WIDE static inline void dq16_bf16(const uint8_t *b, int sub, const SuperScales *ss, __m512 *w) {
    (void)sub;
    (void)ss;
    for (int j = 0; j < 2; j++) {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 32 * j)));
        w[j] = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
}

WIDE static inline void dq16_f16(const uint8_t *b, int sub, const SuperScales *ss, __m512 *w) {
    (void)sub;
    (void)ss;
    for (int j = 0; j < 2; j++) w[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32 * j)));
}

WIDE static inline void dq16_q8_0(const uint8_t *b, int sub, const SuperScales *ss, __m512 *w) {
    (void)sub;
    (void)ss;
    const __m512 d = _mm512_set1_ps(f16_scalar(b));
    for (int j = 0; j < 2; j++) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + 16 * j));
        w[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
    }
}

/* Weights 0-15 are the 16 bytes' low nibbles, weights 16-31 their high ones. */
WIDE static inline void nibbles16_to_float(const uint8_t *qs, __m512 *q) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0F);
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
}

WIDE static inline void dq16_q4_0(const uint8_t *b, int sub, const SuperScales *ss, __m512 *w) {
    (void)sub;
    (void)ss;
    const __m512 d = _mm512_set1_ps(f16_scalar(b)), eight = _mm512_set1_ps(8.0f);
    __m512 q[2];
    nibbles16_to_float(b + 2, q);
    for (int j = 0; j < 2; j++) w[j] = _mm512_mul_ps(d, _mm512_sub_ps(q[j], eight));
}

WIDE static inline void dq16_q4_1(const uint8_t *b, int sub, const SuperScales *ss, __m512 *w) {
    (void)sub;
    (void)ss;
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)b));
    const __m512 d = _mm512_broadcastss_ps(dm), m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
    __m512 q[2];
    nibbles16_to_float(b + 4, q);
    for (int j = 0; j < 2; j++) w[j] = _mm512_fmadd_ps(d, q[j], m);
}

/* Rows of x per sweep of the AVX-512 kernel: its 32 registers hold 16 accumulators, two weight
 * vectors and the dequantizer's constants, so each block is dequantized once per 16 rows, not
 * per 8 (where the AVX2 kernel's 16 registers stop), and a 16-row batch reads W once: SmolLM2's
 * Q4_1 layers 8-9 % faster at 16 and 32 rows. Only where 16 rows stay in L1 (48 KB here) beside
 * the weights streaming past (WIDE_PASS_BYTES); longer rows keep 8 a pass: 16 rows of
 * SmolLM2's 1536-long ones, read from L2, ran 25 % slower, and splitting each weight row into
 * spans that fit made the 0.5B shape's bf16 layers 2-4 % slower than 8 a pass. */
#define WIDE_ROWS_PER_PASS 16
#define WIDE_PASS_BYTES (40 * 1024)

/* sums[r] = the sum of acc[r]'s 16 lanes, for r < 16, in one vector: three rounds of in-lane
 * and cross-lane shuffles sum all 16 at once (about 45 instructions, against 16 horizontal sums
 * of about 8 each, most of them on the shuffle port the FMAs share). */
WIDE static inline __m512 lane_sums16(const __m512 *acc) {
    __m512 quads[4]; /* quads[g], 128-bit lane L: rows 4g..4g+3's sums over acc's lane L */
    for (int g = 0; g < 4; g++) {
        const __m512 *a = acc + 4 * g;
        const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
        const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
        quads[g] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    }
    /* Lanes 0+1 and 2+3 of each quad, then those two halves: lane g of the result holds rows
     * 4g..4g+3, so element r is row r. */
    const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(q01, q23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* x's rows as the AVX-512 sweep reads them: each pass of rows_per_pass rows (the last one may
 * have fewer) at the same offset as in x, m0 * k_dim, but block by block: a block's 32
 * floats of the pass's first row, then its second row's, ... So every load is one pointer plus
 * a constant: with a pointer per row, 16 rows ran out of general registers and the compiler
 * reloaded them from the stack, about 28 instructions a block. */
WIDE static void pack_rows(const float *x, int64_t m_dim, int64_t k_dim, int64_t rows_per_pass,
                           float *packed) {
    for (int64_t m0 = 0; m0 < m_dim; m0 += rows_per_pass) {
        const int64_t rows = m_dim - m0 < rows_per_pass ? m_dim - m0 : rows_per_pass;
        float *dst = packed + m0 * k_dim;
        for (int64_t blk = 0; blk < k_dim / 32; blk++)
            for (int64_t r = 0; r < rows; r++, dst += 32) {
                const float *src = x + (m0 + r) * k_dim + blk * 32;
                _mm512_storeu_ps(dst, _mm512_loadu_ps(src));
                _mm512_storeu_ps(dst + 16, _mm512_loadu_ps(src + 16));
            }
    }
}

/* As DEFINE_SWEEP, 16 floats a vector and up to WIDE_ROWS_PER_PASS rows of x packed by
 * pack_rows; at least four FMA chains at any number of rows. From 12 rows the rows' sums are
 * taken together (lane_sums16; below, one horizontal sum a row measured as fast). */
#define DEFINE_WIDE_SWEEP(FMT, DEQUANT, SUPER_BYTES, SUBS, PREPARE)                              \
    WIDE static inline __attribute__((always_inline)) void sweep16_##FMT(                        \
        const float *x, int64_t k_dim, const uint8_t *w, int64_t row_bytes, int64_t n_begin,    \
        int64_t n_end, int64_t n_dim, int rows, const float *bias, float *y) {                  \
        const int chains = rows >= 4 ? 1 : 4 / rows;                                            \
        const int64_t blocks = k_dim / 32;                                                      \
        for (int64_t n = n_begin; n < n_end; n++) {                                             \
            const uint8_t *row = w + n * row_bytes;                                             \
            __m512 acc[WIDE_ROWS_PER_PASS];                                                     \
            for (int a = 0; a < WIDE_ROWS_PER_PASS; a++) acc[a] = _mm512_setzero_ps();          \
            for (int64_t blk = 0; blk < blocks; blk++) {                                        \
                __m512 w16[2];                                                                  \
                _mm_prefetch((const char *)row + blk * (SUPER_BYTES) / (SUBS) + PREFETCH_AHEAD, \
                             _MM_HINT_T0);                                                      \
                _mm_prefetch((const char *)row + blk * (SUPER_BYTES) / (SUBS) + PREFETCH_FAR,   \
                             _MM_HINT_T1);                                                      \
                SuperScales scales;                                                             \
                PREPARE(row + blk / (SUBS) * (SUPER_BYTES), &scales);                           \
                DEQUANT(row + blk / (SUBS) * (SUPER_BYTES), (int)(blk % (SUBS)), &scales, w16); \
                const float *xb = x + blk * rows * 32; /* pack_rows: the block's rows in turn */ \
                for (int j = 0; j < 2; j++) {                                                   \
                    for (int r = 0; r < rows; r++) {                                            \
                        int a = r * chains + (2 * (int)(blk & 1) + j) % chains;                 \
                        acc[a] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 32 * r + 16 * j), w16[j], acc[a]); \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            float sums[WIDE_ROWS_PER_PASS];                                                     \
            if (rows >= 12) {                                                                   \
                _mm512_storeu_ps(sums, lane_sums16(acc));                                       \
            } else {                                                                            \
                for (int r = 0; r < rows; r++) {                                                \
                    __m512 sum = acc[r * chains];                                               \
                    for (int c = 1; c < chains; c++) sum = _mm512_add_ps(sum, acc[r * chains + c]); \
                    sums[r] = _mm512_reduce_add_ps(sum);                                        \
                }                                                                               \
            }                                                                                   \
            const float add = bias ? bias[n] : 0.0f;                                            \
            for (int r = 0; r < rows; r++) y[r * n_dim + n] = sums[r] + add;                    \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    DEFINE_CHUNK(gemv16_chunk_##FMT, sweep16_##FMT, WIDE, WIDE_ROWS_PER_PASS, SWEEP_ROWS_1_15)

DEFINE_WIDE_SWEEP(bf16, dq16_bf16, 64, 1, no_super_scales)
DEFINE_WIDE_SWEEP(f16, dq16_f16, 64, 1, no_super_scales)
DEFINE_WIDE_SWEEP(q8_0, dq16_q8_0, 34, 1, no_super_scales)
DEFINE_WIDE_SWEEP(q4_0, dq16_q4_0, 18, 1, no_super_scales)
DEFINE_WIDE_SWEEP(q4_1, dq16_q4_1, 20, 1, no_super_scales)

static row_dequantizer row_dequantizers(int fmt, int avx512);

/* y [m_dim, n_dim] = x [m_dim, k_dim] @ W^T (+ bias), 16 floats a vector where `avx512` (the
 * caller checked the CPU has it) and there are two rows or more, else 8. Returns 0, -1 for an
 * unknown format, or -2 if the packed rows could not be allocated. The caller guarantees
 * contiguous float32 x and y, and k_dim a multiple of 32 (one block). */
int baton_compact_gemv(int fmt, int avx512, const float *x, int64_t m_dim, int64_t k_dim,
                       const uint8_t *w, int64_t n_dim, int64_t row_bytes, const float *bias,
                       float *y) {
    /* [avx512][FMT_*]: the formats of block_formats.h have 8-float sweeps only (16-float ones
     * doubled the library's compile time, for a gain no AVX-512 machine has measured). */
    static const chunk_fn chunk_fns[][FMT_COUNT] = {
        {gemv_chunk_bf16, gemv_chunk_f16, gemv_chunk_q8_0, gemv_chunk_q4_0, gemv_chunk_q4_1,
         gemv_chunk_q4_k, gemv_chunk_q5_k, gemv_chunk_q6_k, gemv_chunk_q3_k, gemv_chunk_q2_k,
         gemv_chunk_iq4_nl, gemv_chunk_iq4_xs, gemv_chunk_q5_0, gemv_chunk_q5_1},
        {gemv16_chunk_bf16, gemv16_chunk_f16, gemv16_chunk_q8_0, gemv16_chunk_q4_0,
         gemv16_chunk_q4_1}};
    if (fmt < 0 || fmt >= FMT_COUNT) return -1;
    const int wide = avx512 && m_dim >= 2 && fmt <= FMT_Q4_1;
    if (m_dim <= 3) { /* (a few rows of blocks: sums factored, factored_row.c) */
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
        pack_rows(x, m_dim, k_dim, rows_per_pass, packed);
        x = packed;
    }
    const int64_t chunk_rows = rows_per_chunk(n_dim);
    const GemvLoop loop = {x, bias, y, w, m_dim, k_dim, n_dim, row_bytes, chunk_rows, rows_per_pass};
    baton_parallel(chunk_fns[wide][fmt], &loop, (n_dim + chunk_rows - 1) / chunk_rows);
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
