/* Native CPU kernel (float32): an SSM target layer's selective scan over a forward's rows, which form trees by parent
 * index (ray_specdec/models/target/ssm_scan.py defines the recurrence; native/ssm_scan.py binds it).
 *
 * Why: in torch a depth level of every segment is one vectorised update, so a prefill chunk of S tokens is S updates
 * per layer, each a handful of ops over [d_inner, d_state], after the decays and injections of all S rows have been
 * materialised ([S, d_inner, d_state] each, then every row's state). Here a block of 16 channels of a segment walks
 * its rows in order, a channel in each vector lane and its state as d_state vectors: a chain continues in place, a row
 * whose parent is not the row before it starts from that parent's saved state (only such parents are saved), the
 * decays are computed as they are used, and only the rows the caller keeps have their states written out.
 *
 * A row's state and output depend on the row's own path alone, computed by the same instructions whatever the other
 * rows, segments or threads (threads take (block, segment) pairs, never parts of one; every lane does the same
 * operations): a request's results are the same bits whatever shares its forward. Against torch's path they agree to
 * float32 rounding (the exponential is a polynomial of its own, sums are fused multiply-adds in another order).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention_simd_cpu.h"
#include "gemm_cpu.h"

#define LANES 16 /* channels per block: one vf16 */

/* v[i][j] <-> v[j][i]: for each bit b of a lane index, lane j of row i (bit b of i clear, of j set) swaps with lane
 * j - b of row i + b. */
