/* Native CPU kernels (float32): an SSM target layer's elementwise work over a forward's rows, each step fused into one
 * pass (native/ssm_rows.py binds them; models/target/ssm.py's torch path is the definition):
 *     ssm_rms_norm_rows  RMSNorm of each row: w * (x / sqrt(mean(x^2) + eps))        (a layer's input, the final norm)
 *     ssm_dt_rows        clamp(softplus(dt + bias), lo, hi) per head, repeated over its channels  (Mamba2; Mamba's dt)
 *     ssm_gate_rows      (y + x D) SiLU(z), then optionally RMSNorm per group of channels times a weight  (the gate)
 * (the SiLU after the conv is ssm_tree_conv's, ssm_scan_cpu.c).
 *
 * Why: in torch these are ~10 ops a layer, and a batch-invariant target runs them on one thread, so that torch's
 * vector / scalar-tail split of the flattened elements never depends on the row count. Here a row is the unit: one
 * thread computes a whole row, 16 lanes at a time with its last partial vector's missing lanes zero (load_lanes),
 * and its sums of squares in 16 lane accumulators added in a fixed tree. Every row has the same width, so every row takes
 * the same instructions whatever the row count, the other rows or the thread count (threads take whole rows): a
 * request's results are the same bits whatever shares its forward, and the rows run on all of torch's threads.
 * exp, SiLU and softplus are attention_simd_cpu.h's (a few ulp of the exact values). Rows are `*_stride` floats
 * apart, so column slices of a wider output (a projection's z, x or dt) are read where they lie.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention_simd_cpu.h"
#include "gemm_cpu.h"

#define LANES 16

/* Threads for R rows of d elements costing ~`cost` multiply-adds each (gemm_cpu.c's threshold for waking them). */
static int row_threads(int R, int d, int cost) { return threads_for_macs((int64_t)R * d * cost); }

/* The sum of squares of p[0 .. d): lane accumulators over 16-element steps, the tail's missing lanes zeros. */
static inline float sum_squares(const float *p, int d) {
    vf16 acc = {0};
    for (int c = 0; c < d; c += LANES) {
        const vf16 v = load_lanes(p + c, d - c < LANES ? d - c : LANES);
        acc = fma16(v, v, acc);
    }
    return sum_lanes(acc);
}

/* o[c] = w[c] * (x[c] * scale) for c < d (o may be x). */
static inline void scale_row(const float *x, int d, float scale, const float *restrict w, float *o) {
    for (int c = 0; c < d; c += LANES) {
        const int n = d - c < LANES ? d - c : LANES;
        store_lanes(o + c, load_lanes(w + c, n) * (load_lanes(x + c, n) * scale), n);
    }
}

/* out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), rows of d floats. */
void ssm_rms_norm_rows(int R, int d, const float *x, int64_t x_stride, const float *restrict w, float eps,
                       float *out, int64_t out_stride) {
    const int threads = row_threads(R, d, 4);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int r = 0; r < R; r++) {
        const float *xr = x + (int64_t)r * x_stride;
        scale_row(xr, d, 1.0f / sqrtf(sum_squares(xr, d) / (float)d + eps), w, out + (int64_t)r * out_stride);
    }
}

/* out[r, h * repeat + j] = min(max(softplus(dt[r, h] + bias[h]), lo), hi) for h < heads, j < repeat (bias NULL: 0;
 * lo, hi finite: fast math assumes no infinities). out's rows are heads * repeat floats apart. */
void ssm_dt_rows(int R, int heads, int repeat, const float *dt, int64_t dt_stride, const float *restrict bias,
                 float lo, float hi, float *restrict out) {
    const int width = heads * repeat, threads = row_threads(R, width, 2);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int r = 0; r < R; r++) {
        const float *dr = dt + (int64_t)r * dt_stride;
        float *o = out + (int64_t)r * width;
        for (int h = 0; h < heads; h += LANES) {
            const int n = heads - h < LANES ? heads - h : LANES;
            vf16 v = load_lanes(dr + h, n);
            if (bias) v += load_lanes(bias + h, n);
            const vf16 zero = {0};
            v = vmin(vmax(vsoftplus(v), zero + lo), zero + hi);
            if (repeat == 1)
                store_lanes(o + h, v, n);
            else
                for (int l = 0; l < n; l++)
                    for (int j = 0; j < repeat; j++) o[(int64_t)(h + l) * repeat + j] = v[l];
        }
    }
}

/* out[r] = (y[r] + x[r] D) SiLU(z[r]) over d channels; where norm is not NULL, then each group of `group` channels
 * (d a multiple of it) g -> norm * (g / sqrt(mean(g^2) + eps)) (Mamba2's gated RMSNorm). out may be y. */
void ssm_gate_rows(int R, int d, const float *y, int64_t y_stride, const float *x, int64_t x_stride,
                   const float *restrict D, const float *z, int64_t z_stride, const float *restrict norm, int group,
                   float eps, float *out, int64_t out_stride) {
    const int threads = row_threads(R, d, norm ? 10 : 8);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int r = 0; r < R; r++) {
        const float *yr = y + (int64_t)r * y_stride, *xr = x + (int64_t)r * x_stride, *zr = z + (int64_t)r * z_stride;
        float *o = out + (int64_t)r * out_stride;
        /* a group at a time (the whole row without a norm), so that its values are still in cache for the norm */
        const int span = norm ? group : d;
        for (int g0 = 0; g0 < d; g0 += span) {
            for (int c = g0; c < g0 + span; c += LANES) {
                const int n = g0 + span - c < LANES ? g0 + span - c : LANES;
                const vf16 skip = fma16(load_lanes(xr + c, n), load_lanes(D + c, n), load_lanes(yr + c, n));
                store_lanes(o + c, skip * vsilu(load_lanes(zr + c, n)), n);
            }
            if (norm)
                scale_row(o + g0, span, 1.0f / sqrtf(sum_squares(o + g0, span) / (float)span + eps), norm + g0,
                          o + g0);
        }
    }
}
