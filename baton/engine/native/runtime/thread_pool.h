/* Parallel loops over chunks for the native kernels: see thread_pool.c. */
#ifndef BATON_THREAD_POOL_H
#define BATON_THREAD_POOL_H

#include <stdint.h>

/* Runs fn(ctx, chunk) once for each chunk in [0, chunks), on the calling thread and the
 * engine's workers (as many threads in all as the caller's OpenMP thread count); called from
 * inside a chunk, on that chunk's thread alone. */
typedef void (*chunk_fn)(const void *ctx, int64_t chunk);
void baton_parallel(chunk_fn fn, const void *ctx, int64_t chunks);

#endif
