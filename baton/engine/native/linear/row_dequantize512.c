/* Rows of Q4_K and Q6_K blocks dequantized to float32 with AVX-512, 16 weights a vector: what
 * the staged tiles (staged_gemm.c) write into their stage for every 8-32-row product, and the
 * float32 slabs of a prefill (slab_products.py) hold. The 8-float dequantizers (compact_gemv.c)
 * took about a quarter of a 16-row Q4_K product on a Zen 5. Each weight is the same float32
 * value, computed by the same operations (Q4_K: one fused d * scale * q - dmin * min; Q6_K:
 * d * scale times q - 32), so a product's result does not depend on which wrote its stage. */
#include <immintrin.h>
#include <stdint.h>

#include "block_formats.h"
#include "linear.h"
#include "q6_k_bytes512.h"

#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

/* Q4_K: each 16 bytes of a pair's 32 are widened once for the low nibbles (sub-block 2p) and
 * the high ones (2p + 1). */
WIDE static void dequantize_row_q4_k_512(const uint8_t *row, int64_t k_dim, float *dst) {
    const __m512i low_nibble = _mm512_set1_epi32(0x0F);
    for (int64_t super = 0; super < k_dim / 256; super++) {
        const uint8_t *block = row + super * 144;
        SuperScales scales;
        k_super_scales(block, &scales);
        float *out = dst + super * 256;
        for (int pair = 0; pair < 4; pair++) {
            const uint8_t *quants = block + 16 + 32 * pair;
            for (int half = 0; half < 2; half++) {
                const __m512i bytes =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(quants + 16 * half)));
                for (int high = 0; high < 2; high++) {
                    const int sub = 2 * pair + high;
                    const __m512 q = _mm512_cvtepi32_ps(
                        high ? _mm512_srli_epi32(bytes, 4) : _mm512_and_si512(bytes, low_nibble));
                    _mm512_storeu_ps(out + 32 * sub + 16 * half,
                                     _mm512_fmsub_ps(_mm512_set1_ps(scales.dl[sub]), q,
                                                     _mm512_set1_ps(scales.ml[sub])));
                }
            }
        }
    }
}

/* Q6_K: a half super-block's 128 six-bit values put together 64 bytes a vector
 * (q6_k_bytes512.h), less 32, then 16 at a time widened and times d * scale. */
WIDE static void dequantize_row_q6_k_512(const uint8_t *row, int64_t k_dim, float *dst) {
    const __m512i offset = _mm512_set1_epi8(32);
    for (int64_t super = 0; super < k_dim / 256; super++) {
        const uint8_t *block = row + super * 210;
        SuperScales scales;
        q6_k_super_scales(block, &scales);
        for (int h = 0; h < 2; h++) {
            __m512i first, second;
            q6_k_half_bytes512(block, h, &first, &second);
            const __m512i quarters[2] = {_mm512_sub_epi8(first, offset),
                                         _mm512_sub_epi8(second, offset)};
            float *out = dst + super * 256 + 128 * h;
            for (int sub = 0; sub < 8; sub++) {
                const __m128i part = quarter512(quarters[sub / 4], sub & 3);
                const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(part));
                _mm512_storeu_ps(out + 16 * sub,
                                 _mm512_mul_ps(_mm512_set1_ps(scales.dl[8 * h + sub]), q));
            }
        }
    }
}

row_dequantizer baton_row_dequantizer512(int fmt) {
    switch (fmt) {
    case FMT_Q4_K: return dequantize_row_q4_k_512;
    case FMT_Q6_K: return dequantize_row_q6_k_512;
    default: return 0;
    }
}
