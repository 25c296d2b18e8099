/* The GGUF block formats past Q8_0 / Q4_0 / Q4_1, one block of 32 weights at a time, as four
 * vectors of 8 float32 weights (AVX2 + FMA + F16C): Q5_0, Q5_1, IQ4_NL (32 weights a block),
 * and the 256-weight super-blocks Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS, read as their eight
 * sub-blocks of 32. Layouts: llama.cpp's ggml-common.h.
 *
 * Each weight comes out as exactly the float32 value gguf's numpy dequantization gives (the
 * engine's float32 reference dequantizes with it): a block's scale times a small integer is
 * exact in float32 (an f16 scale has 11 significant bits, a 6-bit sub-scale 6 more, a 5-bit
 * quant 5 more), so where gguf computes `d * q - m` or `d * q + m`, rounding once, one FMA
 * rounds the same exact value once; Q6_K's `(d * scale) * q` can need 25 bits and rounds once
 * either way.
 *
 * Every dequantizer takes the block (or super-block), the index of the 32 weights wanted in it
 * (0 for the 32-weight formats) and the super-block's scales where its format decodes them once
 * a super-block (SuperScales).
 */
#ifndef BATON_BLOCK_FORMATS_H
#define BATON_BLOCK_FORMATS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline float block_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* 32 int8 values (weights 0..31 in order) as four vectors of 8 floats. */
static inline void int8x32_to_float(__m256i v, __m256 *w) {
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

/* 16 bytes holding weight j in byte j's low nibble and weight j + 16 in its high one (Q4_0's,
 * Q5_0's, IQ4's order) as 32 bytes, weight j in byte j, each 0..15. */
static inline __m256i split_nibbles16(const uint8_t *qs) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low),
                            _mm_and_si128(bytes, low));
}

/* 32 bytes' nibbles: the low ones (high = 0) or the high ones, each 0..15. */
static inline __m256i nibbles32(const uint8_t *qs, int high) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)qs);
    const __m256i shifted = high ? _mm256_srli_epi16(bytes, 4) : bytes;
    return _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
}

/* 32 bytes of memory as four vectors of 8 int32, byte j in lane j % 8 of vector j / 8. Each 16
 * bytes go to both 128-bit lanes (a load), and an in-lane byte shuffle moves 8 of them to the low
 * bytes of 32-bit lanes: 4 shuffles for 32 weights, where widening a register's bytes
 * (vpmovzxbd, crossing lanes) took 7, on the ports the FMAs share (Q4_K at one row 1.3x faster
 * on Zen 3). */
static inline void bytes32_to_int32(const uint8_t *p, __m256i *q) {
    const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1,
                                           -1, 4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1,
                                           -1, -1);
    const __m256i second = _mm256_add_epi32(first, _mm256_set1_epi32(8));
    for (int half = 0; half < 2; half++) {
        const __m256i packed =
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + 16 * half)));
        q[2 * half] = _mm256_shuffle_epi8(packed, first);
        q[2 * half + 1] = _mm256_shuffle_epi8(packed, second);
    }
}

/* bytes32_to_int32's lanes, their low nibbles (high = 0) or their high ones. */
static inline void nibbles32_to_int32(const uint8_t *p, int high, __m256i *q) {
    bytes32_to_int32(p, q);
    for (int j = 0; j < 4; j++)
        q[j] = high ? _mm256_srli_epi32(q[j], 4) : _mm256_and_si256(q[j], _mm256_set1_epi32(0x0F));
}

/* Q4_0 / Q4_1: byte j holds weight j in its low nibble and weight j + 16 in its high one. The
 * block's 16 bytes go to both 128-bit lanes, and one in-lane byte shuffle per 8 weights moves
 * byte j to the low byte of 32-bit lane j: the low nibbles (and 0x0F) and high ones (shift by 4)
 * are then whole int32 weights. Measured on Zen 3 at 1 row: 1.3x faster than widening with
 * vpmovzxbd, which crosses lanes, and the same values. */
