/* Native CPU decoder layers (float32): every layer of a GPTNeoX or Llama target over a verify step's rows in one
 * call, for the batch-invariant lean forward (models/lean_forward.py, models/batch_invariant.py).
 *
 * Why: a verify step at one request is one row, and a layer's torch ops for it (two norms, the rotary's slices and
 * concatenations, the activation, the residual sums, the reshapes around four products and the attention) are ~40
 * calls of a few microseconds each: measured on the 2-core machine, a one-row forward of the shipped 6-layer target
 * took 2.35 ms, of which the products and the attention (native already) were ~1.1 ms. Here a layer is its products
 * (gemm_cpu.c), its attention (attention_cpu.c's tree_attention_ragged) and the elementwise work between them in C.
 *
 * Batch invariance: every row's norm, rotary, activation and residual sum is computed by one thread in a fixed order
 * whatever the number of rows and however rows are split over threads; products and attention are invariant already
 * (see their files). So a row gets the same bits alone or beside any other rows, as the torch ops give. The bits are
 * not the torch ops' own (the norms' sums and erf / exp are C's, with -ffast-math): results agree with the torch path
 * to float32 rounding.
 *
 * The math is HF's for each family, operation for operation:
 * - GPTNeoX: LayerNorm (weight, bias); one fused QKV product whose output holds, per head, q, k and v of head_dim
 *   each; rotary on the first `rotary` dims of each head (rotate-half form); the dense product; MLP gelu (erf form);
 *   parallel residual (mlp(ln2(x)) + attn + x) or sequential.
 * - Llama: RMSNorm (weight); q, k, v products into one buffer [q of H heads | k of Hkv | v of Hkv]; full or partial
 *   rotary; o_proj; down(silu(gate) * up); sequential residual.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_cpu.h"

/* attention_cpu.c */
int tree_attention_ragged(int n, const int64_t *table, int H, int Hkv, int D, float scale, const float *q,
                          int64_t q_sh, int64_t q_ss, const float *kn, int64_t kn_sh, int64_t kn_ss, const float *vn,
                          int64_t vn_sh, int64_t vn_ss, float *out, int threads);

/* Values of decoder_t's kind fields (the Python side's DecoderModel fills them). */
enum { NORM_LAYER = 0, NORM_RMS = 1 };
enum { MLP_GELU = 0, MLP_SILU_GATED = 1 };

/* One layer's weights: matrices as panels (gemm_rows) with their formats; vectors float32; NULL where absent. */
typedef struct {
    const float *norm1_w, *norm1_b, *norm2_w, *norm2_b;
    const void *q, *k, *v; /* GPTNeoX: q is the fused QKV product, k and v NULL */
    const float *q_b, *k_b, *v_b;
    const void *o;
    const float *o_b;
    const void *up, *gate, *down; /* GPTNeoX: up = dense_h_to_4h, gate NULL, down = dense_4h_to_h */
    const float *up_b, *gate_b, *down_b;
    int32_t q_fmt, k_fmt, v_fmt, o_fmt, up_fmt, gate_fmt, down_fmt;
} decoder_layer_t;

typedef struct {
    int32_t n_layers, hidden, heads, kv_heads, head_dim, rotary, inter;
    int32_t norm, mlp, fused_qkv, parallel_residual;
    float eps, scale;
    const decoder_layer_t *layers;
} decoder_t;

/* Rows of elementwise work below which one thread does it (waking the other costs more). */
#define PARALLEL_MIN_ELEMENTS 32768

