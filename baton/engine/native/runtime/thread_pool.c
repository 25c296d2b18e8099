/* The decode step's worker threads: parallel loops that never wait for a thread that has not
 * started on them.
 *
 * Why not OpenMP: an OpenMP loop ends at a barrier every thread of its team must reach. On a
 * machine whose cores the server's other processes share (the frontend, the detokenizer, the
 * scheduler thread, the clients), one team thread is often descheduled, and then every loop of
 * the step waits until it runs again: measured on 2 cores, a 16-row decode step took 6.35 ms in
 * the server against 3.87 ms alone, while the other processes used 37 % of one core.
 *
 * Here a loop is a count of chunks that threads claim one at a time, each from its own range
 * first, then from the others'; the caller claims too, and waits only for chunks another thread
 * has claimed and not finished. A worker that wakes late
 * finds nothing left and goes back to waiting, so a loop ends as soon as its chunks are done.
 * Each chunk's result must not depend on which thread runs it (the kernels give each chunk whole
 * outputs), so results do not depend on the number of threads either.
 *
 * One caller at a time (a mutex): the engine's thread. Workers are started by the first call
 * that wants them and inherit the caller's CPU affinity (the engine's binding); they spin
 * briefly between loops (a step's loops come back to back), then sleep on a futex.
 */
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <immintrin.h>

#include "thread_pool.h"

#define MAX_WORKERS 63

/* Where a thread being descheduled matters to the protocol below. Empty in the library; the
 * thread-pool stress test (tests/engine/native/test_thread_pool.py) builds this file with
 * BATON_POOL_STRESS defined, which sleeps there at random, so that the orders that are rare on
 * a busy machine happen in every run. */
#ifdef BATON_POOL_STRESS
void baton_pool_stress_point(void);
#define STRESS_POINT() baton_pool_stress_point()
#else
#define STRESS_POINT() ((void)0)
#endif

/* Pause instructions a worker spins for before sleeping: about 0.5 ms on Zen 3 (25 ns each),
 * more than the gaps between a step's loops, far less than an idle server's wait. */
#define SPIN_PAUSES 20000

/* Each thread of a loop starts on its own contiguous range of chunks, claimed from a counter on
 * its own cache line (uncontended, and a weight matrix is read in long runs); once its range is
 * done it takes chunks from the others' ranges. A range's next chunk and its end are each
 * `(epoch << 32) | chunk` words, and a claim needs both tagged with the claimer's loop: a thread
 * still draining an ended loop could otherwise pair that loop's exhausted counter with the end
 * the caller has just stored for the next loop, and run a chunk twice (found as a server that
 * hung with a loop's finished count past its chunks; reproduced with delays at these points). */
typedef struct {
    _Alignas(64) _Atomic uint64_t next;
    _Atomic uint64_t end;
    _Atomic int64_t done; /* chunks this thread finished in the current loop */
} Range;

static struct {
    pthread_mutex_t caller;
    Range ranges[MAX_WORKERS + 1]; /* [0]: the caller's; [i + 1]: worker i's */
    /* (epoch << 32) | participants (the caller and the workers with an index below
     * participants - 1), in one word: a worker that read one loop's participants and the next
     * loop's epoch could claim chunks into a count that loop does not read. */
    _Alignas(64) _Atomic uint64_t loop;
    _Atomic(chunk_fn) fn;
    _Atomic(const void *) ctx;
    _Alignas(64) _Atomic uint32_t wake; /* futex word: bumped for each loop */
    _Atomic int sleepers;
    int workers;
} pool = {.caller = PTHREAD_MUTEX_INITIALIZER};

static void futex_wait(_Atomic uint32_t *word, uint32_t expected) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}

/* Claim and run chunks of `range` while it has any in loop `epoch`; the count run. */
static int64_t drain(Range *range, uint32_t epoch) {
    int64_t ran = 0;
    uint64_t claim = atomic_load_explicit(&range->next, memory_order_acquire);
    for (;;) {
        /* Read before the claim, and valid if it succeeds: the loop cannot end (and the next
         * one be published) while this chunk is unclaimed. */
        const chunk_fn fn = atomic_load_explicit(&pool.fn, memory_order_relaxed);
        const void *ctx = atomic_load_explicit(&pool.ctx, memory_order_relaxed);
        STRESS_POINT();
        const uint64_t end = atomic_load_explicit(&range->end, memory_order_relaxed);
        const int64_t chunk = (int64_t)(uint32_t)claim;
        if ((uint32_t)(claim >> 32) != epoch || (uint32_t)(end >> 32) != epoch ||
            chunk >= (int64_t)(uint32_t)end)
            return ran;
        if (atomic_compare_exchange_weak_explicit(&range->next, &claim, claim + 1,
                                                  memory_order_acq_rel, memory_order_acquire)) {
            fn(ctx, chunk);
            ran++;
            claim = atomic_load_explicit(&range->next, memory_order_acquire);
        }
    }
}