static inline void nibbles_to_int32(const uint8_t *qs, __m256i *q) {
    const __m256i packed = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1,
                                           -1, 4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1,
                                           -1, -1);
    const __m256i second = _mm256_add_epi32(first, _mm256_set1_epi32(8));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const __m256i bytes_0_7 = _mm256_shuffle_epi8(packed, first);
    const __m256i bytes_8_15 = _mm256_shuffle_epi8(packed, second);
    q[0] = _mm256_and_si256(bytes_0_7, mask);
    q[1] = _mm256_and_si256(bytes_8_15, mask);
    q[2] = _mm256_srli_epi32(bytes_0_7, 4);
    q[3] = _mm256_srli_epi32(bytes_8_15, 4);
}

/* Bit `bit` of each of 32 bytes, as 0 or 1 in each byte. */
static inline __m256i bit_of_bytes(const uint8_t *bytes, int bit) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)bytes);
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(bit)), _mm256_set1_epi8(1));
}

/* The 32 bits of `bits`, bit j as byte j: 0x10 where set, 0 where not (Q5_0/Q5_1's fifth bit). */
static inline __m256i fifth_bits(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
    /* Byte j keeps bit j % 8 of byte j / 8: OR-ing every other bit in makes it all ones where
     * that bit is set. */
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi8(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* What a sweep computes once a super-block and hands each of its sub-blocks (the sweeps unroll
 * a super-block's sub-blocks: decoding a sub-block's scales in scalar code cost more than its
 * 32 weights' arithmetic, and the compiler did not hoist it). Sub-block s's d * scale is
 * `dl[s]` and its dmin * min `ml[s]`, each broadcast from memory where it is used (a load, where
 * a lane permute cost more); Q6_K's 16 scales fill `dl`. Formats that decode their scales per
 * sub-block leave it unset. */
typedef struct {
    float dl[16], ml[8];
} SuperScales;

static inline void no_super_scales(const uint8_t *b, SuperScales *s) {
    (void)b;
    (void)s;
}

/* Q5_0 (22 bytes): f16 d, 32 fifth bits, 16 bytes of nibbles: w = d * (q - 16). */
static inline void dq_q5_0(const uint8_t *b, int sub, const SuperScales *ss, __m256 *w) {
    (void)sub;
    (void)ss;
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(split_nibbles16(b + 6), fifth_bits(qh)),
                                      _mm256_set1_epi8(16));
    const __m256 d = _mm256_set1_ps(block_f16(b));
    int8x32_to_float(q, w);
    for (int j = 0; j < 4; j++) w[j] = _mm256_mul_ps(d, w[j]);
}

/* Q5_1 (24 bytes): f16 d, f16 m, 32 fifth bits, 16 bytes of nibbles: w = d * q + m. */
static inline void dq_q5_1(const uint8_t *b, int sub, const SuperScales *ss, __m256 *w) {
    (void)sub;
    (void)ss;
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const __m256 d = _mm256_set1_ps(block_f16(b)), m = _mm256_set1_ps(block_f16(b + 2));
    int8x32_to_float(_mm256_or_si256(split_nibbles16(b + 8), fifth_bits(qh)), w);
    for (int j = 0; j < 4; j++) w[j] = _mm256_fmadd_ps(d, w[j], m);
}

/* IQ4_NL's and IQ4_XS's 16 non-uniform levels (llama.cpp's kvalues_iq4nl). */
static inline __m256i iq4_levels(__m256i nibbles) {
    const __m256i table = _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25,
                                           38, 53, 69, 89, 113, -127, -104, -83, -65, -49, -35,
                                           -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    return _mm256_shuffle_epi8(table, nibbles);
}

/* IQ4_NL (18 bytes): f16 d, 16 bytes of nibbles indexing the levels: w = d * level. */
static inline void dq_iq4_nl(const uint8_t *b, int sub, const SuperScales *ss, __m256 *w) {
    (void)sub;
    (void)ss;
    const __m256 d = _mm256_set1_ps(block_f16(b));
    int8x32_to_float(iq4_levels(split_nibbles16(b + 2)), w);
    for (int j = 0; j < 4; j++) w[j] = _mm256_mul_ps(d, w[j]);
}

/* IQ4_XS (136 bytes): f16 d, the sub-blocks' 6-bit scales (high 2 bits in a u16, low 4 in 4
 * bytes), 8 times 16 bytes of nibbles: w = (d * (scale - 32)) * level. */
static inline void dq_iq4_xs(const uint8_t *b, int sub, const SuperScales *ss, __m256 *w) {
    (void)ss;
    uint16_t scales_high;
    memcpy(&scales_high, b + 2, 2);
    const int low = (b[4 + sub / 2] >> (4 * (sub % 2))) & 0x0F;
    const int scale = (low | (((scales_high >> (2 * sub)) & 3) << 4)) - 32;
    const __m256 dl = _mm256_set1_ps(block_f16(b) * (float)scale);
    int8x32_to_float(iq4_levels(split_nibbles16(b + 8 + 16 * sub)), w);
    for (int j = 0; j < 4; j++) w[j] = _mm256_mul_ps(dl, w[j]);
}

/* Q2_K (84 bytes): 16 scale bytes (4-bit scale, 4-bit min per 16 weights), 64 bytes of 2-bit
 * quants, f16 d, f16 dmin: w = (d * scale) * q - dmin * min. Sub-block s takes bits 2(s % 4)
 * of bytes 32(s / 4) ..+32, weights 0-15 and 16-31 with scale bytes 2s and 2s + 1. */
static inline void dq_q2_k(const uint8_t *b, int sub, const SuperScales *ss, __m256 *w) {
    (void)ss;
    const float d = block_f16(b + 80), dmin = block_f16(b + 82);
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (sub / 4)));
    const __m256i q = _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(2 * (sub % 4))),
                                       _mm256_set1_epi8(3));
    int8x32_to_float(q, w);
    for (int half = 0; half < 2; half++) {
        const uint8_t scale = b[2 * sub + half];
        const __m256 dl = _mm256_set1_ps(d * (float)(scale & 0x0F));
        const __m256 ml = _mm256_set1_ps(dmin * (float)(scale >> 4));
        for (int j = 2 * half; j < 2 * half + 2; j++) w[j] = _mm256_fmsub_ps(dl, w[j], ml);
    }
}

