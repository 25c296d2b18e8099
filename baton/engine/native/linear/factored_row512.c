/* One row of x against a matrix of Q4_K or Q6_K blocks with AVX-512, the sums factored by
 * block as factored_row.c's 8-float sweeps factor them (see there), 16 floats a vector. */
#include <immintrin.h>
#include <stdint.h>

#include "block_formats.h"
#include "factored_row.h"
#include "q6_k_bytes512.h"
#include "row_sweeps.h"
#include "runtime/vector_math.h"

#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

/* One row of Q4_K with AVX-512 (the most common type of the GGUFs people download: the layers
 * of a Q4_K_M file). Sub-blocks 2p and 2p + 1 are the low and high nibbles of the same 32
 * bytes, so each 16 of those bytes is widened once into 16 int32 lanes that give both: per 64
 * weights 2 widenings, 4 masks or shifts, 4 conversions and 6 FMAs, about half the 8-float
 * sweep's instructions. Every line of a super-block is also asked for PREFETCH_FAR ahead into
 * L2 (the 8-float sweeps ask for one line in 2.25 there): faster, the sweep outran the lines in
 * flight. On a Zen 5 (2 threads) the 1B shape's four Q4_K layer matrices at one row: 1.67-2.0
 * -> 1.2 ms, 27 GB/s of blocks. */
WIDE void baton_factored_q4_k_row512(const void *arg, int64_t chunk) {
    const RowLoop *g = arg;
    const int64_t n_begin = chunk * g->rows_per_chunk;
    const int64_t n_end =
        n_begin + g->rows_per_chunk < g->n_dim ? n_begin + g->rows_per_chunk : g->n_dim;
    const int64_t supers = g->k_dim / 256;
    const __m512i low_nibble = _mm512_set1_epi32(0x0F);
    for (int64_t n = n_begin; n < n_end; n++) {
        const uint8_t *row = g->w + n * g->row_bytes;
        __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        __m256 mins = _mm256_setzero_ps();
        for (int64_t super = 0; super < supers; super++) {
            const uint8_t *block = row + super * 144;
            for (int line = 0; line < 144; line += 64) {
                _mm_prefetch((const char *)block + line + PREFETCH_AHEAD, _MM_HINT_T0);
                _mm_prefetch((const char *)block + line + PREFETCH_FAR, _MM_HINT_T1);
            }
            SuperScales scales;
            k_super_scales(block, &scales);
            mins = _mm256_fmadd_ps(_mm256_loadu_ps(scales.ml),
                                   _mm256_loadu_ps(g->block_sums + super * 8), mins);
            const float *xs = g->x + super * 256;
            for (int pair = 0; pair < 4; pair++) {
                const uint8_t *quants = block + 16 + 32 * pair;
                const __m512i first = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)quants));
                const __m512i second =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(quants + 16)));
                for (int high = 0; high < 2; high++) {
                    const int sub = 2 * pair + high;
                    const __m512 q0 = _mm512_cvtepi32_ps(
                        high ? _mm512_srli_epi32(first, 4) : _mm512_and_si512(first, low_nibble));
                    const __m512 q1 = _mm512_cvtepi32_ps(
                        high ? _mm512_srli_epi32(second, 4) : _mm512_and_si512(second, low_nibble));
                    __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(xs + 32 * sub), q0);
                    dot = _mm512_fmadd_ps(_mm512_loadu_ps(xs + 32 * sub + 16), q1, dot);
                    acc[high] = _mm512_fmadd_ps(_mm512_set1_ps(scales.dl[sub]), dot, acc[high]);
                }
            }
        }
        const float add = g->bias ? g->bias[n] : 0.0f;
        g->y[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) - hsum8(mins) + add;
    }
}

/* One row of Q6_K with AVX-512 (a Q4_K_M file's head and half its v and down matrices). A half
 * super-block's 128 six-bit values are put together in the byte domain, 64 bytes a vector
 * (q6_k_bytes512.h); each of a vector's 16 int32 lanes holds 4 weights, taken out by a shift
 * and a mask, j-th bytes of every lane together: weights 4i + j, which x_by_lane holds side by
 * side (x permuted once a product). Lane i's weights all lie in sub-block i / 4 of the 64, so
 * one vector of their scales (each four times) multiplies the 4 products' sum; the 32 of w = d
 * * scale * (q - 32) goes with the sums of x by 16, as in the 8-float sweep. Per 64 weights:
 * 3 shifts, 3 masks, 4 conversions, 4 products, a scale vector and its FMA, where widening
 * each 16 bytes in weight order took 7 cross-lane shuffles and 4 broadcast scales (Zen 5, 2
 * threads, the Mistral 7B shape's matrices out of cache: 38 -> 44 G weights/s). */
WIDE void baton_factored_q6_k_row512(const void *arg, int64_t chunk) {
    const RowLoop *g = arg;
    const int64_t n_begin = chunk * g->rows_per_chunk;
    const int64_t n_end =
        n_begin + g->rows_per_chunk < g->n_dim ? n_begin + g->rows_per_chunk : g->n_dim;
    const int64_t supers = g->k_dim / 256;
    const __m512i low_byte = _mm512_set1_epi32(0xFF);
    /* Lane i takes scale i / 4 of the four loaded. */
    const __m512i quad = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int64_t n = n_begin; n < n_end; n++) {
        const uint8_t *row = g->w + n * g->row_bytes;
        __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        __m512 mins = _mm512_setzero_ps();
        for (int64_t super = 0; super < supers; super++) {
            const uint8_t *block = row + super * 210;
            for (int line = 0; line < 210; line += 64) {
                _mm_prefetch((const char *)block + line + PREFETCH_AHEAD, _MM_HINT_T0);
                _mm_prefetch((const char *)block + line + PREFETCH_FAR, _MM_HINT_T1);
            }
            SuperScales scales;
            q6_k_super_scales(block, &scales);
            mins = _mm512_fmadd_ps(_mm512_loadu_ps(scales.dl),
                                   _mm512_loadu_ps(g->half_sums + super * 16), mins);
            for (int h = 0; h < 2; h++) {
                __m512i bytes[2];
                q6_k_half_bytes512(block, h, &bytes[0], &bytes[1]);
                for (int part = 0; part < 2; part++) {
                    const float *xs = g->x_by_lane + super * 256 + 128 * h + 64 * part;
                    const __m512i b = bytes[part];
                    __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(xs),
                                               _mm512_cvtepi32_ps(_mm512_and_si512(b, low_byte)));
                    for (int j = 1; j < 3; j++) {
                        const __m512i q = _mm512_and_si512(_mm512_srli_epi32(b, 8 * j), low_byte);
                        dot = _mm512_fmadd_ps(_mm512_loadu_ps(xs + 16 * j), _mm512_cvtepi32_ps(q),
                                              dot);
                    }
                    dot = _mm512_fmadd_ps(_mm512_loadu_ps(xs + 48),
                                          _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 24)), dot);
                    const __m512 scale = _mm512_permutexvar_ps(
                        quad, _mm512_castps128_ps512(_mm_loadu_ps(scales.dl + 8 * h + 4 * part)));
                    acc[part] = _mm512_fmadd_ps(scale, dot, acc[part]);
                }
            }
        }
        const float add = g->bias ? g->bias[n] : 0.0f;
        g->y[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) -
                  32.0f * _mm512_reduce_add_ps(mins) + add;
    }
}

void baton_x_in_lane_order(const float *x, int64_t k_dim, float *out) {
    for (int64_t base = 0; base < k_dim; base += 64)
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 16; i++) out[base + 16 * j + i] = x[base + 4 * i + j];
}
