/* The sum of every tensor-parallel rank's float32 vector, in rank order, through memory the ranks of one machine
 * share (models/shm_collective.py maps it and says why).
 *
 * Layout of the mapping: `world` flags of one cache line each (the sequence number each rank last published), then
 * two buffers of `world` slots of `capacity` floats. Call `seq` (1, 2, ...) uses buffer seq % 2: a rank copies its
 * vector into its slot, publishes seq (release), waits until every rank has published seq (acquire), and sums the
 * slots in rank order. Two buffers suffice: a rank that writes call seq + 2 has seen every rank publish seq + 1,
 * which each did after it had read call seq.
 *
 * The sum is written as one pass per rank over the output (out = slot 0; out += slot 1; ...), compiled without
 * fast-math reassociation, so each element is ((x0 + x1) + x2) + ... whatever the vector's length: the same bits on
 * every rank and for every batch.
 */
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define FLAG_STRIDE 8 /* int64 flags, one cache line apart */
#define SPINS_BEFORE_YIELD 2000
#define YIELDS_BEFORE_SLEEP 2000

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static float *slot_of(void *base, int world, int64_t capacity, int64_t seq, int rank) {
    float *data = (float *)((char *)base + 64 * (int64_t)world);
    return data + ((seq & 1) * world + rank) * capacity;
}

/* Waits for every rank to publish `seq`; 0, or -1 after timeout_s seconds (a peer died or went elsewhere). */
static int wait_all(volatile int64_t *flags, int world, int64_t seq, double timeout_s) {
    double start = -1.0;
    for (int q = 0; q < world; q++) {
        int64_t spins = 0;
        while (__atomic_load_n(&flags[q * FLAG_STRIDE], __ATOMIC_ACQUIRE) < seq) {
            spins++;
            if (spins < SPINS_BEFORE_YIELD) {
                continue;
            }
            if (spins < SPINS_BEFORE_YIELD + YIELDS_BEFORE_SLEEP) {
                sched_yield(); /* a peer preempted on a busy machine gets the core */
            } else {
                struct timespec pause = {0, 50000};
                nanosleep(&pause, NULL);
            }
            if ((spins & 255) == 0) {
                if (start < 0) {
                    start = now_s();
                } else if (now_s() - start > timeout_s) {
                    return -1;
                }
            }
        }
    }
    return 0;
}

__attribute__((optimize("no-fast-math"))) int shm_sum_f32(void *base, int world, int rank, int64_t capacity,
                                                          int64_t seq, const float *x, float *out, int64_t n,
                                                          double timeout_s) {
    if (n > capacity || rank < 0 || rank >= world) {
        return -2;
    }
    volatile int64_t *flags = (volatile int64_t *)base;
    memcpy(slot_of(base, world, capacity, seq, rank), x, (size_t)n * sizeof(float));
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the slot's stores (streaming ones included) before the flag */
    __atomic_store_n(&flags[rank * FLAG_STRIDE], seq, __ATOMIC_RELEASE);
    if (wait_all(flags, world, seq, timeout_s) != 0) {
        return -1;
    }
    const float *first = slot_of(base, world, capacity, seq, 0);
    for (int64_t i = 0; i < n; i++) {
        out[i] = first[i];
    }
    for (int q = 1; q < world; q++) {
        const float *part = slot_of(base, world, capacity, seq, q);
        for (int64_t i = 0; i < n; i++) {
            out[i] += part[i];
        }
    }
    return 0;
}
