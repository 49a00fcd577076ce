/* Native CPU kernels (float32): the Mamba drafter's forward over a few state rows and tokens (a drafting step, a
 * catch-up on accepted tokens), the prefill's selective scan, and the few-row GEMM behind cpu_gemm's "native" path.
 *
 * Why: a drafter step in torch is ~100 small ops (4 layers x ~20, then the head), each a few microseconds of
 * dispatch for a few thousand multiply-adds, so on CPU the step is bound by overhead, not arithmetic or memory. Here
 * the step is one call; the prefill's scan (sequential over tokens) runs one 16-wide vector per channel and token
 * instead of one torch op per token; and a product of 1-64 rows with a weight keeps its accumulators in registers
 * while a packed copy of the weight streams past, where MKL's few-row paths are far from the memory bound.
 *
 * The math is the torch path's (ray_specdec/models/mamba_drafter.py), operation for operation; sums are reassociated
 * (-ffast-math), so results agree to float32 rounding, not bit for bit. For the drafter that is enough: its drafts
 * only change acceptance; the target verifies every token. For the target it is one more float32 summation order,
 * as between any two GEMM kernels. Products and the scan split their work over up to `max_threads` OpenMP threads
 * (torch's intra-op count, set from Python) when built with -fopenmp. Built at first use by native/__init__.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct {
    const float *norm;          /* [d_model] */
    const float *in_proj;       /* [2 d_inner, d_model]: every matrix as panels (see gemm_rows) */
    const float *in_proj_bias;  /* [2 d_inner] or NULL */
    const float *conv;          /* [d_inner, d_conv] */
    const float *conv_bias;     /* [d_inner] or NULL */
    const float *x_proj;        /* [dt_rank + 2 d_state, d_inner] */
    const float *dt_proj;       /* [d_inner, dt_rank] */
    const float *dt_bias;       /* [d_inner] */
    const float *A;             /* [d_inner, d_state]: -exp(A_log) */
    const float *D;             /* [d_inner] */
    const float *out_proj;      /* [d_model, d_inner] */
    const float *out_proj_bias; /* [d_model] or NULL */
} layer_t;

typedef struct {
    int32_t n_layers, d_model, d_inner, d_conv, d_state, dt_rank, vocab;
    float eps;
    const float *embed;   /* [vocab, d_model] */
    const float *norm_f;  /* [d_model] */
    const float *lm_head; /* [vocab, d_model] as panels */
    const layer_t *layers;
} model_t;

/* 16 floats in one vector register (GCC / Clang vector extension), loadable from any float address. */
typedef float vf16 __attribute__((vector_size(64), aligned(4)));
#define LANES 16

/* One register block of gemm_rows: NR rows x NV vectors of outputs, accumulated over all n_in inputs in registers.
 * Called with constant NR and NV, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void gemm_block(
    const int NR, const int NV, int n_in, int n_out, const float *restrict P, const float *restrict bias,
    const float *restrict x, int x_stride, float *restrict y, int y_stride) {
    (void)n_out;
    vf16 acc[4][4];
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) {
            vf16 b = {0};
            if (bias) b = *(const vf16 *)(bias + v * LANES);
            acc[r][v] = b;
        }
    for (int i = 0; i < n_in; i++) {
        const float *w = P + (int64_t)i * NV * LANES;
        vf16 wv[4];
        for (int v = 0; v < NV; v++) wv[v] = *(const vf16 *)(w + v * LANES);
        for (int r = 0; r < NR; r++) {
            const float xi = x[(int64_t)r * x_stride + i];
            for (int v = 0; v < NV; v++) acc[r][v] += xi * wv[v];
        }
    }
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) *(vf16 *)(y + (int64_t)r * y_stride + v * LANES) = acc[r][v];
}

#define GEMM_BLOCK(NR, NV) gemm_block(NR, NV, n_in, n_out, P + (int64_t)o * n_in, bias ? bias + o : NULL, xr, x_stride, yr + o, \
                                      y_stride)
#define FOR_ROWS(NV)                                          \
    switch (nr) {                                             \
        case 1: GEMM_BLOCK(1, NV); break;                     \
        case 2: GEMM_BLOCK(2, NV); break;                     \
        case 3: GEMM_BLOCK(3, NV); break;                     \
        default: GEMM_BLOCK(4, NV); break;                    \
    }

/* y[r] = x[r] @ W^T (+ bias) for rows r, W [n_out, in] given as panels P (see pack_panels in native/__init__.py):
 * the columns of W^T ([n_in, n_out]) cut into blocks of 64 outputs, then of 16, then the rest, each block stored
 * [n_in, width] contiguously, one after the other; so block o starts at P + o * n_in and is read front to back. Up
 * to 4 rows by 64 outputs accumulate in registers while a panel streams past. (A dot product per output over the
 * weight's own layout chains every multiply-add of a row into one accumulator and was latency-bound: ~4x slower.) */
