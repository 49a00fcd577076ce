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
