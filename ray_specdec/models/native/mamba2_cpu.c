/* Native CPU kernel (float32): the Mamba2 drafter's forward over a few state rows and tokens (a drafting step, a
 * catch-up on accepted tokens); its products are gemm_cpu.c's.
 *
 * Why: as for the Mamba drafter (mamba_cpu.c), a step in torch is ~100 small ops whose dispatch costs more than their
 * arithmetic; here it is one call. The math is ray_specdec/models/drafter/mamba2.py's torch path, per layer:
 *     RMSNorm -> in_proj -> (z, xBC, dt) -> causal depthwise conv of xBC -> SiLU -> dt = softplus(dt + dt_bias),
 *     clamped -> per head h and state element n, with B and C of the head's group g:
 *         state[c, n] = exp(dt[h] A[h]) state[c, n] + dt[h] x[c] B[g, n];  y[c] = sum_n C[g, n] state[c, n] + D[h] x[c]
 *     -> gated RMSNorm (y SiLU(z), normalised per group of channels, times its weight) -> out_proj -> residual
 * then norm_f and lm_head. Sums are reassociated (-ffast-math): results agree with torch's to float32 rounding.
 * dt_max is finite (FLT_MAX for no limit): fast math assumes no infinities.
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
    const void *in_proj;        /* [d_inner + conv_dim + heads, d_model] as panels, format below */
    const float *in_proj_bias;  /* or NULL */
    const float *conv;          /* [conv_dim, d_conv] */
    const float *conv_bias;     /* [conv_dim] or NULL */
    const float *dt_bias;       /* [heads] */
    const float *A;             /* [heads]: -exp(A_log) */
    const float *D;             /* [heads] */
    const float *gate_norm;     /* [d_inner] */
    const void *out_proj;       /* [d_model, d_inner] as panels */
    const float *out_proj_bias; /* [d_model] or NULL */
    int32_t in_proj_format, out_proj_format;
} mamba2_layer_t;

typedef struct {
    int32_t n_layers, d_model, d_inner, d_conv, d_state, heads, groups, vocab;
    float eps, gate_eps, dt_min, dt_max;
    const float *embed;  /* [vocab, d_model] */
    const float *norm_f; /* [d_model] */
    const void *lm_head; /* [vocab, d_model] as panels */
    const mamba2_layer_t *layers;
    int32_t lm_head_format;
} mamba2_model_t;

static void rms_norm(int rows, int d, const float *restrict x, const float *restrict w, float eps,
                          float *restrict out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * d;
        float ss = 0.0f;
        for (int i = 0; i < d; i++) ss += xr[i] * xr[i];
        const float scale = 1.0f / sqrtf(ss / (float)d + eps);
        for (int i = 0; i < d; i++) out[(int64_t)r * d + i] = xr[i] * scale * w[i];
    }
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* torch's softplus (beta 1, threshold 20). */
static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* R rows of state, row r taking tokens[offsets[r] .. offsets[r + 1]) (at least one) and advancing its own state in
 * place: its conv state for layer l at conv_rows[r] + l * conv_layer_stride ([conv_dim, d_conv], oldest input
 * first), its SSM state at ssm_rows[r] + l * ssm_layer_stride ([d_inner, d_state]); logits [R, vocab] at each row's
 * last token. Every (row, channel) of the conv and the scan runs on one thread, the products are gemm_rows' (a row's
 * bits whatever the rows beside it), and the per-token loops run over whole token rows: a row gets the same bits
 * whatever other rows share the call and however many threads run it. Returns 0, or -1 when out of memory (nothing
 * changed then). */