static void gemm_rows_mt(int rows, int n_out, int n_in, const float *restrict P, const float *restrict bias,
                         const float *restrict x, int x_stride, float *restrict y, int y_stride, int threads) {
    const int n64 = n_out / 64, n16 = (n_out - 64 * n64) / 16, tail = n_out - 64 * n64 - 16 * n16;
    const int blocks = n64 + n16 + (tail > 0);
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && blocks > 1)
    for (int b = 0; b < blocks; b++) {
        const int o = b < n64 ? 64 * b : 64 * n64 + 16 * (b - n64);
        for (int r0 = 0; r0 < rows; r0 += 4) {
            const int nr = rows - r0 < 4 ? rows - r0 : 4;
            const float *xr = x + (int64_t)r0 * x_stride;
            float *yr = y + (int64_t)r0 * y_stride;
            if (b < n64) {
                FOR_ROWS(4)
            } else if (b < n64 + n16) {
                FOR_ROWS(1)
            } else {
                const float *pt = P + (int64_t)o * n_in;
                for (int j = 0; j < tail; j++)
                    for (int r = 0; r < nr; r++) {
                        float acc = bias ? bias[o + j] : 0.0f;
                        for (int i = 0; i < n_in; i++) acc += xr[(int64_t)r * x_stride + i] * pt[(int64_t)i * tail + j];
                        yr[(int64_t)r * y_stride + o + j] = acc;
                    }
            }
        }
    }
}

/* Threads for a product of this many multiply-adds: more only where waking them pays (set by native/__init__.py). */
static int parallel_min_macs = 1 << 19;
static int max_threads = 1;

void set_threads(int threads, int min_macs) {
    max_threads = threads;
    parallel_min_macs = min_macs;
}

static void gemm_rows(int rows, int n_out, int n_in, const float *restrict P, const float *restrict bias,
                      const float *restrict x, int x_stride, float *restrict y, int y_stride) {
    const int threads = (int64_t)rows * n_out * n_in >= parallel_min_macs ? max_threads : 1;
    gemm_rows_mt(rows, n_out, n_in, P, bias, x, x_stride, y, y_stride, threads);
}

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

/* S tokens for each of R state rows through every layer, then the head at each row's last token.
 * tokens [R, S]; conv_state [n_layers, R, d_inner, d_conv] (oldest input first) and ssm_state
 * [n_layers, R, d_inner, d_state] advance in place by S tokens; logits [R, vocab]. A drafting step is S = 1 (one
 * token per tree node); a catch-up on accepted tokens is R = 1. The projections run over all R x S tokens at once;
 * the conv and the scan go token by token. Returns 0, or -1 when out of memory (nothing is changed then). */
