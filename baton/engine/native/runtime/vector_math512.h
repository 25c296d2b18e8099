/* AVX-512 helpers shared by the kernels that compute 16 floats a vector where the CPU has
 * AVX-512 and the plan allows it (gated_activation.c; amx_gemm.c, whose CPUs all have it). */
#ifndef BATON_VECTOR_MATH512_H
#define BATON_VECTOR_MATH512_H

#include <immintrin.h>
#include <stdint.h>

#include "vector_math.h"

/* vector_math.h's exp_nonpositive and silu8, 16 floats a vector: the same operations in the
 * same order, so each value is bit for bit the 8-float one (tested), in half the instructions. */
#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

WIDE static inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HIGH), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LOW), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i two_n = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(two_n));
}

WIDE static inline __m512 silu16(__m512 x) {
    const __m512 abs_x = _mm512_abs_ps(x), one = _mm512_set1_ps(1.0f);
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), abs_x));
    const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 numerator = _mm512_mask_blend_ps(negative, one, e);
    return _mm512_mul_ps(x, _mm512_div_ps(numerator, _mm512_add_ps(one, e)));
}

/* 16 floats rounded to bf16 as vector_math.h's narrow_bf16 rounds 8. */
WIDE static inline __m256i narrow16_bf16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(rounded);
}

WIDE static inline __m512 widen16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#endif
