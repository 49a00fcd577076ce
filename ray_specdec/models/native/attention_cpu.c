/* Native CPU attention (float32) for a few query rows over a long KV cache: a verify forward's tree rows, a decode
 * step's one row.
 *
 * Why: torch's CPU sdpa kernel multiplies each query block with each key block as a small GEMM, which for a handful
 * of rows runs far from the memory bound; in a verify of 12 rows at 3k tokens of context, attention was ~2/3 of the
 * target's forward. Here each query head reads its keys and values once, in blocks that stay in cache, for all its
 * rows: scores, an online softmax (flash-attention style: a running max and sum per row, earlier sums rescaled when
 * the max grows) and the weighted sum of values.
 *
 * Semantics are sdpa's with an additive float mask: out = softmax(q k^T * scale + mask) v, per query head h over
 * key/value head h / (H / Hkv) (grouped-query attention). Masks must be finite (the caller clamps -inf to float32's
 * lowest value, as HF's own masks are), since -ffast-math assumes finite math. Sums are reassociated, so results
 * agree with torch to float32 rounding, not bit for bit. Built with mamba_cpu.c by native/__init__.py.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Keys per block: a block's keys and values (2 x 128 x D floats) and scores stay in cache while every row uses them. */
#define KEY_BLOCK 128
/* Keys whose scores accumulate at once (independent FMA chains, enough to hide the FMA latency). */
#define KEYS_AT_ONCE 8

typedef float vf16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));
typedef float vf8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));

/* Scratch floats one row group (at most 16 rows of size D) needs: queries d-major, a block's scores, the
 * unnormalised outputs, the rescale factors. */
static size_t scratch_floats(int D) { return (size_t)D * 16 + (size_t)KEY_BLOCK * 16 + (size_t)16 * D + 16; }

/* o[r] += sum_j p[j * p_stride + r] v[j] for rows [0, nr) of a group and one value column chunk [c, c + NV * 16):
 * up to 4 rows x NV vectors accumulate in registers while the block's value rows stream past. */
static inline __attribute__((always_inline)) void weighted_values(const int NV, int nr, int nb, int c, int D,
                                                                  const float *restrict p, int p_stride,
                                                                  const float *restrict v, int64_t v_ss,
                                                                  float *restrict o) {
    for (int r0 = 0; r0 < nr; r0 += 4) {
        const int rows = nr - r0 < 4 ? nr - r0 : 4;
        vf16 acc[4][4];
        for (int r = 0; r < 4; r++)
            for (int x = 0; x < NV; x++)
                acc[r][x] = r < rows ? *(const vf16 *)(o + (int64_t)(r0 + r) * D + c + 16 * x) : (vf16){0};
        for (int j = 0; j < nb; j++) {
            const float *vj = v + (int64_t)j * v_ss + c;
            vf16 vv[4];
            for (int x = 0; x < NV; x++) vv[x] = *(const vf16 *)(vj + 16 * x);
            const float *pj = p + (int64_t)j * p_stride + r0;
            for (int r = 0; r < 4; r++)
                for (int x = 0; x < NV; x++) acc[r][x] += pj[r] * vv[x];
        }
        for (int r = 0; r < rows; r++)
            for (int x = 0; x < NV; x++) *(vf16 *)(o + (int64_t)(r0 + r) * D + c + 16 * x) = acc[r][x];
    }
}

#define RL 16
#define VR vf16
#define VRI vi16
#define FN(name) name##_16
#include "attention_rows.h"
#undef RL
#undef VR
#undef VRI
#undef FN
#define RL 8
#define VR vf8
#define VRI vi8
#define FN(name) name##_8
#include "attention_rows.h"

/* out [S, H, D] (contiguous) = attention of S query rows per head. q: [H, S, D] with strides (q_sh, q_ss, 1); k, v:
 * [Hkv, L, D] with strides (k_sh, k_ss, 1) and (v_sh, v_ss, 1); mask: additive [S, L] per head (stride m_sh, 0 when
 * one mask serves every head) with row stride m_ss, or NULL. Heads are split over `threads` OpenMP threads, in
 * contiguous runs so that the heads sharing a key/value head mostly share a thread. Returns 0, or -1 when scratch
 * memory could not be allocated (out is then unspecified). */
