/* The sweeps of compact_gemv.c 16 floats a vector, for CPUs with AVX-512 (the engine asks for
 * them where its plan's ISA allows: --max-cpu-isa, torch's and oneDNN's caps), from two rows:
 * half the instructions per weight. SmolLM2's Q4_1 layers on the AMX Xeon (2 threads): 1.13x
 * faster at 2 rows, 1.25x at 16 and 32; no faster at one row, which reads the bytes (0.9x: it
 * keeps 8). Each block dequantizes to the same float32 weights as the 8-float dequantizers, in
 * two vectors of 16; Q4_K and Q6_K, half a super-block at a time (kquant_halves512.h).
 */
#include <immintrin.h>
#include <stdint.h>

#include "block_formats.h"
#include "gemv_loop.h"
#include "kquant_halves512.h"
#include "linear.h"
#include "row_sweeps.h"

#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

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
    const __m512 d = _mm512_set1_ps(block_f16(b));
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
    const __m512 d = _mm512_set1_ps(block_f16(b)), eight = _mm512_set1_ps(8.0f);
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
WIDE void baton_pack_rows(const float *x, int64_t m_dim, int64_t k_dim, int64_t rows_per_pass,
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

/* y[r, n] = row r's sum (its `chains` accumulators of 16 lanes each, acc[r * chains ..]) +
 * bias[n], for r < rows: from 12 rows (one chain a row) the rows' sums are taken together
 * (lane_sums16; below, one horizontal sum a row measured as fast). */
WIDE static inline __attribute__((always_inline)) void store_row_sums(
    const __m512 *acc, int rows, int chains, const float *bias, int64_t n, int64_t n_dim,
    float *y) {
    float sums[WIDE_ROWS_PER_PASS];
    if (rows >= 12) {
        _mm512_storeu_ps(sums, lane_sums16(acc));
    } else {
        for (int r = 0; r < rows; r++) {
            __m512 sum = acc[r * chains];
            for (int c = 1; c < chains; c++) sum = _mm512_add_ps(sum, acc[r * chains + c]);
            sums[r] = _mm512_reduce_add_ps(sum);
        }
    }
    const float add = bias ? bias[n] : 0.0f;
    for (int r = 0; r < rows; r++) y[r * n_dim + n] = sums[r] + add;
}

/* As DEFINE_SWEEP, 16 floats a vector and up to WIDE_ROWS_PER_PASS rows of x packed by
 * baton_pack_rows; at least four FMA chains at any number of rows. */
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
                const float *xb = x + blk * rows * 32; /* baton_pack_rows: a block's rows in turn */ \
                for (int j = 0; j < 2; j++) {                                                   \
                    for (int r = 0; r < rows; r++) {                                            \
                        int a = r * chains + (2 * (int)(blk & 1) + j) % chains;                 \
                        acc[a] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 32 * r + 16 * j), w16[j], acc[a]); \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            store_row_sums(acc, rows, chains, bias, n, n_dim, y);                              \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    DEFINE_CHUNK(gemv16_chunk_##FMT, sweep16_##FMT, WIDE, WIDE_ROWS_PER_PASS, SWEEP_ROWS_1_15)

DEFINE_WIDE_SWEEP(bf16, dq16_bf16, 64, 1, no_super_scales)
DEFINE_WIDE_SWEEP(f16, dq16_f16, 64, 1, no_super_scales)
DEFINE_WIDE_SWEEP(q8_0, dq16_q8_0, 34, 1, no_super_scales)
DEFINE_WIDE_SWEEP(q4_0, dq16_q4_0, 18, 1, no_super_scales)
DEFINE_WIDE_SWEEP(q4_1, dq16_q4_1, 20, 1, no_super_scales)

/* As DEFINE_WIDE_SWEEP for the k-quants' super-blocks of 256 weights (SUPER_BYTES each, scales
 * by PREPARE), half a super-block dequantized into eight registers at a time and multiplied by
 * every row there: the 8-float sweep and the factored sums took a Q4_K expert (768 x 2048) at
 * 2-8 rows in 1.8-4.5x one row's time on a Zen 5 (2 threads), bound by arithmetic, not by the
 * bytes they read. */
#define DEFINE_KQUANT_SWEEP(FMT, SUPER_BYTES, PREPARE)                                           \
    WIDE static inline __attribute__((always_inline)) void sweep16_##FMT(                        \
        const float *x, int64_t k_dim, const uint8_t *w, int64_t row_bytes, int64_t n_begin,    \
        int64_t n_end, int64_t n_dim, int rows, const float *bias, float *y) {                  \
        const int chains = rows >= 8 ? 1 : 8 / rows;                                            \
        for (int64_t n = n_begin; n < n_end; n++) {                                             \
            const uint8_t *row = w + n * row_bytes;                                             \
            __m512 acc[WIDE_ROWS_PER_PASS];                                                     \
            for (int a = 0; a < WIDE_ROWS_PER_PASS; a++) acc[a] = _mm512_setzero_ps();          \
            for (int64_t super = 0; super < k_dim / 256; super++) {                             \
                const uint8_t *block = row + super * (SUPER_BYTES);                             \
                for (int line = 0; line < (SUPER_BYTES); line += 64)                            \
                    _mm_prefetch((const char *)block + line + PREFETCH_AHEAD, _MM_HINT_T0);     \
                _mm_prefetch((const char *)block + PREFETCH_FAR, _MM_HINT_T1);                  \
                SuperScales scales;                                                             \
                PREPARE(block, &scales);                                                        \
                _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                           \
                    __m512 w16[8];                                                              \
                    FMT##_half512(block, &scales, h, w16);                                      \
                    /* baton_pack_rows: each block of 32 has its rows in turn */                \
                    const float *xh = x + (super * 8 + 4 * h) * rows * 32;                      \
                    _Pragma("GCC unroll 8") for (int v = 0; v < 8; v++) {                       \
                        _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++) {               \
                            const int a = r * chains + v % chains;                              \
                            const float *xv = xh + (v / 2) * rows * 32 + 32 * r + 16 * (v % 2); \
                            acc[a] = _mm512_fmadd_ps(_mm512_loadu_ps(xv), w16[v], acc[a]);      \
                        }                                                                       \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            store_row_sums(acc, rows, chains, bias, n, n_dim, y);                              \
        }                                                                                       \
    }                                                                                           \
                                                                                                \
    DEFINE_CHUNK(gemv16_chunk_##FMT, sweep16_##FMT, WIDE, WIDE_ROWS_PER_PASS, SWEEP_ROWS_1_15)

DEFINE_KQUANT_SWEEP(q4_k, 144, k_super_scales)
DEFINE_KQUANT_SWEEP(q6_k, 210, q6_k_super_scales)

/* The k-quant sweeps take up to 7 rows of x, and only while those rows stay in L1 beside the
 * weights streaming past (WIDE_PASS_BYTES); the staged tiles (staged_gemm.c) take the rest.
 * Against the 8-float sweeps and factored sums before them, Q4_K and Q6_K on a Zen 5 (2
 * threads, out of cache): 1.4-1.65x at 2-7 rows of 768-long rows and 2-5 of 2048-long ones,
 * 1.1x at 6 of those, 0.5-0.65x at 7 of them and at 2-7 rows 8192 long, read from L2. */
#define KQUANT_SWEEP_MAX_ROWS 7

chunk_fn baton_wide_sweep(int fmt, int64_t m_dim, int64_t k_dim) {
    const int kquant_rows_fit =
        m_dim <= KQUANT_SWEEP_MAX_ROWS && m_dim * k_dim * (int64_t)sizeof(float) <= WIDE_PASS_BYTES;
    switch (fmt) {
    case FMT_BF16: return gemv16_chunk_bf16;
    case FMT_F16: return gemv16_chunk_f16;
    case FMT_Q8_0: return gemv16_chunk_q8_0;
    case FMT_Q4_0: return gemv16_chunk_q4_0;
    case FMT_Q4_1: return gemv16_chunk_q4_1;
    case FMT_Q4_K: return kquant_rows_fit ? gemv16_chunk_q4_k : 0;
    case FMT_Q6_K: return kquant_rows_fit ? gemv16_chunk_q6_k : 0;
    default: return 0;
    }
}