int mamba_forward(const model_t *m, int R, int S, const int64_t *tokens, float *conv_state, float *ssm_state,
                  float *logits) {
    const int dm = m->d_model, di = m->d_inner, dc = m->d_conv, N = m->d_state, dr = m->dt_rank;
    const int nx = dr + 2 * N, rows = R * S;
    float *buf = malloc(sizeof(float) * (size_t)rows * (2 * dm + 2 * di + nx + 2 * di));
    if (!buf) return -1;
    float *residual = buf, *h = residual + (size_t)rows * dm, *xz = h + (size_t)rows * dm;
    float *xdbl = xz + (size_t)rows * 2 * di, *dt = xdbl + (size_t)rows * nx, *y = dt + (size_t)rows * di;

    for (int t = 0; t < rows; t++)
        for (int i = 0; i < dm; i++) residual[(size_t)t * dm + i] = m->embed[tokens[t] * dm + i];

    for (int l = 0; l < m->n_layers; l++) {
        const layer_t *w = &m->layers[l];
        rms_norm(rows, dm, residual, w->norm, m->eps, h);
        gemm_rows(rows, 2 * di, dm, w->in_proj, w->in_proj_bias, h, dm, xz, 2 * di);
        /* depthwise causal conv over the window (the state's last d_conv - 1 inputs, then x), then SiLU; x in place */
        for (int r = 0; r < R; r++) {
            float *cs = conv_state + ((size_t)(l * R + r) * di) * dc;
            for (int c = 0; c < di; c++, cs += dc)
                for (int t = r * S; t < (r + 1) * S; t++) {
                    float *x = xz + (size_t)t * 2 * di;
                    for (int k = 0; k + 1 < dc; k++) cs[k] = cs[k + 1];
                    cs[dc - 1] = x[c];
                    float acc = 0.0f;
                    for (int k = 0; k < dc; k++) acc += cs[k] * w->conv[c * dc + k];
                    if (w->conv_bias) acc += w->conv_bias[c];
                    x[c] = silu(acc);
                }
        }
        gemm_rows(rows, nx, di, w->x_proj, NULL, xz, 2 * di, xdbl, nx);
        gemm_rows(rows, di, dr, w->dt_proj, w->dt_bias, xdbl, nx, dt, di);
        for (int r = 0; r < R; r++) {
            float *state = ssm_state + ((size_t)(l * R + r) * di) * N;
            for (int t = r * S; t < (r + 1) * S; t++) {
                const float *x = xz + (size_t)t * 2 * di, *z = x + di, *B = xdbl + (size_t)t * nx + dr, *C = B + N;
                float *ss = state;
                for (int c = 0; c < di; c++, ss += N) {
                    const float d = softplus(dt[(size_t)t * di + c]), dx = d * x[c];
                    const float *A = w->A + c * N;
                    float acc = 0.0f;
                    for (int n = 0; n < N; n++) {
                        ss[n] = ss[n] * expf(d * A[n]) + dx * B[n];
                        acc += ss[n] * C[n];
                    }
                    y[(size_t)t * di + c] = (acc + x[c] * w->D[c]) * silu(z[c]);
                }
            }
        }
        gemm_rows(rows, dm, di, w->out_proj, w->out_proj_bias, y, di, h, dm);
        for (size_t i = 0; i < (size_t)rows * dm; i++) residual[i] += h[i];
    }
    for (int r = 0; r < R; r++)  /* the head at each row's last token */
        rms_norm(1, dm, residual + ((size_t)r * S + S - 1) * dm, m->norm_f, m->eps, h + (size_t)r * dm);
    gemm_rows(R, m->vocab, dm, m->lm_head, NULL, h, dm, logits, m->vocab);
    free(buf);
    return 0;
}

/* The selective scan over S tokens: state[c] <- state[c] * exp(dt[t, c] A[c]) + dt[t, c] x[t, c] B[t];
 * y[t, c] = C[t] . state[c]  (before the D skip and the gate, as the torch path's _scan_block). dt (after softplus)
 * and x: [S, d_inner]; B, C: [S, N]; A: [d_inner, N]; state [d_inner, N] carried in and out; y [S, d_inner].
 * Channels are independent: each thread scans its own contiguous range of them over every token. */
void mamba_scan(int S, int d_inner, int N, const float *restrict dt, const float *restrict x, const float *restrict B,
                const float *restrict C, const float *restrict A, float *restrict state, float *restrict y) {
    const int threads = (int64_t)S * d_inner * N >= parallel_min_macs ? max_threads : 1;
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

/* y [rows, n_out] = x [rows, n_in] @ W^T (+ bias), W given as panels (pack_panels): a Linear layer's product for
 * a few rows (cpu_gemm's "native" path). */
void linear_panels(int rows, int n_out, int n_in, const float *P, const float *bias, const float *x, float *y) {
    gemm_rows(rows, n_out, n_in, P, bias, x, n_in, y, n_out);
}
