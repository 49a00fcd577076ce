/* Native CPU kernels (float32): the Mamba drafter's forward over a few state rows and tokens (a drafting step, a
 * catch-up on accepted tokens) and the prefill's selective scan; its products are gemm_cpu.c's.
 *
 * Why: a drafter step in torch is ~100 small ops (4 layers x ~20, then the head), each a few microseconds of
 * dispatch for a few thousand multiply-adds, so on CPU the step is bound by overhead, not arithmetic or memory. Here
 * the step is one call; the prefill's scan (sequential over tokens) runs one 16-wide vector per channel and token
 * instead of one torch op per token.
 *
 * The math is the torch path's (ray_specdec/models/mamba_drafter.py), operation for operation; sums are reassociated
 * (-ffast-math), so results agree to float32 rounding, not bit for bit. For the drafter that is enough: its drafts
 * only change acceptance; the target verifies every token. Products and the scan split their work over up to
 * torch's intra-op thread count (set from Python) when built with -fopenmp. Built at first use by native/__init__.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "gemm_cpu.h"

typedef struct {
    const float *norm;          /* [d_model] */
    const void *in_proj;        /* [2 d_inner, d_model]: every matrix as panels (see gemm_rows), format below */
    const float *in_proj_bias;  /* [2 d_inner] or NULL */
    const float *conv;          /* [d_inner, d_conv] */
    const float *conv_bias;     /* [d_inner] or NULL */
    const void *x_proj;         /* [dt_rank + 2 d_state, d_inner] */
    const void *dt_proj;        /* [d_inner, dt_rank] */
    const float *dt_bias;       /* [d_inner] */
    const float *A;             /* [d_inner, d_state]: -exp(A_log) */
    const float *D;             /* [d_inner] */
    const void *out_proj;       /* [d_model, d_inner] */
    const float *out_proj_bias; /* [d_model] or NULL */
    int32_t in_proj_format, x_proj_format, dt_proj_format, out_proj_format; /* PANEL_* of gemm_cpu.h */
} layer_t;

typedef struct {
    int32_t n_layers, d_model, d_inner, d_conv, d_state, dt_rank, vocab;
    float eps;
    const float *embed;   /* [vocab, d_model] */
    const float *norm_f;  /* [d_model] */
    const void *lm_head;  /* [vocab, d_model] as panels */
    const layer_t *layers;
    int32_t lm_head_format;
} model_t;

