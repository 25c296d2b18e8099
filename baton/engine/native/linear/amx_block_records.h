/* GGUF blocks as amx_blocks.c's tile unit reads them: records of a feature tile's integers in
 * tile order and its scales (amx_block_records.c packs them), widened to bf16 tiles in the
 * product loop.
 *
 * Layout: a matrix of n_dim features is padded to pairs of feature tiles (32 features). Tile nt,
 * block kb (of 32 inputs) is one record of record_bytes(fmt), a tile's records in block order:
 *   - the integers in tile order (amx_tiles.h's tile_offset: 16 rows of 32 values): Q8_0 as
 *     512 bytes, value j of row p at byte 32p + j; Q4 as 256 bytes, row p's byte j holding
 *     value j in its low nibble and value j + 16 in its high one (Q4_0's q + 8, as stored);
 *   - the 16 features' d (f16), then for Q4_1 their m (f16); zeros up to a multiple of 64.
 * So a record is 0.6-1.1 bytes a weight, the GGUF block's own size.
 */
#ifndef BATON_AMX_BLOCK_RECORDS_H
#define BATON_AMX_BLOCK_RECORDS_H

#include <immintrin.h>
#include <stdint.h>

#include "runtime/amx_tiles.h"
#include "linear.h"

static inline int integer_bytes(int fmt) { return fmt == FMT_Q8_0 ? 512 : 256; }

static inline int64_t record_bytes(int fmt) {
    return round_up(integer_bytes(fmt) + (fmt == FMT_Q4_1 ? 64 : 32), 64);
}

/* One record's integers widened into a bf16 tile (512 values) and its d and m into float32. */
__attribute__((always_inline)) AMX_TARGET static inline void widen_record(
    const int fmt, const uint8_t *record, uint16_t *tile, float *d, float *m) {
    for (int row = 0; row < TILE_K / 2; row++) {
        __m512 low, high; /* values 0-15 and 16-31 of the tile row */
        if (fmt == FMT_Q8_0) {
            const __m128i *bytes = (const __m128i *)(record + row * 32);
            low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes)));
            high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes + 1)));
        } else {
            const __m512i nibbles =
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(record + row * 16)));
            low = _mm512_cvtepi32_ps(_mm512_and_si512(nibbles, _mm512_set1_epi32(15)));
            high = _mm512_cvtepi32_ps(_mm512_srli_epi32(nibbles, 4));
            if (fmt == FMT_Q4_0) {
                low = _mm512_sub_ps(low, _mm512_set1_ps(8.0f));
                high = _mm512_sub_ps(high, _mm512_set1_ps(8.0f));
            }
        }
        /* Exact: integers of at most 8 bits. */
        _mm512_store_si512(tile + row * 32, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
    const __m256i *scales = (const __m256i *)(record + integer_bytes(fmt));
    _mm512_store_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256(scales)));
    if (fmt == FMT_Q4_1) _mm512_store_ps(m, _mm512_cvtph_ps(_mm256_loadu_si256(scales + 1)));
}

#endif
