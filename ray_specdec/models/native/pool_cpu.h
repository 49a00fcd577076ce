/* The native kernels' fork-join pool (pool_cpu.c). */
#ifndef RAY_SPECDEC_POOL_CPU_H
#define RAY_SPECDEC_POOL_CPU_H

#include <stdint.h>

/* Runs indices [begin, end) of a job. */
typedef void (*pool_task)(void *ctx, int64_t begin, int64_t end);

/* fn over [0, n) in chunks of `grain` indices, on up to `threads` threads (the caller's included); returns when every
 * chunk is done. Chunks run whole on one thread each, in any order and on any thread. */
void pool_for(int threads, int64_t n, int64_t grain, pool_task fn, void *ctx);

/* Starts the pool's workers for `threads` threads; out[i]: the OS thread id of worker i. Returns their count. */
int pool_thread_ids(int threads, int64_t *out);

#endif