/* HF MambaRMSNorm: x * rsqrt(mean(x^2) + eps) * w, in float32. */
static void rms_norm(int rows, int d, const float *restrict x, const float *restrict w, float eps,
                     float *restrict out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * d;
        float ss = 0.0f;
        for (int i = 0; i < d; i++) ss += xr[i] * xr[i];
        float scale = 1.0f / sqrtf(ss / (float)d + eps);
        for (int i = 0; i < d; i++) out[(int64_t)r * d + i] = xr[i] * scale * w[i];
    }
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* torch's softplus (beta 1, threshold 20). */
static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* Rows of state, each with tokens of its own, through every layer, then the head at each row's last token.
 * Row r takes tokens[offsets[r] .. offsets[r + 1]) (at least one; offsets[0] = 0) and advances its own state in
 * place: its conv state for layer l is conv_rows[r] + l * conv_layer_stride ([d_inner, d_conv], oldest input first),
 * its ssm state ssm_rows[r] + l * ssm_layer_stride ([d_inner, d_state]); logits [R, vocab]. A drafting step is one
 * token per row (per tree node); a commit's catch-up is every drafting request's accepted and bonus tokens, their
 * states wherever they live (slots of a pool, states of their own), in one call that reads the weights once.
 *
 * The projections run over all tokens at once (gemm_rows: each row's bits whatever rows share the call); the conv and
 * the scan go token by token, each (row, channel) on one thread, channels split over threads. So a row gets the same
 * bits whatever other rows share the call and however many threads run it. Returns 0, or -1 when out of memory
 * (nothing is changed then). */
int mamba_forward_rows(const model_t *m, int R, const int64_t *offsets, const int64_t *tokens, float *const *conv_rows,
                       float *const *ssm_rows, int64_t conv_layer_stride, int64_t ssm_layer_stride, float *logits) {
    const int dm = m->d_model, di = m->d_inner, dc = m->d_conv, N = m->d_state, dr = m->dt_rank;
    const int nx = dr + 2 * N, rows = (int)offsets[R];
    float *buf = malloc(sizeof(float) * (size_t)rows * (2 * dm + 2 * di + nx + 2 * di));
    if (!buf) return -1;
    float *residual = buf, *h = residual + (size_t)rows * dm, *xz = h + (size_t)rows * dm;
    float *xdbl = xz + (size_t)rows * 2 * di, *dt = xdbl + (size_t)rows * nx, *y = dt + (size_t)rows * di;
    /* the conv and the scan: ~16 multiply-adds and exponentials per channel and state element (8 for the weights) */
    const int threads = threads_for_macs((int64_t)rows * di * N * 8);
    const int64_t channels = (int64_t)R * di;

    for (int t = 0; t < rows; t++)
        for (int i = 0; i < dm; i++) residual[(size_t)t * dm + i] = m->embed[tokens[t] * dm + i];

    for (int l = 0; l < m->n_layers; l++) {
        const layer_t *w = &m->layers[l];
        rms_norm(rows, dm, residual, w->norm, m->eps, h);
        gemm_rows(w->in_proj_format, rows, 2 * di, dm, w->in_proj, w->in_proj_bias, h, dm, xz, 2 * di);
        /* depthwise causal conv over the window (the state's last d_conv - 1 inputs, then x), then SiLU; x in place */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t rc = 0; rc < channels; rc++) {
            const int r = (int)(rc / di), c = (int)(rc % di);
            float *cs = conv_rows[r] + l * conv_layer_stride + (int64_t)c * dc;
            for (int64_t t = offsets[r]; t < offsets[r + 1]; t++) {
                float *x = xz + (size_t)t * 2 * di;
                for (int k = 0; k + 1 < dc; k++) cs[k] = cs[k + 1];
                cs[dc - 1] = x[c];
                float acc = 0.0f;
                for (int k = 0; k < dc; k++) acc += cs[k] * w->conv[c * dc + k];
                if (w->conv_bias) acc += w->conv_bias[c];
                x[c] = acc;
            }
        }
        /* The SiLUs and the softplus over whole token rows, apart from the per-channel loops above and below, so that
         * they vectorise (libmvec's expf / log1pf, 8 or 16 lanes a call, against one scalar call per value inside
         * those loops); a row's values are computed the same way whatever rows share the call. */
        for (int t = 0; t < rows; t++) {
            float *x = xz + (size_t)t * 2 * di, *z = x + di;
            for (int c = 0; c < di; c++) x[c] = silu(x[c]);
            for (int c = 0; c < di; c++) z[c] = silu(z[c]);
        }
        gemm_rows(w->x_proj_format, rows, nx, di, w->x_proj, NULL, xz, 2 * di, xdbl, nx);
        gemm_rows(w->dt_proj_format, rows, di, dr, w->dt_proj, w->dt_bias, xdbl, nx, dt, di);
        for (int t = 0; t < rows; t++)
            for (int c = 0; c < di; c++) dt[(size_t)t * di + c] = softplus(dt[(size_t)t * di + c]);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t rc = 0; rc < channels; rc++) {
            const int r = (int)(rc / di), c = (int)(rc % di);
            float *ss = ssm_rows[r] + l * ssm_layer_stride + (int64_t)c * N;
            const float *A = w->A + c * N;
            for (int64_t t = offsets[r]; t < offsets[r + 1]; t++) {
                const float *x = xz + (size_t)t * 2 * di, *z = x + di, *B = xdbl + (size_t)t * nx + dr, *C = B + N;
                const float d = dt[(size_t)t * di + c], dx = d * x[c]; /* z: SiLU(z) and dt: softplus(dt) by now */
                float acc = 0.0f;
                for (int n = 0; n < N; n++) {
                    ss[n] = ss[n] * expf(d * A[n]) + dx * B[n];
                    acc += ss[n] * C[n];
                }
                y[(size_t)t * di + c] = (acc + x[c] * w->D[c]) * z[c];
            }
        }
        gemm_rows(w->out_proj_format, rows, dm, di, w->out_proj, w->out_proj_bias, y, di, h, dm);
        for (size_t i = 0; i < (size_t)rows * dm; i++) residual[i] += h[i];
    }
    for (int r = 0; r < R; r++)  /* the head at each row's last token */
        rms_norm(1, dm, residual + (size_t)(offsets[r + 1] - 1) * dm, m->norm_f, m->eps, h + (size_t)r * dm);
    gemm_rows(m->lm_head_format, R, m->vocab, dm, m->lm_head, NULL, h, dm, logits, m->vocab);
    free(buf);
    return 0;
}

