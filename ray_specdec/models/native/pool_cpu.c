/* The native kernels' own fork-join pool: a caller that never waits for a thread that has not started.
 *
 * Why not OpenMP. An OpenMP parallel region ends at a barrier that every thread of the team must reach, so when
 * another process holds a worker's core (on a 2-core machine: Ray's processes, the HTTP client, kernel workers) the
 * caller waits until the scheduler gives that worker its turn, even when the caller has done all the work itself. And
 * libgomp's idle workers spin a long while before they sleep, taking a core from whatever runs next. Measured on the
 * 2-core machine (docs/BENCHMARKS.md, "The native kernels' own pool"): served, the second thread gave the loop 1.22x
 * where it gives 1.45x in a process alone; with this pool a decode round at one request takes 7-10% less in process,
 * and the served `tree none` loop gains 3-7%.
 *
 * How. `pool_for` cuts [0, n) into chunks of `grain` indices. The caller and the workers claim chunks one at a time
 * from a counter; the caller returns once every chunk is done, whoever did it. A worker that wakes late finds no
 * chunk left and goes back to waiting: nothing waits for it. Each chunk runs whole on one thread, so a kernel whose
 * chunks compute independent outputs gets the same bits whichever thread runs them, and however many.
 *
 * The counter word holds the job's generation (high 32 bits) and its next chunk (low 32 bits): a worker claims a chunk
 * with one compare-and-swap that fails if the caller has moved on to another job. Idle workers spin for SPIN_NS, then
 * sleep on a condition variable. One caller at a time: a call made while the pool is busy (another thread's call, or
 * a call from inside a chunk) runs its chunks on its own thread.
 */
#include <pthread.h>
#include <stdint.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() ((void)0)
#endif
#if defined(__linux__)
#include <sched.h>
#endif

#include "pool_cpu.h"

#define MAX_WORKERS 255
/* How long an idle worker (and a caller waiting for another thread's chunk) spins before sleeping (or yielding):
 * short, so that torch's OpenMP work that follows finds the core free (1 ms made the served loop with drafting ~4%
 * slower; the gaps between one forward's kernels are microseconds). */
#define SPIN_NS 50000

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int workers;                          /* started so far (under lock) */
static int64_t worker_tids[MAX_WORKERS];     /* their OS thread ids (under lock) */
/* Each word the threads hammer on its own cache line: a spinning worker's reads of `generation` must not slow the
 * claims on `ticket`, nor the counts on `done`. */
#define LINE __attribute__((aligned(64)))
static LINE uint32_t generation;             /* the current job's (atomic) */
static LINE uint64_t ticket;                 /* generation << 32 | next chunk (atomic) */
static LINE int64_t done;                    /* chunks finished of the current job (atomic) */
static LINE int sleepers;                    /* workers asleep or going to sleep (atomic) */
static LINE int busy;                        /* a caller owns the pool (atomic) */
/* The current job: written by its caller before the generation that publishes it. */
static LINE pool_task job_fn;
static void *job_ctx;
static int64_t job_n, job_grain, job_chunks;
static int job_threads;                      /* the caller and this many - 1 workers take part */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

int64_t os_thread_id(void); /* threads_cpu.c */

