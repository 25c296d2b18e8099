/* Half a Q4_K or Q6_K super-block, 128 weights, as eight vectors of 16 float32 weights in weight
 * order, with AVX-512: the row dequantizer stores them (row_dequantize512.c), the few-row sweeps
 * multiply them where they are, in registers (wide_sweeps512.c). One definition, so that a
 * product's weights are the same float32 values whichever kernel took it. */
#ifndef BATON_KQUANT_HALVES512_H
#define BATON_KQUANT_HALVES512_H

#include <immintrin.h>
#include <stdint.h>

#include "block_formats.h"
#include "q6_k_bytes512.h"

#define KQUANT_HALVES512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

/* Q4_K: w = (d * scale) * q - dmin * min, one fused operation. Half h holds the nibble pairs 2h
 * and 2h + 1: each 16 bytes of a pair's 32 widened once for its low nibbles (sub-block 2p) and
 * its high ones (2p + 1). */
KQUANT_HALVES512 static inline void q4_k_half512(const uint8_t *block, const SuperScales *s,
                                                 int h, __m512 *w) {
    const __m512i low_nibble = _mm512_set1_epi32(0x0F);
    for (int pair = 2 * h; pair < 2 * h + 2; pair++) {
        const uint8_t *quants = block + 16 + 32 * pair;
        for (int half = 0; half < 2; half++) {
            const __m512i bytes =
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(quants + 16 * half)));
            for (int high = 0; high < 2; high++) {
                const int sub = 2 * pair + high;
                const __m512 q = _mm512_cvtepi32_ps(
                    high ? _mm512_srli_epi32(bytes, 4) : _mm512_and_si512(bytes, low_nibble));
                w[2 * (sub - 4 * h) + half] = _mm512_fmsub_ps(_mm512_set1_ps(s->dl[sub]), q,
                                                              _mm512_set1_ps(s->ml[sub]));
            }
        }
    }
}

/* Q6_K: w = (d * scale) * (q - 32), the half's 128 six-bit values put together 64 bytes a
 * vector (q6_k_bytes512.h), then 16 at a time widened. */
KQUANT_HALVES512 static inline void q6_k_half512(const uint8_t *block, const SuperScales *s,
                                                 int h, __m512 *w) {
    const __m512i offset = _mm512_set1_epi8(32);
    __m512i first, second;
    q6_k_half_bytes512(block, h, &first, &second);
    const __m512i quarters[2] = {_mm512_sub_epi8(first, offset), _mm512_sub_epi8(second, offset)};
    for (int v = 0; v < 8; v++) {
        const __m128i part = quarter512(quarters[v / 4], v & 3);
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(part));
        w[v] = _mm512_mul_ps(_mm512_set1_ps(s->dl[8 * h + v]), q);
    }
}

#endif