/* S tokens for each of R state rows (tokens [R, S]; conv_state [n_layers, R, d_inner, d_conv] and ssm_state
 * [n_layers, R, d_inner, d_state]): mamba_forward_rows over rows of one state. */
int mamba_forward(const model_t *m, int R, int S, const int64_t *tokens, float *conv_state, float *ssm_state,
                  float *logits) {
    int64_t *offsets = malloc(sizeof(int64_t) * (size_t)(R + 1));
    float **rows = malloc(sizeof(float *) * (size_t)(2 * R));
    int status = -1;
    if (offsets && rows) {
        const int64_t conv_row = (int64_t)m->d_inner * m->d_conv, ssm_row = (int64_t)m->d_inner * m->d_state;
        for (int r = 0; r <= R; r++) offsets[r] = (int64_t)r * S;
        for (int r = 0; r < R; r++) {
            rows[r] = conv_state + r * conv_row;
            rows[R + r] = ssm_state + r * ssm_row;
        }
        status = mamba_forward_rows(m, R, offsets, tokens, rows, rows + R, R * conv_row, R * ssm_row, logits);
    }
    free(offsets);
    free(rows);
    return status;
}

/* The selective scan over S tokens: state[c] <- state[c] * exp(dt[t, c] A[c]) + dt[t, c] x[t, c] B[t];
 * y[t, c] = C[t] . state[c]  (before the D skip and the gate, as the torch path's _scan_block). dt (after softplus)
 * and x: [S, d_inner]; B, C: [S, N]; A: [d_inner, N]; state [d_inner, N] carried in and out; y [S, d_inner].
 * Channels are independent: each thread scans its own contiguous range of them over every token. */
void mamba_scan(int S, int d_inner, int N, const float *restrict dt, const float *restrict x, const float *restrict B,
                const float *restrict C, const float *restrict A, float *restrict state, float *restrict y) {
    const int threads = threads_for_macs((int64_t)S * d_inner * N);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int c0 = 0, c1 = d_inner;
#ifdef _OPENMP
        const int per = (d_inner + omp_get_num_threads() - 1) / omp_get_num_threads();
        c0 = per * omp_get_thread_num();
        c1 = c0 + per < d_inner ? c0 + per : d_inner;
#endif
        for (int64_t t = 0; t < S; t++) {
            const float *Bt = B + t * N, *Ct = C + t * N;
            for (int c = c0; c < c1; c++) {
                const float d = dt[t * d_inner + c], dx = d * x[t * d_inner + c];
                const float *Ac = A + (int64_t)c * N;
                float *s = state + (int64_t)c * N;
                float acc = 0.0f;
                for (int n = 0; n < N; n++) {
                    s[n] = s[n] * expf(d * Ac[n]) + dx * Bt[n];
                    acc += s[n] * Ct[n];
                }
                y[t * d_inner + c] = acc;
            }
        }
    }
}
