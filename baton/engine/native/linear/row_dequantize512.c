/* Rows of Q4_K and Q6_K blocks dequantized to float32 with AVX-512, 16 weights a vector: what
 * the staged tiles (staged_gemm.c) write into their stage for every 8-32-row product, and the
 * float32 slabs of a prefill (slab_products.py) hold. The 8-float dequantizers (compact_gemv.c)
 * took about a quarter of a 16-row Q4_K product on a Zen 5. Each weight is the same float32
 * value, computed by the same operations (Q4_K: one fused d * scale * q - dmin * min; Q6_K:
 * d * scale times q - 32), so a product's result does not depend on which wrote its stage. */
#include <immintrin.h>
#include <stdint.h>

#include "block_formats.h"
#include "kquant_halves512.h"
#include "linear.h"

#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

/* A row of FMT's super-blocks (SUPER_BYTES each, scales by PREPARE), half a block at a time. */
#define DEFINE_ROW_DEQUANTIZER(FMT, SUPER_BYTES, PREPARE)                                        \
    WIDE static void dequantize_row_##FMT##_512(const uint8_t *row, int64_t k_dim, float *dst) { \
        for (int64_t super = 0; super < k_dim / 256; super++) {                                 \
            const uint8_t *block = row + super * (SUPER_BYTES);                                 \
            SuperScales scales;                                                                 \
            PREPARE(block, &scales);                                                            \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                               \
                __m512 w[8];                                                                    \
                FMT##_half512(block, &scales, h, w);                                            \
                for (int v = 0; v < 8; v++)                                                     \
                    _mm512_storeu_ps(dst + super * 256 + 128 * h + 16 * v, w[v]);               \
            }                                                                                   \
        }                                                                                       \
    }

DEFINE_ROW_DEQUANTIZER(q4_k, 144, k_super_scales)
DEFINE_ROW_DEQUANTIZER(q6_k, 210, q6_k_super_scales)

row_dequantizer baton_row_dequantizer512(int fmt) {
    switch (fmt) {
    case FMT_Q4_K: return dequantize_row_q4_k_512;
    case FMT_Q6_K: return dequantize_row_q6_k_512;
    default: return 0;
    }
}