/* Set while this thread runs a loop's chunks: a loop a chunk starts (a mixture of experts'
 * block runs each expert's products in a chunk of its own) runs on this thread alone, since the
 * other threads are busy with the outer loop and the caller's mutex is held. */
static __thread int inside_loop;

/* Participant `self` of loop `epoch`: its own range first, then the others'. */
static void run_chunks(int self, uint32_t epoch, int participants) {
    int64_t ran = 0;
    inside_loop = 1;
    for (int i = 0; i < participants; i++)
        ran += drain(&pool.ranges[(self + i) % participants], epoch);
    inside_loop = 0;
    atomic_fetch_add_explicit(&pool.ranges[self].done, ran, memory_order_release);
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint32_t seen = atomic_load_explicit(&pool.wake, memory_order_acquire);
    for (;;) {
        uint32_t now;
        int spins = 0;
        while ((now = atomic_load_explicit(&pool.wake, memory_order_acquire)) == seen) {
            if (++spins < SPIN_PAUSES) {
                _mm_pause();
                continue;
            }
            atomic_fetch_add_explicit(&pool.sleepers, 1, memory_order_seq_cst);
            if (atomic_load_explicit(&pool.wake, memory_order_seq_cst) == seen)
                futex_wait(&pool.wake, seen);
            atomic_fetch_sub_explicit(&pool.sleepers, 1, memory_order_relaxed);
            spins = 0;
        }
        seen = now;
        STRESS_POINT();
        const uint64_t loop = atomic_load_explicit(&pool.loop, memory_order_acquire);
        const int participants = (int)(uint32_t)loop;
        if (index + 1 < participants) run_chunks(index + 1, (uint32_t)(loop >> 32), participants);
    }
    return NULL;
}

/* Start workers until there are `wanted`; returns how many there are. */
static int ensure_workers(int wanted) {
    if (wanted > MAX_WORKERS) wanted = MAX_WORKERS;
    while (pool.workers < wanted) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, worker_main, (void *)(intptr_t)pool.workers)) break;
        pthread_detach(thread);
        pool.workers++;
    }
    return pool.workers;
}

void baton_parallel(chunk_fn fn, const void *ctx, int64_t chunks) {
    /* The caller's OpenMP thread count (torch.set_num_threads on the engine's thread) is the
     * number of threads the engine may use. */
    const int threads = omp_get_max_threads();
    if (threads <= 1 || chunks <= 1 || inside_loop) {
        for (int64_t chunk = 0; chunk < chunks; chunk++) fn(ctx, chunk);
        return;
    }
    pthread_mutex_lock(&pool.caller);
    int participants = ensure_workers(threads - 1) + 1;
    participants = participants < threads ? participants : threads;
    participants = participants < chunks ? participants : (int)chunks;
    const uint32_t epoch = (uint32_t)(atomic_load_explicit(&pool.loop, memory_order_relaxed) >> 32) + 1;
    const uint64_t tag = (uint64_t)epoch << 32;
    atomic_store_explicit(&pool.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool.ctx, ctx, memory_order_relaxed);
    for (int p = 0; p < participants; p++) {
        Range *range = &pool.ranges[p];
        atomic_store_explicit(&range->done, 0, memory_order_relaxed);
        atomic_store_explicit(&range->end, tag | (uint64_t)(chunks * (p + 1) / participants),
                              memory_order_relaxed);
        STRESS_POINT();
        atomic_store_explicit(&range->next, tag | (uint64_t)(chunks * p / participants),
                              memory_order_release);
    }
    atomic_store_explicit(&pool.loop, tag | (uint64_t)participants, memory_order_release);
    atomic_fetch_add_explicit(&pool.wake, 1, memory_order_seq_cst);
    if (atomic_load_explicit(&pool.sleepers, memory_order_seq_cst) > 0) futex_wake_all(&pool.wake);
    run_chunks(0, epoch, participants);
    for (;;) {
        int64_t finished = 0;
        for (int p = 0; p < participants; p++)
            finished += atomic_load_explicit(&pool.ranges[p].done, memory_order_acquire);
        if (finished == chunks) break;
        _mm_pause();
    }
    pthread_mutex_unlock(&pool.caller);
}