/* Claim and run chunks of generation `gen` until none is left (or the job is no longer `gen`). */
static void run_chunks(uint32_t gen, pool_task fn, void *ctx, int64_t n, int64_t grain, int64_t chunks) {
    uint64_t t = __atomic_load_n(&ticket, __ATOMIC_SEQ_CST);
    for (;;) {
        if ((uint32_t)(t >> 32) != gen || (int64_t)(t & 0xffffffffu) >= chunks) return;
        if (!__atomic_compare_exchange_n(&ticket, &t, t + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) continue;
        const int64_t begin = (int64_t)(t & 0xffffffffu) * grain, end = begin + grain < n ? begin + grain : n;
        fn(ctx, begin, end);
        __atomic_fetch_add(&done, 1, __ATOMIC_SEQ_CST);
        t = __atomic_load_n(&ticket, __ATOMIC_SEQ_CST);
    }
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    pthread_mutex_lock(&lock);
    worker_tids[index] = os_thread_id();
    pthread_mutex_unlock(&lock);
    uint32_t seen = __atomic_load_n(&generation, __ATOMIC_SEQ_CST);
    for (;;) {
        uint32_t gen = __atomic_load_n(&generation, __ATOMIC_SEQ_CST);
        if (gen == seen) {
            const int64_t until = now_ns() + SPIN_NS;
            for (int i = 0; gen == seen; i++) {
                RELAX();
                gen = __atomic_load_n(&generation, __ATOMIC_SEQ_CST);
                if ((i & 63) == 63 && now_ns() > until) break;
            }
        }
        if (gen == seen) {
            pthread_mutex_lock(&lock);
            __atomic_fetch_add(&sleepers, 1, __ATOMIC_SEQ_CST);
            while ((gen = __atomic_load_n(&generation, __ATOMIC_SEQ_CST)) == seen) pthread_cond_wait(&wake, &lock);
            __atomic_fetch_sub(&sleepers, 1, __ATOMIC_SEQ_CST);
            pthread_mutex_unlock(&lock);
        }
        seen = gen;
        /* The job's fields as its caller published them before `gen`; if the caller has moved on since, every claim
         * below fails (the job's chunks were all claimed before it could move on), so stale fields are never used. */
        pool_task fn = job_fn;
        void *ctx = job_ctx;
        const int64_t n = job_n, grain = job_grain, chunks = job_chunks;
        if (index + 1 < job_threads) run_chunks(gen, fn, ctx, n, grain, chunks);
    }
    return NULL;
}

/* Start workers until there are `count` (at most MAX_WORKERS); returns how many there are. */
static int ensure_workers(int count) {
    if (count > MAX_WORKERS) count = MAX_WORKERS;
    if (__atomic_load_n(&workers, __ATOMIC_ACQUIRE) >= count) return count;
    pthread_mutex_lock(&lock);
    while (workers < count) {
        pthread_t thread;
        pthread_attr_t attr;
        worker_tids[workers] = 0;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, worker_main, (void *)(intptr_t)workers);
        pthread_attr_destroy(&attr);
        if (failed) break;
        __atomic_store_n(&workers, workers + 1, __ATOMIC_RELEASE);
    }
    const int started = workers;
    pthread_mutex_unlock(&lock);
    return started < count ? started : count;
}

void pool_for(int threads, int64_t n, int64_t grain, pool_task fn, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    const int64_t chunks = (n + grain - 1) / grain;
    int expected = 0;
    if (threads <= 1 || chunks <= 1 || chunks >= 0xffffffffLL
            || !__atomic_compare_exchange_n(&busy, &expected, 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
        fn(ctx, 0, n); /* one thread, in chunk order: the same bits */
        return;
    }
    const int helpers = ensure_workers(threads - 1);
    /* No claim on the last job may succeed once its fields change (its chunks were all claimed, but a worker that
     * read a count from the new fields could otherwise take the old counter's next number). */
    const uint32_t last = __atomic_load_n(&generation, __ATOMIC_SEQ_CST);
    __atomic_store_n(&ticket, (uint64_t)last << 32 | 0xffffffffu, __ATOMIC_SEQ_CST);
    job_fn = fn;
    job_ctx = ctx;
    job_n = n;
    job_grain = grain;
    job_chunks = chunks;
    job_threads = helpers + 1;
    __atomic_store_n(&done, 0, __ATOMIC_SEQ_CST);
    const uint32_t gen = last + 1;
    __atomic_store_n(&ticket, (uint64_t)gen << 32, __ATOMIC_SEQ_CST);
    __atomic_store_n(&generation, gen, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&lock);
    }
    run_chunks(gen, fn, ctx, n, grain, chunks);
    /* Every chunk is claimed: wait only for those a worker is running now. */
    if (__atomic_load_n(&done, __ATOMIC_SEQ_CST) < chunks) {
        const int64_t until = now_ns() + SPIN_NS;
        for (int i = 0; __atomic_load_n(&done, __ATOMIC_SEQ_CST) < chunks; i++) {
            RELAX();
#if defined(__linux__)
            if ((i & 63) == 63 && now_ns() > until) sched_yield(); /* its worker may need this core */
#else
            (void)until;
#endif
        }
    }
    __atomic_store_n(&busy, 0, __ATOMIC_SEQ_CST);
}

int pool_thread_ids(int threads, int64_t *out) {
    const int helpers = threads > 1 ? ensure_workers(threads - 1) : 0;
    for (int spins = 0; spins < 1000000; spins++) { /* each new worker records its id first thing */
        int known = 1;
        pthread_mutex_lock(&lock);
        for (int i = 0; i < helpers; i++) known &= worker_tids[i] != 0;
        pthread_mutex_unlock(&lock);
        if (known) break;
        RELAX();
    }
    pthread_mutex_lock(&lock);
    for (int i = 0; i < helpers; i++) out[i] = worker_tids[i];
    pthread_mutex_unlock(&lock);
    return helpers;
}