static inline void transpose16(vf16 v[LANES]) {
    static const vi16 lo[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                               {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                               {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                               {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
    static const vi16 hi[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                               {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
                               {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
                               {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const int b = 8 >> k;
#pragma GCC unroll 16
        for (int i = 0; i < LANES; i++)
            if (!(i & b)) {
                const vf16 a = v[i], c = v[i + b];
                v[i] = __builtin_shuffle(a, c, lo[k]);
                v[i + b] = __builtin_shuffle(a, c, hi[k]);
            }
    }
}

/* R rows in `segments` segments: segment s is rows [starts[s], starts[s + 1]), its first row's parent -1 (its starting
 * state: [d_inner, N] contiguous at start + start_rows[s] * start_stride, or s * start_stride where start_rows is
 * NULL), every other row's parent an earlier row of its segment (global index). Per
 * row r and channel c (group g = c / (d_inner / groups) of B and C):
 *     h(r)[n] = exp(dt[r, c] A[c, n]) h(parent)[n] + dt[r, c] x[r, c] B[r, g, n];  y[r, c] = sum_n C[r, g, n] h(r)[n]
 * dt, x: rows dt_stride / x_stride floats apart; B, C: [groups, N] per row, rows b_stride / c_stride apart. A: channel
 * c's values at A + c * a_stride, N of them, or one for every n where a_per_channel (Mamba2's heads). The state of
 * row keep_rows[k] (distinct rows) goes to kept + kept_to[k] * kept_stride ([d_inner, N] contiguous; k * kept_stride
 * where kept_to is NULL). y [R, d_inner]. Returns 0, or -1 when out of memory (nothing written then).
 *
 * The kept states may go where the starting states are (a request's state advanced in place): a kept row's
 * destination may be its own segment's start, never another segment's (a block of channels reads its segment's start
 * at the segment's first row, before any of its rows is written).
 *
 * Each block of LANES channels of a segment walks the segment's rows with a channel in each vector lane (the same
 * operations in every lane, whatever the block's other channels) and its state as N vectors; the exponential is
 * attention_simd_cpu.h's vexp (within ~2 ulp of expf). */
int ssm_tree_scan(int R, int segments, const int64_t *restrict starts, const int64_t *restrict parents, int d_inner,
                  int N, int groups, const float *restrict dt, int64_t dt_stride, const float *restrict x,
                  int64_t x_stride, const float *restrict B, int64_t b_stride, const float *restrict C,
                  int64_t c_stride, const float *restrict A, int64_t a_stride, int a_per_channel, const float *start,
                  int64_t start_stride, const int64_t *restrict start_rows, int K, const int64_t *restrict keep_rows,
                  float *kept, int64_t kept_stride, const int64_t *restrict kept_to, float *restrict y) {
    if (R == 0) return 0;
    /* saved[r]: where row r's state is kept for a child that does not follow it (-1: none has to be); keep[r]: where
     * it goes in kept (-1: nowhere) */
    int64_t *saved = malloc(sizeof(int64_t) * 2 * (size_t)R), *keep = saved + R;
    if (!saved) return -1;
    int64_t most_saved = 0;
    for (int64_t r = 0; r < R; r++) saved[r] = keep[r] = -1;
    for (int k = 0; k < K; k++) keep[keep_rows[k]] = k;
    for (int s = 0; s < segments; s++) {
        int64_t n_saved = 0;
        for (int64_t r = starts[s]; r < starts[s + 1]; r++) {
            const int64_t p = parents[r];
            if (p >= 0 && p != r - 1 && saved[p] < 0) saved[p] = n_saved++;
        }
        if (n_saved > most_saved) most_saved = n_saved;
    }
    const int threads = threads_for_macs((int64_t)R * d_inner * N * 8);
    /* per thread: the saved states, the running one, the block's A, and B / C lanes for blocks across groups */
    const int64_t per_thread = (most_saved + 4) * (int64_t)N;
    vf16 *scratch = aligned_alloc(64, sizeof(vf16) * (size_t)(per_thread * threads));
    if (!scratch) {
        free(saved);
        return -1;
    }
    const int per_group = d_inner / groups, blocks = (d_inner + LANES - 1) / LANES;
    const int64_t items = (int64_t)blocks * segments;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t item = 0; item < items; item++) {
        const int s = (int)(item % segments), c0 = (int)(item / segments) * LANES;
        const int w = d_inner - c0 < LANES ? d_inner - c0 : LANES;
        const int g0 = c0 / per_group, one_group = (c0 + w - 1) / per_group == g0;
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        vf16 *states = scratch + per_thread * thread, *h = states + most_saved * N, *a = h + N, *b = a + N, *cc = b + N;
        for (int n = 0; n < (a_per_channel ? 1 : N); n++)
            for (int l = 0; l < LANES; l++) a[n][l] = l < w ? A[(int64_t)(c0 + l) * a_stride + n] : 0.0f;
        for (int64_t r = starts[s]; r < starts[s + 1]; r++) {
            const int64_t p = parents[r];
            if (p < 0) {
                const float *h0 = start + (start_rows ? start_rows[s] : s) * start_stride + (int64_t)c0 * N;
                if (w == LANES && N % LANES == 0) /* 16 channels' runs of 16 state elements, transposed */
                    for (int n0 = 0; n0 < N; n0 += LANES) {
                        for (int l = 0; l < LANES; l++) memcpy(&h[n0 + l], h0 + (int64_t)l * N + n0, sizeof(vf16));
                        transpose16(h + n0);
                    }
                else
                    for (int n = 0; n < N; n++)
                        for (int l = 0; l < LANES; l++) h[n][l] = l < w ? h0[(int64_t)l * N + n] : 0.0f;
            } else if (p != r - 1) {
                memcpy(h, states + saved[p] * N, sizeof(vf16) * (size_t)N);
            }
            const vf16 d = load_lanes(dt + r * dt_stride + c0, w), dx = d * load_lanes(x + r * x_stride + c0, w);
            const float *Br = B + r * b_stride + (int64_t)g0 * N, *Cr = C + r * c_stride + (int64_t)g0 * N;
            if (!one_group) /* lane l takes its own group's B and C */
                for (int n = 0; n < N; n++)
                    for (int l = 0; l < LANES; l++) {
                        const int64_t at = (int64_t)((c0 + (l < w ? l : 0)) / per_group) * N + n;
                        b[n][l] = B[r * b_stride + at];
                        cc[n][l] = C[r * c_stride + at];
                    }
            const vf16 zero = {0}, decay_all = a_per_channel ? vexp(d * a[0]) : zero;
            vf16 acc = zero;
            for (int n = 0; n < N; n++) {
                const vf16 decay = a_per_channel ? decay_all : vexp(d * a[n]);
                const vf16 bn = one_group ? zero + Br[n] : b[n], cn = one_group ? zero + Cr[n] : cc[n];
                h[n] = fma16(h[n], decay, dx * bn);
                acc = fma16(h[n], cn, acc);
            }
            if (w == LANES)
                memcpy(y + r * d_inner + c0, &acc, sizeof acc);
            else
                for (int l = 0; l < w; l++) y[r * d_inner + c0 + l] = acc[l];
            if (saved[r] >= 0) memcpy(states + saved[r] * N, h, sizeof(vf16) * (size_t)N);
            if (keep[r] >= 0) {
                float *out = kept + (kept_to ? kept_to[keep[r]] : keep[r]) * kept_stride + (int64_t)c0 * N;
                if (w == LANES && N % LANES == 0)
                    for (int n0 = 0; n0 < N; n0 += LANES) {
                        vf16 t[LANES];
                        memcpy(t, h + n0, sizeof t);
                        transpose16(t);
                        for (int l = 0; l < LANES; l++) memcpy(out + (int64_t)l * N + n0, &t[l], sizeof(vf16));
                    }
                else
                    for (int n = 0; n < N; n++)
                        for (int l = 0; l < w; l++) out[(int64_t)l * N + n] = h[n][l];
            }
        }
    }
    free(scratch);
    free(saved);
    return 0;
}

/* The depthwise causal conv of every row over its own ancestors' inputs (tree_conv of models/target/ssm_scan.py):
 *     out[r, c] = sum_k weight_t[k, c] input(windows[r, k])[c] (+ bias[c]),  k = 0 .. d_conv - 1, oldest first
 * where input(i) is x's row i (rows x_stride floats apart) for i < R, else row i - R of conv_states ([segments x
 * (d_conv - 1), d] contiguous: each segment's inputs before its root). Then each kept row's conv state after it (its
 * window's last d_conv - 1 inputs) goes to history [K, d_conv - 1, d]. Where `silu`, out is SiLU of the sums (the
 * layer's activation, while the row is in cache). A row's outputs are the same operations in the same order whatever
 * the other rows; threads take whole rows. */
void ssm_tree_conv(int R, int d, int d_conv, const float *restrict x, int64_t x_stride,
                   const float *restrict conv_states, const int64_t *restrict windows,
                   const float *restrict weight_t, const float *restrict bias, int silu, float *restrict out, int K,
                   const int64_t *restrict keep_rows, float *restrict history) {
    const int threads = threads_for_macs((int64_t)R * d * d_conv * 4);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int r = 0; r < R; r++) {
        float *restrict o = out + (int64_t)r * d;
        for (int k = 0; k < d_conv; k++) {
            const int64_t i = windows[(int64_t)r * d_conv + k];
            const float *restrict in = i < R ? x + i * x_stride : conv_states + (i - R) * d;
            const float *restrict wk = weight_t + (int64_t)k * d;
            if (k == 0)
                for (int c = 0; c < d; c++) o[c] = in[c] * wk[c];
            else
                for (int c = 0; c < d; c++) o[c] = sfma(in[c], wk[c], o[c]);
        }
        if (bias)
            for (int c = 0; c < d; c++) o[c] += bias[c];
        if (silu)
            for (int c = 0; c < d; c += LANES) {
                const int w = d - c < LANES ? d - c : LANES;
                store_lanes(o + c, vsilu(load_lanes(o + c, w)), w);
            }
    }
    for (int k = 0; k < K; k++)
        for (int j = 1; j < d_conv; j++) {
            const int64_t i = windows[keep_rows[k] * d_conv + j];
            memcpy(history + ((int64_t)k * (d_conv - 1) + j - 1) * d, i < R ? x + i * x_stride : conv_states + (i - R) * d,
                   sizeof(float) * (size_t)d);
        }
}
