/* Scratch memory a thread keeps from call to call: the kernels' packed rows, tiles and scores. */
#ifndef BATON_THREAD_BUFFER_H
#define BATON_THREAD_BUFFER_H

#include <stdint.h>
#include <stdlib.h>

/* One buffer; a call site declares its own `static __thread ThreadBuffer`, so that the buffers
 * one thread holds at once (a loop's caller also runs its chunks) never share memory. */
typedef struct {
    void *data;
    int64_t bytes;
} ThreadBuffer;

/* At least `bytes` of the buffer, 64-byte aligned: grown (contents lost) when too small, else
 * as it was. NULL if memory ran out. */
static inline void *thread_buffer(ThreadBuffer *buffer, int64_t bytes) {
    if (bytes > buffer->bytes) {
        free(buffer->data);
        /* aligned_alloc wants a size that is a multiple of the alignment. */
        buffer->data = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        buffer->bytes = buffer->data ? bytes : 0;
    }
    return buffer->data;
}

#endif