/* Q3_K's 6-bit scale i (of 16, one per 16 weights), minus 32: its low 4 bits in the nibbles of
 * bytes 0-7, its high 2 in bytes 8-11. */
static inline int q3_k_scale(const uint8_t *scales, int i) {
    const int low = i < 8 ? scales[i] & 0x0F : scales[i - 8] >> 4;
    const int high = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (low | (high << 4)) - 32;
}

/* Q3_K (110 bytes): 32 bytes of high bits, 64 bytes of 2-bit quants, 12 bytes of 6-bit scales,
 * f16 d: w = (d * scale) * (q - (high bit ? 0 : 4)). Sub-block s: low bits as Q2_K's, high bit
 * s of the 32 hmask bytes. */
static inline void dq_q3_k(const uint8_t *b, int sub, const SuperScales *ss, __m256 *w) {
    (void)ss;
    const float d = block_f16(b + 108);
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * (sub / 4)));
    const __m256i low = _mm256_and_si256(
        _mm256_srl_epi16(bytes, _mm_cvtsi32_si128(2 * (sub % 4))), _mm256_set1_epi8(3));
    /* q - 4 + 4 * high: -4..3 */
    const __m256i high4 = _mm256_slli_epi16(bit_of_bytes(b, sub), 2);
    const __m256i q = _mm256_sub_epi8(_mm256_add_epi8(low, high4), _mm256_set1_epi8(4));
    int8x32_to_float(q, w);
    for (int half = 0; half < 2; half++) {
        const __m256 dl = _mm256_set1_ps(d * (float)q3_k_scale(b + 96, 2 * sub + half));
        for (int j = 2 * half; j < 2 * half + 2; j++) w[j] = _mm256_mul_ps(dl, w[j]);
    }
}

