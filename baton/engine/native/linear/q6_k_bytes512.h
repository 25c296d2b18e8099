/* A Q6_K half super-block's 128 six-bit values, put together 64 bytes a vector with AVX-512:
 * what the one-row sweep (factored_row512.c) and the row dequantizer (row_dequantize512.c)
 * both widen. The half's 64 bytes of nibbles hold weights 0-63 (low nibbles) and 64-127 (high
 * ones); its 32 bytes of high bits, broadcast to both 256-bit halves, give each of those its
 * top two bits with one shift per half. */
#ifndef BATON_Q6_K_BYTES512_H
#define BATON_Q6_K_BYTES512_H

#include <immintrin.h>
#include <stdint.h>

#define Q6_K_BYTES512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2")))

/* Half `h` of the super-block at `block`: first = q of weights 0-63, second = 64-127, in
 * weight order, each byte 0-63 (q, before the format's - 32). */
Q6_K_BYTES512 static inline void q6_k_half_bytes512(const uint8_t *block, int h, __m512i *first,
                                                    __m512i *second) {
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F), top_bits = _mm512_set1_epi8(0x30);
    /* As 16-bit lanes: the low 256 bits' high bits shifted by the first count, the high 256
     * bits' by the second (a byte's own bits land in place; what crosses from its neighbour
     * is masked off). */
    const __m512i shift_first = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shift_second = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i lows = _mm512_loadu_si512(block + 64 * h);
    const __m512i highs =
        _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 128 + 32 * h)));
    /* (a & b) | c: weights 0-63 take the low nibbles and high bits 0-1 (the first 32), 2-3
     * (the next 32); weights 64-127 the high nibbles and high bits 4-5 and 6-7. */
    *first = _mm512_ternarylogic_epi32(
        lows, low_nibbles, _mm512_and_si512(_mm512_sllv_epi16(highs, shift_first), top_bits),
        0xEA);
    *second = _mm512_ternarylogic_epi32(
        _mm512_srli_epi16(lows, 4), low_nibbles,
        _mm512_and_si512(_mm512_srlv_epi16(highs, shift_second), top_bits), 0xEA);
}

/* Bytes 16 * part .. + 16 of `bytes` (part 0-3, a constant after unrolling). */
Q6_K_BYTES512 static inline __m128i quarter512(__m512i bytes, int part) {
    switch (part) {
    case 0: return _mm512_castsi512_si128(bytes);
    case 1: return _mm512_extracti32x4_epi32(bytes, 1);
    case 2: return _mm512_extracti32x4_epi32(bytes, 2);
    default: return _mm512_extracti32x4_epi32(bytes, 3);
    }
}

#endif