static void norm_rows(const decoder_t *m, int R, const float *restrict x, const float *restrict w,
                      const float *restrict b, float *restrict out, int threads) {
    const int E = m->hidden;
#pragma omp parallel for num_threads(threads) if (threads > 1 && (int64_t)R * E >= PARALLEL_MIN_ELEMENTS)
    for (int r = 0; r < R; r++) {
        const float *xr = x + (int64_t)r * E;
        float *o = out + (int64_t)r * E;
        if (m->norm == NORM_LAYER) {
            double sum = 0.0, sq = 0.0;
            for (int i = 0; i < E; i++) sum += xr[i];
            const float mean = (float)(sum / E);
            for (int i = 0; i < E; i++) {
                const float d = xr[i] - mean;
                sq += (double)d * d;
            }
            const float rstd = 1.0f / sqrtf((float)(sq / E) + m->eps);
            for (int i = 0; i < E; i++) o[i] = (xr[i] - mean) * rstd * w[i] + (b ? b[i] : 0.0f);
        } else {
            double sq = 0.0;
            for (int i = 0; i < E; i++) sq += (double)xr[i] * xr[i];
            const float rstd = 1.0f / sqrtf((float)(sq / E) + m->eps);
            for (int i = 0; i < E; i++) o[i] = w[i] * (xr[i] * rstd);
        }
    }
}

/* Rotate-half rotary on the first `rotary` dims of `heads` heads of one row, in place: x[h * sh .. + rotary). */
static inline void rotate(float *restrict x, int heads, int64_t sh, int rotary, const float *restrict cos,
                          const float *restrict sin) {
    const int half = rotary / 2;
    float first[half > 0 ? half : 1];
    for (int h = 0; h < heads; h++) {
        float *xh = x + h * sh;
        for (int i = 0; i < half; i++) first[i] = xh[i];
        for (int i = 0; i < half; i++) xh[i] = xh[i] * cos[i] + -xh[i + half] * sin[i];
        for (int i = half; i < rotary; i++) xh[i] = xh[i] * cos[i] + first[i - half] * sin[i];
    }
}

/* GELU's erf form as 0.5 x erfc(-x / sqrt 2), in double: 1 + erf(x / sqrt 2) cancels for negative x (at x = -3.5
 * float's erff leaves it a relative error of 1e-3), erfc does not, and libmvec's double erfc (a few double ulps on
 * every path it has: AVX-512, AVX2, SSE2, scalar) rounds to float within 1 ulp of the exact value, for every float
 * x whose GELU is a normal float. */
static inline float gelu(float x) {
    double d = x;
    return (float)(0.5 * d * erfc(-d * 0.70710678118654752440));
}
static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* y = gelu(x) (erf form) over R rows of I elements: the decoder's activation for the lean forward's torch ops
 * (batch_invariant.activate: prefill chunks, and verify rows where this decoder does not run). Each row is computed
 * by one thread with the same loop whatever R, so a row's bits do not depend on the rows beside it; where torch's
 * own kernel would need one thread for that (its threads split the elements, and elements past a split's last
 * whole vector take a scalar path that rounds differently), this uses them all: for the ~1,000 rows of a
 * continuous-batching step's prefill chunks on the 2-core machine, ~0.6 ms a layer against torch's 1.7 on one
 * thread. */
void gelu_rows(int R, int I, const float *x, float *y, int threads) { /* y may be x */
#pragma omp parallel for num_threads(threads) if (threads > 1 && (int64_t)R * I >= PARALLEL_MIN_ELEMENTS)
    for (int r = 0; r < R; r++)
        for (int i = 0; i < I; i++) y[(int64_t)r * I + i] = gelu(x[(int64_t)r * I + i]);
}

/* R rows through every layer: hidden [R, E] in place (the embeddings in, the last layer's output out); cos / sin
 * [R, rotary] per row (its position's); tables [n_layers, n_seg, 11]: each layer's segment table for
 * tree_attention_ragged (the rows' spans, their caches' buffers for that layer, their masks). Returns 0, or -1 when
 * out of memory. */
