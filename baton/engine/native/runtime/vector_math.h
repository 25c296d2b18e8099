/* Small AVX2 helpers shared by the native kernels. */
#ifndef BATON_VECTOR_MATH_H
#define BATON_VECTOR_MATH_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* exp_nonpositive's constants, one set for every vector width (vector_math512.h's 16-float
 * copy computes the same values bit for bit). e^-87 ~ 1.6e-38 is still a normal float; ln2 is
 * split in two so n ln2 is exact enough; the polynomial's coefficients are Cephes'. */
#define EXP_FLOOR -87.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HIGH 0.693359375f
#define EXP_LN2_LOW -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

/* e^x for x <= 0 (scores minus their maximum), within 2 ulp: x = n ln2 + r with |r| <= ln2 / 2,
 * e^r by its degree-7 Taylor-like polynomial, times 2^n. */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR));
    __m256 n = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(EXP_LOG2E), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HIGH), x); /* r = x - n ln2 */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LOW), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i two_n = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

/* sigmoid(t) for 8 floats, through e^-|t|: 1 / (1 + e) for t >= 0, e / (1 + e) below. */
static inline __m256 sigmoid8(__m256 t) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_setzero_ps(),
                                                   _mm256_andnot_ps(_mm256_set1_ps(-0.0f), t)));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 numerator =
        _mm256_blendv_ps(one, e, _mm256_cmp_ps(t, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_div_ps(numerator, _mm256_add_ps(one, e));
}

/* silu(x) = x / (1 + e^-x) = x sigmoid(x) for 8 floats (never overflows). */
static inline __m256 silu8(__m256 x) { return _mm256_mul_ps(x, sigmoid8(x)); }

/* gelu with tanh's approximation (transformers' gelu_pytorch_tanh, Gemma's) for 8 floats:
 * 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3). */
static inline __m256 gelu_tanh8(__m256 x) {
    const __m256 cubic = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 inner = _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cubic, x);
    return _mm256_mul_ps(x, sigmoid8(_mm256_mul_ps(_mm256_set1_ps(1.5957691216f), inner)));
}

/* tanh for 8 floats: 2 sigmoid(2x) - 1 (within about 1e-7 absolute, where tanh is near 0). */
static inline __m256 tanh8(__m256 x) {
    const __m256 s = sigmoid8(_mm256_add_ps(x, x));
    return _mm256_fmsub_ps(_mm256_set1_ps(2.0f), s, _mm256_set1_ps(1.0f));
}

/* bf16 <-> float32, rounding as torch rounds: to nearest even, a NaN to the quiet NaN. */
static inline __m256 widen_bf16(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline float float_of_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, 4);
    return x;
}

static inline uint16_t bf16_of(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return x != x ? 0x7FC0 : (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* 8 floats rounded to bf16 as bf16_of rounds each. */
static inline __m128i narrow_bf16(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
    const __m256i packed = _mm256_packus_epi32(rounded, rounded); /* in-lane: 0-3, 0-3 | 4-7, 4-7 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

#endif
