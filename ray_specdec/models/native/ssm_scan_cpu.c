/* Native CPU kernel (float32): an SSM target layer's selective scan over a forward's rows, which form trees by parent
 * index (ray_specdec/models/target/ssm_scan.py defines the recurrence; native/ssm_scan.py binds it).
 *
 * Why: in torch a depth level of every segment is one vectorised update, so a prefill chunk of S tokens is S updates
 * per layer, each a handful of ops over [d_inner, d_state], after the decays and injections of all S rows have been
 * materialised ([S, d_inner, d_state] each, then every row's state). Here each (segment, channel) pair walks its rows
 * in order, its state in a buffer of d_state floats: a chain continues in place, a row whose parent is not the row
 * before it starts from that parent's saved state (only such parents are saved), and only the rows the caller keeps
 * have their states written out.
 *
 * A row's state and output depend on the row's own path alone, computed by the same instructions whatever the other
 * rows, segments or threads (threads take (channel, segment) pairs, never parts of one): a request's results are the
 * same bits whatever shares its forward. Against torch's path they agree to float32 rounding (the exponentials are
 * libm's / libmvec's, sums are reassociated by -ffast-math).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "gemm_cpu.h"

/* R rows in `segments` segments: segment s is rows [starts[s], starts[s + 1]), its first row's parent -1 (its starting
 * state, start [segments, d_inner, N]), every other row's parent an earlier row of its segment (global index). Per
 * row r and channel c (group g = c / (d_inner / groups) of B and C):
 *     h(r)[n] = exp(dt[r, c] A[c, n]) h(parent)[n] + dt[r, c] x[r, c] B[r, g, n];  y[r, c] = sum_n C[r, g, n] h(r)[n]
 * dt, x: rows dt_stride / x_stride floats apart; B, C: [groups, N] per row, rows b_stride / c_stride apart. A: channel
 * c's values at A + c * a_stride, N of them, or one for every n where a_per_channel (Mamba2's heads). keep [R]: -1, or
 * the index k of the row's state in kept [K, d_inner, N]. y [R, d_inner]. Returns 0, or -1 when out of memory (nothing
 * written then). */
int ssm_tree_scan(int R, int segments, const int64_t *restrict starts, const int64_t *restrict parents, int d_inner,
                  int N, int groups, const float *restrict dt, int64_t dt_stride, const float *restrict x,
                  int64_t x_stride, const float *restrict B, int64_t b_stride, const float *restrict C,
                  int64_t c_stride, const float *restrict A, int64_t a_stride, int a_per_channel,
                  const float *restrict start, const int64_t *restrict keep, float *restrict kept,
                  float *restrict y) {
    if (R == 0) return 0;
    /* saved[r]: where row r's state is kept for a child that does not follow it (-1: none has to be) */
    int64_t *saved = malloc(sizeof(int64_t) * (size_t)R);
    if (!saved) return -1;
    int64_t most_saved = 0;
    for (int64_t r = 0; r < R; r++) saved[r] = -1;
    for (int s = 0; s < segments; s++) {
        int64_t n_saved = 0;
        for (int64_t r = starts[s]; r < starts[s + 1]; r++) {
            const int64_t p = parents[r];
            if (p >= 0 && p != r - 1 && saved[p] < 0) saved[p] = n_saved++;
        }
        if (n_saved > most_saved) most_saved = n_saved;
    }
    const int threads = threads_for_macs((int64_t)R * d_inner * N * 8);
    const int64_t per_thread = (most_saved + 1) * (int64_t)N; /* the saved states, then the running one */
    float *scratch = malloc(sizeof(float) * (size_t)(per_thread * threads));
    if (!scratch) {
        free(saved);
        return -1;
    }
    const int per_group = d_inner / groups;
    const int64_t items = (int64_t)d_inner * segments;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t item = 0; item < items; item++) {
        const int c = (int)(item / segments), s = (int)(item % segments), g = c / per_group;
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        float *restrict states = scratch + per_thread * thread, *restrict h = states + most_saved * N;
        const float *restrict Ac = A + (int64_t)c * a_stride;
        for (int64_t r = starts[s]; r < starts[s + 1]; r++) {
            const int64_t p = parents[r];
            if (p < 0)
                memcpy(h, start + ((int64_t)s * d_inner + c) * N, sizeof(float) * (size_t)N);
            else if (p != r - 1)
                memcpy(h, states + saved[p] * N, sizeof(float) * (size_t)N);
            const float d = dt[r * dt_stride + c], dx = d * x[r * x_stride + c];
            const float *restrict Br = B + r * b_stride + (int64_t)g * N, *restrict Cr = C + r * c_stride + (int64_t)g * N;
            float acc = 0.0f;
            if (a_per_channel) {
                const float decay = expf(d * Ac[0]);
                for (int n = 0; n < N; n++) {
                    h[n] = h[n] * decay + dx * Br[n];
                    acc += h[n] * Cr[n];
                }
            } else {
                for (int n = 0; n < N; n++) {
                    h[n] = h[n] * expf(d * Ac[n]) + dx * Br[n];
                    acc += h[n] * Cr[n];
                }
            }
            y[r * d_inner + c] = acc;
            if (saved[r] >= 0) memcpy(states + saved[r] * N, h, sizeof(float) * (size_t)N);
            if (keep[r] >= 0) memcpy(kept + (keep[r] * d_inner + c) * N, h, sizeof(float) * (size_t)N);
        }
    }
    free(scratch);
    free(saved);
    return 0;
}