/* A Q4_K/Q5_K super-block's eight d * scale and dmin * min: 6-bit scales and mins packed in 12
 * bytes (sub-blocks 0-3 in the low 6 bits of bytes 0-3 and 4-7, sub-blocks 4-7's low 4 bits in
 * bytes 8-11 and their high 2 bits in the top bits of bytes 0-7), unpacked as whole words. */
static inline void k_super_scales(const uint8_t *b, SuperScales *ss) {
    uint32_t u[3];
    memcpy(u, b + 4, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
    const uint32_t scales_0_3 = u[0] & low6, mins_0_3 = u[1] & low6;
    const uint32_t scales_4_7 = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
    const uint32_t mins_4_7 = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
    const __m128i packed = _mm_setr_epi32((int)scales_0_3, (int)scales_4_7, (int)mins_0_3,
                                          (int)mins_4_7);
    const __m256 scales = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed));
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8)));
    _mm256_storeu_ps(ss->dl, _mm256_mul_ps(_mm256_set1_ps(block_f16(b)), scales));
    _mm256_storeu_ps(ss->ml, _mm256_mul_ps(_mm256_set1_ps(block_f16(b + 2)), mins));
}

/* Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes of scales and mins, 128 bytes of nibbles:
 * w = (d * scale) * q - dmin * min. Sub-block s: the low (s even) or high nibbles of bytes
 * 32(s / 2) ..+32. */
static inline void dq_q4_k(const uint8_t *b, int sub, const SuperScales *ss, __m256 *w) {
    const __m256 dl = _mm256_broadcast_ss(ss->dl + sub), ml = _mm256_broadcast_ss(ss->ml + sub);
    __m256i q[4];
    nibbles32_to_int32(b + 16 + 32 * (sub / 2), sub & 1, q);
    for (int j = 0; j < 4; j++) w[j] = _mm256_fmsub_ps(dl, _mm256_cvtepi32_ps(q[j]), ml);
}

/* Q5_K (176 bytes): as Q4_K with 32 bytes of fifth bits (bit s for sub-block s) before the
 * 128 bytes of nibbles. */
static inline void dq_q5_k(const uint8_t *b, int sub, const SuperScales *ss, __m256 *w) {
    const __m256 dl = _mm256_broadcast_ss(ss->dl + sub), ml = _mm256_broadcast_ss(ss->ml + sub);
    const __m256i fifth = _mm256_slli_epi16(bit_of_bytes(b + 16, sub), 4);
    int8x32_to_float(_mm256_or_si256(nibbles32(b + 48 + 32 * (sub / 2), sub & 1), fifth), w);
    for (int j = 0; j < 4; j++) w[j] = _mm256_fmsub_ps(dl, w[j], ml);
}

/* A Q6_K super-block's 16 d * scale. */
static inline void q6_k_super_scales(const uint8_t *b, SuperScales *ss) {
    const __m256 d = _mm256_set1_ps(block_f16(b + 208));
    const __m128i scales = _mm_loadu_si128((const __m128i *)(b + 192));
    _mm256_storeu_ps(ss->dl, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales))));
    _mm256_storeu_ps(ss->dl + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                      _mm_srli_si128(scales, 8)))));
}

/* Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d:
 * w = (d * scale) * (q - 32). Sub-block s = 4h + t: low nibbles (t < 2) or high ones of bytes
 * 64h + 32(t % 2) ..+32, high bits 2t of bytes 128 + 32h ..+32, scales 8h + 2t and + 1. */
static inline void dq_q6_k(const uint8_t *b, int sub, const SuperScales *ss, __m256 *w) {
    const int h = sub / 4, t = sub % 4;
    const __m256i low = nibbles32(b + 64 * h + 32 * (t % 2), t >= 2);
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(2 * t)),
                                          _mm256_set1_epi8(3));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)),
                                      _mm256_set1_epi8(32));
    int8x32_to_float(q, w);
    for (int half = 0; half < 2; half++) {
        const __m256 dl = _mm256_broadcast_ss(ss->dl + 8 * h + 2 * t + half);
        for (int j = 2 * half; j < 2 * half + 2; j++) w[j] = _mm256_mul_ps(dl, w[j]);
    }
}

#endif
