/* Drives thread_pool.c, built with BATON_POOL_STRESS, through back-to-back loops of changing
 * sizes (fewer chunks than threads up to many) and checks that every loop ran each of its chunks
 * exactly once; every fourth loop's chunks each start a loop of their own, which must run there,
 * on the chunk's thread (the mixture-of-experts block's experts do), each of its chunks once. Each stress point sleeps 50 us one time in eight, so a thread is regularly
 * "descheduled" in the middle of the protocol. Prints "ok" and exits 0, or says what went wrong
 * and exits 1; a protocol that loses a count hangs (the test's timeout catches that).
 * Usage: thread_pool_stress LOOPS (threads: OMP_NUM_THREADS). */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "thread_pool.h"

void baton_pool_stress_point(void) {
    static _Thread_local unsigned state = 12345;
    state = state * 1103515245u + 12345u;
    if ((state >> 16) % 8 == 0) usleep(50);
}

#define MAX_CHUNKS 64

typedef struct {
    _Atomic int runs[MAX_CHUNKS];
} Loop;

static void count_run(const void *arg, int64_t chunk) {
    Loop *loop = (Loop *)arg;
    atomic_fetch_add_explicit(&loop->runs[chunk], 1, memory_order_relaxed);
}

#define INNER_CHUNKS 5

/* A chunk that runs a loop of its own: its inner chunks all run before it returns. */
static void nested_run(const void *arg, int64_t chunk) {
    Loop inner = {0};
    baton_parallel(count_run, &inner, INNER_CHUNKS);
    int whole = 1;
    for (int c = 0; c < INNER_CHUNKS; c++) whole &= atomic_load(&inner.runs[c]) == 1;
    if (whole) count_run(arg, chunk);
}

int main(int argc, char **argv) {
    const long loops = argc > 1 ? atol(argv[1]) : 2000;
    static const int sizes[] = {2, 3, 17, 5, 64, 2, 9, 33};
    for (long i = 0; i < loops; i++) {
        const int chunks = sizes[i % (sizeof sizes / sizeof sizes[0])];
        Loop loop = {0}; /* on the stack, as the kernels' loop arguments are */
        baton_parallel(i % 4 == 3 ? nested_run : count_run, &loop, chunks);
        for (int c = 0; c < chunks; c++) {
            const int runs = atomic_load(&loop.runs[c]);
            if (runs != 1) {
                printf("loop %ld: chunk %d of %d ran %d times%s\n", i, c, chunks, runs,
                       i % 4 == 3 ? " (or its inner loop did not run whole)" : "");
                return 1;
            }
        }
    }
    printf("ok\n");
    return 0;
}
