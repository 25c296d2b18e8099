/* The KV cache's element types (--kv-cache-dtype): how the native writer rounds a float32 K or V
 * into one, bit for bit as torch rounds it in KVPool.write (engine/kv/cache_dtype.py), and how
 * the attention kernels widen 8 of them back to float32 as they read them (AVX2 + F16C). */
#ifndef BATON_KV_CACHE_H
#define BATON_KV_CACHE_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "runtime/vector_math.h"

/* Mirrored by native/library.py's KV_ELEMENT_TYPES: keep the numbers in step. */
typedef enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_E4M3 = 3, KV_E5M2 = 4 } KvType;

static inline int64_t kv_element_bytes(int type) {
    return type == KV_F32 ? 4 : type == KV_BF16 || type == KV_F16 ? 2 : 1;
}

static inline uint32_t bits_of(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits;
}

static inline float float_of(uint32_t bits) {
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Round to nearest even; every NaN becomes 0xFFFF, as torch's tensor conversion writes it
 * (vector_math.h's bf16_of, for activations, writes the quiet NaN). */
static inline uint16_t cache_bf16_of(float x) {
    const uint32_t bits = bits_of(x);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* The float8 formats straight from float32, not through float16: rounding twice would differ
 * from torch's single rounding on values halfway between two float8 neighbours. `max_bits`:
 * the float32 bits from which a value rounds to `max_code` (e5m2: 2^16, infinity; e4m3fn:
 * 448, its largest value, saturating, as the writer clamps to ±448 first), `normal_bits` those
 * of the smallest normal; below it, adding 2^`subnormal_shift` rounds to the subnormals' step.
 * The normal range rounds to nearest even by adding half a step less one, plus the kept
 * mantissa's lowest bit. NaN keeps its sign, as torch's conversion does. */
static inline uint8_t float8_of(float x, uint32_t max_bits, uint8_t max_code, uint32_t normal_bits,
                                uint32_t subnormal_shift, int mantissa_bits, int bias) {
    uint32_t bits = bits_of(x);
    const uint32_t sign = bits & 0x80000000u, dropped = 23 - mantissa_bits;
    bits ^= sign;
    uint8_t code;
    if (bits > 0x7F800000u) {
        code = 0x7F;
    } else if (bits >= max_bits) {
        code = max_code;
    } else if (bits < normal_bits) {
        const uint32_t offset = (127 + subnormal_shift) << 23;
        code = (uint8_t)(bits_of(float_of(bits) + float_of(offset)) - offset);
    } else {
        bits += ((uint32_t)(bias - 127) << 23) + (1u << (dropped - 1)) - 1 + ((bits >> dropped) & 1);
        code = (uint8_t)(bits >> dropped);
    }
    return code | (uint8_t)(sign >> 24);
}

static inline uint8_t e4m3_of(float x) {
    return float8_of(x, 0x43E00000u /* 448 */, 0x7E, 121u << 23 /* 2^-6 */, 14, 3, 7);
}

static inline uint8_t e5m2_of(float x) {
    return float8_of(x, 143u << 23 /* 2^16 */, 0x7C, 113u << 23 /* 2^-14 */, 7, 2, 15);
}

/* n floats of x stored as the cache's elements index .. index + n - 1. */
static inline void kv_store(int type, void *cache, int64_t index, const float *x, int64_t n) {
    switch (type) {
    case KV_BF16:
        for (int64_t i = 0; i < n; i++) ((uint16_t *)cache)[index + i] = cache_bf16_of(x[i]);
        return;
    case KV_F16: /* F16C's rounding, which torch's conversion uses too */
        for (int64_t i = 0; i < n; i++)
            ((uint16_t *)cache)[index + i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
        return;
    case KV_E4M3:
        for (int64_t i = 0; i < n; i++) ((uint8_t *)cache)[index + i] = e4m3_of(x[i]);
        return;
    case KV_E5M2:
        for (int64_t i = 0; i < n; i++) ((uint8_t *)cache)[index + i] = e5m2_of(x[i]);
        return;
    default:
        memcpy((float *)cache + index, x, n * sizeof(float));
    }
}

/* The cache's elements index .. index + 7 as float32, exactly. A kernel that passes a constant
 * type gets that case alone inlined. e5m2 is float16's upper byte; e4m3fn's bits, moved into
 * float16's (exponent 4 bits of 5, mantissa 3 of 10), read 2^-8 of its value, subnormals
 * included, so a product by 256 restores it. */
static inline __attribute__((always_inline)) __m256 kv_load8(int type, const void *cache,
                                                             int64_t index) {
    switch (type) {
    case KV_BF16:
        return widen_bf16((const uint16_t *)cache + index);
    case KV_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + index)));
    case KV_E5M2: {
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)((const uint8_t *)cache + index));
        return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
    }
    case KV_E4M3: {
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)((const uint8_t *)cache + index));
        const __m128i wide = _mm_cvtepu8_epi16(bytes);
        const __m128i half =
            _mm_or_si128(_mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x7F)), 7),
                         _mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x80)), 8));
        return _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
    }
    default:
        return _mm256_loadu_ps((const float *)cache + index);
    }
}

/* n (a multiple of 8) of the cache's elements from `index` on, widened into out. */
static inline void kv_widen(int type, const void *cache, int64_t index, int64_t n, float *out) {
    if (type == KV_F32) {
        memcpy(out, (const float *)cache + index, n * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(out + i, kv_load8(type, cache, index + i));
}

/* The entry points of layer/norm_and_rope.c and decode_attention.c, which the decode step chains.
 * Caches are [pages, page_size, kv_heads, head_dim] of `kv_type` elements. */
void baton_rope_and_store(float *qk, int64_t qk_stride, const float *v, int64_t v_stride,
                          int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                          const float *cos_table, const float *sin_table,
                          const int64_t *positions, const int64_t *slots, void *k_cache,
                          void *v_cache, int64_t kv_type);
int baton_decode_attention(const float *q, int64_t q_stride, const int32_t *rows, int64_t n,
                           const void *k_cache, const void *v_cache, const int32_t *kv_indptr,
                           const int32_t *kv_indices, const int32_t *kv_lens, int64_t q_heads,
                           int64_t kv_heads, int64_t head_dim, int64_t page_size, float scale,
                           float softcap, int64_t window, int64_t kv_type, float *out);

#endif
