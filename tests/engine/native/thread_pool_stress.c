/* Drives thread_pool.c, built with BATON_POOL_STRESS, through back-to-back loops of changing
 * sizes (fewer chunks than threads up to many) and checks that every loop ran each of its chunks
 * exactly once. Each stress point sleeps 50 us one time in eight, so a thread is regularly
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

int main(int argc, char **argv) {
    const long loops = argc > 1 ? atol(argv[1]) : 2000;
    static const int sizes[] = {2, 3, 17, 5, 64, 2, 9, 33};
    for (long i = 0; i < loops; i++) {
        const int chunks = sizes[i % (sizeof sizes / sizeof sizes[0])];
        Loop loop = {0}; /* on the stack, as the kernels' loop arguments are */
        baton_parallel(count_run, &loop, chunks);
        for (int c = 0; c < chunks; c++) {
            const int runs = atomic_load(&loop.runs[c]);
            if (runs != 1) {
                printf("loop %ld: chunk %d of %d ran %d times\n", i, c, chunks, runs);
                return 1;
            }
        }
    }
    printf("ok\n");
    return 0;
}