int tree_attention(int S, int H, int Hkv, int L, int D, float scale, const float *q, int64_t q_sh, int64_t q_ss,
                   const float *k, int64_t k_sh, int64_t k_ss, const float *v, int64_t v_sh, int64_t v_ss,
                   const float *mask, int64_t m_sh, int64_t m_ss, float *out, int threads) {
    const int group = H / Hkv;
    int failed = 0;
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1 && H > 1) reduction(| : failed)
    {
        float *buf = aligned_alloc(64, (scratch_floats(D) * sizeof(float) + 63) / 64 * 64);
        /* Every thread reaches the worksharing loop, even one without scratch (it then only records the failure). */
#pragma omp for schedule(static)
        for (int h = 0; h < H; h++) {
            if (!buf) {
                failed = 1;
                continue;
            }
            const int kv = h / group;
            /* Row groups of 16, a last group of at most 8 rows in 8-lane vectors. */
            for (int g = 0; g < S; g += 16) {
                const int nr = S - g < 16 ? S - g : 16;
                (nr <= 8 ? head_attention_8 : head_attention_16)(
                    nr, L, D, scale, q + h * q_sh + g * q_ss, q_ss, k + kv * k_sh, k_ss, v + kv * v_sh, v_ss,
                    mask ? mask + h * m_sh + g * m_ss : NULL, m_ss, out + ((int64_t)g * H + h) * D, (int64_t)H * D,
                    buf);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* Fields of one segment's row in tree_attention_ragged's table (int64 each). */
enum { SEG_S, SEG_L, SEG_ROW, SEG_K, SEG_K_SH, SEG_K_SS, SEG_V, SEG_V_SH, SEG_V_SS, SEG_M, SEG_M_SS, SEG_FIELDS };

/* Every request's verify rows of one layer in one call: a continuous-batching step has tens of requests, and one
 * call per request and layer cost more in Python than the attention itself.
 *
 * Segment i (table row i) owns query rows [row, row + S) of q [H, R, D] (strides q_sh, q_ss, 1) and a cache of
 * L keys and values (L includes its S new rows): k, v [Hkv, capacity, D] with strides (k_sh, k_ss, 1), (v_sh, v_ss,
 * 1) and an additive mask [S, L] (row stride m_ss; 0 pointer: none). First every segment's new keys and values, rows
 * [row, row + S) of kn / vn [Hkv, R, D], are written to its cache rows [L - S, L); then each (segment, head) runs
 * exactly what tree_attention runs for that head, so every row gets the bits it gets from a call of its own
 * segment. out [R, H, D]. Returns 0, or -1 when scratch memory could not be allocated. */
int tree_attention_ragged(int n, const int64_t *table, int H, int Hkv, int D, float scale, const float *q,
                          int64_t q_sh, int64_t q_ss, const float *kn, int64_t kn_sh, int64_t kn_ss, const float *vn,
                          int64_t vn_sh, int64_t vn_ss, float *out, int threads) {
    const int group = H / Hkv;
    int failed = 0;
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1 && n * H > 1) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int t = 0; t < n * Hkv; t++) {
            const int64_t *seg = table + (int64_t)(t / Hkv) * SEG_FIELDS;
            const int kv = t % Hkv, S = (int)seg[SEG_S], L = (int)seg[SEG_L], row = (int)seg[SEG_ROW];
            float *k = (float *)(intptr_t)seg[SEG_K] + kv * seg[SEG_K_SH];
            float *v = (float *)(intptr_t)seg[SEG_V] + kv * seg[SEG_V_SH];
            for (int s = 0; s < S; s++) {
                memcpy(k + (int64_t)(L - S + s) * seg[SEG_K_SS], kn + kv * kn_sh + (int64_t)(row + s) * kn_ss,
                       sizeof(float) * D);
                memcpy(v + (int64_t)(L - S + s) * seg[SEG_V_SS], vn + kv * vn_sh + (int64_t)(row + s) * vn_ss,
                       sizeof(float) * D);
            }
        }
        float *buf = aligned_alloc(64, (scratch_floats(D) * sizeof(float) + 63) / 64 * 64);
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < n * H; t++) {
            if (!buf) {
                failed = 1;
                continue;
            }
            const int64_t *seg = table + (int64_t)(t / H) * SEG_FIELDS;
            const int h = t % H, kv = h / group, S = (int)seg[SEG_S], L = (int)seg[SEG_L], row = (int)seg[SEG_ROW];
            const float *k = (const float *)(intptr_t)seg[SEG_K] + kv * seg[SEG_K_SH];
            const float *v = (const float *)(intptr_t)seg[SEG_V] + kv * seg[SEG_V_SH];
            const float *mask = (const float *)(intptr_t)seg[SEG_M];
            const int64_t m_ss = seg[SEG_M_SS];
            for (int g = 0; g < S; g += 16) {
                const int nr = S - g < 16 ? S - g : 16;
                (nr <= 8 ? head_attention_8 : head_attention_16)(
                    nr, L, D, scale, q + h * q_sh + (int64_t)(row + g) * q_ss, q_ss, k, seg[SEG_K_SS], v,
                    seg[SEG_V_SS], mask ? mask + g * m_ss : NULL, m_ss, out + ((int64_t)(row + g) * H + h) * D,
                    (int64_t)H * D, buf);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
