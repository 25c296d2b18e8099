/* What the sweeps over weight rows share (compact_gemv.c, factored_row.c): how far ahead they ask
 * the cache for blocks, and how they cut a matrix's rows into the chunks threads claim. */
#ifndef BATON_ROW_SWEEPS_H
#define BATON_ROW_SWEEPS_H

#include <omp.h>
#include <stdint.h>

/* Bytes ahead of the block being read that each block asks the cache for: the hardware
 * prefetcher alone leaves one core reading a matrix at about 9 GB/s; asking 1 KB ahead
 * measured 5-10 % faster at one row on Zen 3 (a request past the matrix's end is harmless).
 * A second request 4 KB ahead, into L2, keeps more lines in flight: one row of the 0.5B
 * shape's layers read at 18 GB/s with the first alone and 24 GB/s with both on the AMX Xeon
 * (8 and 16 KB: the same). */
#define PREFETCH_AHEAD 1024
#define PREFETCH_FAR 4096

/* Chunks a thread gets on average: enough that a thread descheduled while it holds one delays
 * the product by a small part of it, few enough that claiming them costs nothing measurable. */
#define CHUNKS_PER_THREAD 8
#define MIN_ROWS_PER_CHUNK 16

/* Weight rows per chunk of a product over `n_dim` of them. */
static inline int64_t rows_per_chunk(int64_t n_dim) {
    const int64_t chunks_wanted = CHUNKS_PER_THREAD * (int64_t)omp_get_max_threads();
    const int64_t rows = (n_dim + chunks_wanted - 1) / chunks_wanted;
    return rows > MIN_ROWS_PER_CHUNK ? rows : MIN_ROWS_PER_CHUNK;
}

#endif