int decoder_layers(const decoder_t *m, int R, float *hidden, const float *cos, const float *sin, int n_seg,
                   const int64_t *tables, int threads) {
    if (R <= 0) return 0;
    const int E = m->hidden, H = m->heads, Hkv = m->kv_heads, D = m->head_dim, I = m->inter;
    const int W = (H + 2 * Hkv) * D; /* a row of the q, k, v buffer */
    const int gated = m->mlp == MLP_SILU_GATED;
    float *buf = malloc(sizeof(float) * (size_t)R * (3 * (size_t)E + W + (size_t)H * D + (gated ? 2 : 1) * (size_t)I));
    if (!buf) return -1;
    float *normed = buf, *attn = normed + (size_t)R * E, *mlp = attn + (size_t)R * E, *qkv = mlp + (size_t)R * E;
    float *ctx = qkv + (size_t)R * W, *up = ctx + (size_t)R * H * D, *gate = up + (size_t)R * I;
    /* Where q, k, v of a head sit in a row of qkv: fused (GPTNeoX: per head q, k, v) or split (all q, all k, all v). */
    const int64_t head_stride = m->fused_qkv ? 3 * D : D;
    const int64_t q_off = 0, k_off = m->fused_qkv ? D : (int64_t)H * D;
    const int64_t v_off = m->fused_qkv ? 2 * D : (int64_t)(H + Hkv) * D;
    const int64_t elements = (int64_t)R * W;
    int failed = 0;

    for (int l = 0; l < m->n_layers && !failed; l++) {
        const decoder_layer_t *w = &m->layers[l];
        norm_rows(m, R, hidden, w->norm1_w, w->norm1_b, normed, threads);
        if (m->fused_qkv) {
            gemm_rows(w->q_fmt, R, W, E, w->q, w->q_b, normed, E, qkv, W);
        } else {
            gemm_rows(w->q_fmt, R, H * D, E, w->q, w->q_b, normed, E, qkv + q_off, W);
            gemm_rows(w->k_fmt, R, Hkv * D, E, w->k, w->k_b, normed, E, qkv + k_off, W);
            gemm_rows(w->v_fmt, R, Hkv * D, E, w->v, w->v_b, normed, E, qkv + v_off, W);
        }
#pragma omp parallel for num_threads(threads) if (threads > 1 && elements >= PARALLEL_MIN_ELEMENTS)
        for (int r = 0; r < R; r++) {
            float *row = qkv + (int64_t)r * W;
            const float *c = cos + (int64_t)r * m->rotary, *s = sin + (int64_t)r * m->rotary;
            rotate(row + q_off, H, head_stride, m->rotary, c, s);
            rotate(row + k_off, Hkv, head_stride, m->rotary, c, s);
        }
        failed = tree_attention_ragged(n_seg, tables + (int64_t)l * n_seg * 11, H, Hkv, D, m->scale, qkv + q_off,
                                       head_stride, W, qkv + k_off, head_stride, W, qkv + v_off, head_stride, W,
                                       ctx, threads);
        gemm_rows(w->o_fmt, R, E, H * D, w->o, w->o_b, ctx, H * D, attn, E);
        /* The MLP's input: the layer's input (parallel residual) or the attention's output added to it. */
        float *x = hidden;
        if (!m->parallel_residual) {
            for (int64_t i = 0; i < (int64_t)R * E; i++) attn[i] = attn[i] + hidden[i];
            x = attn;
        }
        norm_rows(m, R, x, w->norm2_w, w->norm2_b, normed, threads);
        gemm_rows(w->up_fmt, R, I, E, w->up, w->up_b, normed, E, up, I);
        if (gated) {
            gemm_rows(w->gate_fmt, R, I, E, w->gate, w->gate_b, normed, E, gate, I);
#pragma omp parallel for num_threads(threads) if (threads > 1 && (int64_t)R * I >= PARALLEL_MIN_ELEMENTS)
            for (int r = 0; r < R; r++) {
                float *u = up + (int64_t)r * I;
                const float *g = gate + (int64_t)r * I;
                for (int i = 0; i < I; i++) u[i] = silu(g[i]) * u[i];
            }
        } else {
            gelu_rows(R, I, up, up, threads);
        }
        gemm_rows(w->down_fmt, R, E, I, w->down, w->down_b, up, I, mlp, E);
        if (m->parallel_residual)
            for (int64_t i = 0; i < (int64_t)R * E; i++) hidden[i] = mlp[i] + attn[i] + hidden[i];
        else
            for (int64_t i = 0; i < (int64_t)R * E; i++) hidden[i] = mlp[i] + attn[i];
    }
    free(buf);
    return failed ? -1 : 0;
}