int mamba2_forward_rows(const mamba2_model_t *m, int R, const int64_t *offsets, const int64_t *tokens,
                        float *const *conv_rows, float *const *ssm_rows, int64_t conv_layer_stride,
                        int64_t ssm_layer_stride, float *logits) {
    const int dm = m->d_model, di = m->d_inner, dc = m->d_conv, N = m->d_state, H = m->heads, G = m->groups;
    const int conv_dim = di + 2 * G * N, P = di + conv_dim + H, rows = (int)offsets[R];
    const int head_dim = di / H, heads_per_group = H / G, group_size = di / G;
    float *buf = malloc(sizeof(float) * (size_t)rows * (2 * dm + P + di));
    if (!buf) return -1;
    float *residual = buf, *h = residual + (size_t)rows * dm, *proj = h + (size_t)rows * dm;
    float *y = proj + (size_t)rows * P;
    const int threads = threads_for_macs((int64_t)rows * di * N * 4);

    for (int t = 0; t < rows; t++)
        for (int i = 0; i < dm; i++) residual[(size_t)t * dm + i] = m->embed[tokens[t] * dm + i];

    for (int l = 0; l < m->n_layers; l++) {
        const mamba2_layer_t *w = &m->layers[l];
        rms_norm(rows, dm, residual, w->norm, m->eps, h);
        gemm_rows(w->in_proj_format, rows, P, dm, w->in_proj, w->in_proj_bias, h, dm, proj, P);
        /* the conv over each channel's window (the state's last d_conv - 1 inputs, then the token's), in place */
        const int64_t conv_channels = (int64_t)R * conv_dim;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t rc = 0; rc < conv_channels; rc++) {
            const int r = (int)(rc / conv_dim), c = (int)(rc % conv_dim);
            float *cs = conv_rows[r] + l * conv_layer_stride + (int64_t)c * dc;
            for (int64_t t = offsets[r]; t < offsets[r + 1]; t++) {
                float *xbc = proj + (size_t)t * P + di;
                for (int k = 0; k + 1 < dc; k++) cs[k] = cs[k + 1];
                cs[dc - 1] = xbc[c];
                float acc = 0.0f;
                for (int k = 0; k < dc; k++) acc += cs[k] * w->conv[c * dc + k];
                if (w->conv_bias) acc += w->conv_bias[c];
                xbc[c] = acc;
            }
        }
        /* SiLU of xBC and softplus of dt over whole token rows (vectorised; a row's values the same whatever rows) */
        for (int t = 0; t < rows; t++) {
            float *xbc = proj + (size_t)t * P + di, *dt = xbc + conv_dim;
            for (int c = 0; c < conv_dim; c++) xbc[c] = silu(xbc[c]);
            for (int hh = 0; hh < H; hh++) {
                const float d = softplus(dt[hh] + w->dt_bias[hh]);
                dt[hh] = d < m->dt_min ? m->dt_min : (d > m->dt_max ? m->dt_max : d);
            }
        }
        const int64_t channels = (int64_t)R * di;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t rc = 0; rc < channels; rc++) {
            const int r = (int)(rc / di), c = (int)(rc % di), hh = c / head_dim, g = hh / heads_per_group;
            float *ss = ssm_rows[r] + l * ssm_layer_stride + (int64_t)c * N;
            for (int64_t t = offsets[r]; t < offsets[r + 1]; t++) {
                const float *x = proj + (size_t)t * P + di, *B = x + di + g * N, *C = x + di + G * N + g * N;
                const float d = x[conv_dim + hh], decay = expf(d * w->A[hh]), dx = d * x[c];
                float acc = 0.0f;
                for (int n = 0; n < N; n++) {
                    ss[n] = ss[n] * decay + dx * B[n];
                    acc += ss[n] * C[n];
                }
                y[(size_t)t * di + c] = acc + w->D[hh] * x[c];
            }
        }
        /* gated RMSNorm per group of channels */
        for (int t = 0; t < rows; t++) {
            float *yt = y + (size_t)t * di;
            const float *z = proj + (size_t)t * P;
            for (int c = 0; c < di; c++) yt[c] *= silu(z[c]);
            for (int g = 0; g < G; g++) {
                float *yg = yt + (int64_t)g * group_size;
                float ss = 0.0f;
                for (int c = 0; c < group_size; c++) ss += yg[c] * yg[c];
                const float scale = 1.0f / sqrtf(ss / (float)group_size + m->gate_eps);
                for (int c = 0; c < group_size; c++) yg[c] = yg[c] * scale * w->gate_norm[g * group_size + c];
            }
        }
        gemm_rows(w->out_proj_format, rows, dm, di, w->out_proj, w->out_proj_bias, y, di, h, dm);
        for (size_t i = 0; i < (size_t)rows * dm; i++) residual[i] += h[i];
    }
    for (int r = 0; r < R; r++) /* the head at each row's last token */
        rms_norm(1, dm, residual + (size_t)(offsets[r + 1] - 1) * dm, m->norm_f, m->eps, h + (size_t)r * dm);
    gemm_rows(m->lm_head_format, R, m->vocab, dm, m->lm_head, NULL, h, dm, logits, m->vocab);
    free(buf);
    return 0;
}

/* S tokens for each of R state rows (tokens [R, S]; conv_state [n_layers, R, conv_dim, d_conv] and ssm_state
 * [n_layers, R, d_inner, d_state], contiguous): mamba2_forward_rows over the rows of one state. */
int mamba2_forward(const mamba2_model_t *m, int R, int S, const int64_t *tokens, float *conv_state, float *ssm_state,
                   float *logits) {
    int64_t *offsets = malloc(sizeof(int64_t) * (size_t)(R + 1));
    float **rows = malloc(sizeof(float *) * (size_t)(2 * R));
    int status = -1;
    if (offsets && rows) {
        const int64_t conv_row = (int64_t)(m->d_inner + 2 * m->groups * m->d_state) * m->d_conv;
        const int64_t ssm_row = (int64_t)m->d_inner * m->d_state;
        for (int r = 0; r <= R; r++) offsets[r] = (int64_t)r * S;
        for (int r = 0; r < R; r++) {
            rows[r] = conv_state + r * conv_row;
            rows[R + r] = ssm_state + r * ssm_row;
        }
        status = mamba2_forward_rows(m, R, offsets, tokens, rows, rows + R, R * conv_row, R * ssm_row, logits);
    }
    free(offsets);
    free(rows);
    return status;
}
