/* Native CPU attention (float32) for a few query rows over a long KV cache: a verify forward's tree rows, a decode
 * step's one row.
 *
 * Why: torch's CPU sdpa kernel multiplies each query block with each key block as a small GEMM, which for a handful
 * of rows runs far from the memory bound; in a verify of 12 rows at 3k tokens of context, attention was ~2/3 of the
 * target's forward. Here each key/value head's keys and values are read once, in blocks that stay in cache, for the
 * rows of all the query heads that share it: scores, an online softmax (flash-attention style: a running max and sum
 * per row, earlier sums rescaled when the max grows) and the weighted sum of values.
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

#include "attention_simd_cpu.h"

/* Keys per block: a block's keys and values (2 x 128 x D floats) stay in cache while every row of the group uses
 * them; each row's scores and weights for the block are one row of scratch. */
#define KEY_BLOCK 128
/* Keys per chunk: one vector of scores. */
#define CHUNK 16
/* Rows per group (the callers cut a segment's rows into groups of at most this many). */
#define GROUP 16

/* A vf16 is one register with AVX-512 and two with AVX2 (16 registers in all). Loops that keep many vectors live
 * use vreg (simd_cpu.h), one register wide, cut to fit the register file: the value sums (rows x registers per pass,
 * by rows in a pass), and the score lane sums (scores8 on AVX2). Only the grouping changes; every lane's sums are
 * the same operations in the same order. */
#ifdef __AVX512F__
#define VALUE_REGS_4 4 /* registers of value columns per pass for 4 (and 3) rows: 16 accumulators */
#define VALUE_REGS_2 4
#define VALUE_REGS_1 4
#define MAX_VALUE_REGS 4
#else
#define VALUE_REGS_4 2 /* 8 accumulators, 2 value registers and a weight broadcast of 16 registers */
#define VALUE_REGS_2 4
#define VALUE_REGS_1 8
#define MAX_VALUE_REGS 8
#endif

/* Scratch floats one row group of a segment of S rows needs: its scaled queries and unnormalised outputs [GROUP, D]
 * each, its scores / weights for one key block [GROUP, KEY_BLOCK], running maxima and sums [GROUP] each, and each
 * row's visible keys among the segment's own [GROUP, S] (int32). */
static size_t scratch_floats(int D, int S) {
    return (size_t)2 * GROUP * D + (size_t)GROUP * KEY_BLOCK + 2 * GROUP + (size_t)GROUP * S;
}

/* A key of the segment's own rows whose mask is at most this is not visible to the row (float32's lowest: masked). */
#define MASKED (-FLT_MAX / 2)

#ifndef __AVX512F__
/* a[i] for the keys at k[0..4): each key's products summed in D / 16 steps of two 8-lane partial sums (lanes 0-7
 * and 8-15 of sum_lanes16's input), then the two added. */
static inline __attribute__((always_inline)) void key_sums4(int D, const float *restrict qs,
                                                            const float *const k[4], vf8 a[4]) {
    vf8 lo[4] = {{0}}, hi[4] = {{0}};
    for (int d = 0; d < D; d += 16) {
        const vf8 ql = *(const vf8 *)(qs + d), qh = *(const vf8 *)(qs + d + 8);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            lo[t] = vfma(ql, *(const vf8 *)(k[t] + d), lo[t]);
            hi[t] = vfma(qh, *(const vf8 *)(k[t] + d + 8), hi[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < 4; t++) a[t] = lo[t] + hi[t];
}

/* The scores of keys k[0..8), in order. */
static inline __attribute__((always_inline)) vf8 scores8(int D, const float *restrict qs, const float *const k[8]) {
    vf8 a[4], b[4];
    const float *first[4] = {k[0], k[4], k[1], k[5]}, *second[4] = {k[2], k[6], k[3], k[7]};
    key_sums4(D, qs, first, a);
    key_sums4(D, qs, second, b);
    return fold1(fold2(fold4(a[0], a[1]), fold4(a[2], a[3])), fold2(fold4(b[0], b[1]), fold4(b[2], b[3])));
}
#endif

/* Scores of one row (scaled query qs [D]) against CHUNK keys, key t at k + (key ? key[t] : t) * k_ss (key NULL:
 * consecutive keys), of which the first n count: lane t = the dot product with key t, each key's products summed in
 * D / 16 vectors of partial sums in order, then sum_lanes16's tree; lanes past n are float32's lowest (no weight).
 * Head sizes that are not a multiple of 16 add their last products as one more zero-padded vector. Keys past n are
 * scored as copies of the first (their memory may not exist) and then dropped. A key's score is the same bits
 * whichever keys share its chunk and whichever path scores it. */
static inline __attribute__((always_inline)) vf16 chunk_scores(int D, const float *restrict qs,
                                                                const float *restrict k, int64_t k_ss,
                                                                const int32_t *key, int n) {
    const float *kp[CHUNK];
#pragma GCC unroll 16
    for (int t = 0; t < CHUNK; t++) kp[t] = k + (int64_t)(key ? key[t < n ? t : 0] : (t < n ? t : 0)) * k_ss;
    vf16 s;
    if (D % 16 == 0) { /* the common case: every loop over keys unrolled, partial sums in registers */
#ifdef __AVX512F__
        vf16 p[CHUNK];
#pragma GCC unroll 16
        for (int t = 0; t < CHUNK; t++) p[t] = (vf16){0};
        for (int d = 0; d < D; d += 16) {
            const vf16 qd = *(const vf16 *)(qs + d);
#pragma GCC unroll 16
            for (int t = 0; t < CHUNK; t++) p[t] = fma16(qd, *(const vf16 *)(kp[t] + d), p[t]);
        }
        s = sum_lanes16(p);
#else
        const vf8 lo = scores8(D, qs, kp), hi = scores8(D, qs, kp + 8);
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) s[t] = lo[t], s[t + 8] = hi[t];
#endif
    } else {
        vf16 p[CHUNK];
        const int full = D / 16 * 16;
        for (int t = 0; t < CHUNK; t++) {
            vf16 acc = {0};
            for (int d = 0; d < full; d += 16) acc = fma16(*(const vf16 *)(qs + d), *(const vf16 *)(kp[t] + d), acc);
            vf16 qv = {0}, kv = {0};
            for (int d = full; d < D; d++) qv[d - full] = qs[d], kv[d - full] = kp[t][d];
            p[t] = fma16(qv, kv, acc);
        }
        s = sum_lanes16(p);
    }
    for (int t = n; t < CHUNK; t++) s[t] = -FLT_MAX;
    return s;
}

/* o[r] += sum_j w[r][j] v[j] for NR rows from r0 (weights w [rows, KEY_BLOCK]) and one value column chunk [c, c + NV *
 * VL): NR rows x NV registers accumulate while the block's value rows stream past, each column's sum in key order
 * (NR and NV compile-time constants). */
static inline __attribute__((always_inline)) void weighted_rows(const int NR, const int NV, int r0, int nb, int c,
                                                                int D, const float *restrict w,
                                                                const float *restrict v, int64_t v_ss,
                                                                float *restrict o) {
    vreg acc[4][MAX_VALUE_REGS];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int x = 0; x < NV; x++) acc[r][x] = *(const vreg *)(o + (int64_t)(r0 + r) * D + c + VL * x);
    for (int j = 0; j < nb; j++) {
        const float *vj = v + (int64_t)j * v_ss + c;
        vreg vv[MAX_VALUE_REGS];
#pragma GCC unroll 8
        for (int x = 0; x < NV; x++) vv[x] = *(const vreg *)(vj + VL * x);
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const float wr = w[(int64_t)(r0 + r) * KEY_BLOCK + j];
#pragma GCC unroll 8
            for (int x = 0; x < NV; x++) acc[r][x] = vfma(wr + (vreg){0}, vv[x], acc[r][x]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
        for (int x = 0; x < NV; x++) *(vreg *)(o + (int64_t)(r0 + r) * D + c + VL * x) = acc[r][x];
}

/* weighted_rows over the column chunks of NV registers that fit from column 0, then single registers; returns the
 * first column left. */
static inline __attribute__((always_inline)) int row_columns(const int NR, const int NV, int r0, int nb, int D,
                                                             const float *restrict w, const float *restrict v,
                                                             int64_t v_ss, float *restrict o) {
    int c = 0;
    if (NV > 1)
        for (; c + NV * VL <= D; c += NV * VL) weighted_rows(NR, NV, r0, nb, c, D, w, v, v_ss, o);
    for (; c + VL <= D; c += VL) weighted_rows(NR, 1, r0, nb, c, D, w, v, v_ss, o);
    return c;
}

/* weighted_rows for all nr rows of a group, 4 at a time, over every column a register covers; returns the first
 * column left. Fewer rows take wider column chunks, so that as many independent sums are in flight (a column sums
 * its keys in key order whichever chunk it is in). */
static int block_rows(int nr, int nb, int D, const float *restrict w, const float *restrict v, int64_t v_ss,
                      float *restrict o) {
    int r0 = 0, c = 0;
    for (; r0 + 4 <= nr; r0 += 4) c = row_columns(4, VALUE_REGS_4, r0, nb, D, w, v, v_ss, o);
    switch (nr - r0) {
        case 3: c = row_columns(3, VALUE_REGS_4, r0, nb, D, w, v, v_ss, o); break;
        case 2: c = row_columns(2, VALUE_REGS_2, r0, nb, D, w, v, v_ss, o); break;
        case 1: c = row_columns(1, VALUE_REGS_1, r0, nb, D, w, v, v_ss, o); break;
    }
    return c;
}

/* o[r] += sum_j w[r][j] v[j] over a block's nb keys for every column: block_rows, then the columns past the last
 * whole register. */
static void block_values(int nr, int nb, int D, const float *restrict w, const float *restrict v, int64_t v_ss,
                         float *restrict o) {
    const int c = block_rows(nr, nb, D, w, v, v_ss, o);
    if (c < D) /* key by key, as weighted_value does: a sum over keys in one loop would be vectorised (reordered) */
        for (int j = 0; j < nb; j++)
            for (int r = 0; r < nr; r++) {
                float *orow = o + (int64_t)r * D;
                const float wr = w[(int64_t)r * KEY_BLOCK + j];
                for (int x = c; x < D; x++) orow[x] = sfma(wr, v[(int64_t)j * v_ss + x], orow[x]);
            }
}

/* o += w * vr for one row's unnormalised output o [D] and one value row vr: the multiply-adds of block_values,
 * column for column (a key of the row's own, at its place in the row's key order). */
static inline void weighted_value(int D, float w, const float *restrict vr, float *restrict o) {
    int c = 0;
    for (; c + VL <= D; c += VL) *(vreg *)(o + c) = vfma(w + (vreg){0}, *(const vreg *)(vr + c), *(vreg *)(o + c));
    for (; c < D; c++) o[c] = sfma(w, vr[c], o[c]);
}

/* One group of nr <= GROUP query rows over one key/value head (rows of one query head, or of several that share it:
 * grouped-query attention reads each key block once for all of them), of a segment whose S rows are the last S of
 * the L keys: row r's query qrow[r] [D] over keys / values [L, D] (row strides k_ss / v_ss) with its additive mask
 * row mrow[r] [L] (mrow NULL: no mask) -> orow[r] [D].
 *
 * Every row is computed on its own, vectorised over the head dimension and over keys: a decode step's one row per
 * request uses whole vectors (a kernel with one row per vector lane left 15 of 16 lanes idle there, and one-row
 * segments are what a busy continuous batch is made of). Rows share only the loads of keys and values, never a sum,
 * so a row's result does not depend on the group it is in.
 *
 * A row attends over the L - S keys before the segment, then over the segment's keys it sees (mask above MASKED; all
 * of them without a mask), in order, as if those were the keys right after the others: for a verify's tree row, the
 * cache then its ancestors and itself, the keys that row has when its tokens are decoded one by one. Key blocks and
 * chunks are cut at those positions, so a tree row gets exactly the bits of the same row in plain decoding, whatever
 * the tree around it (the other rows' keys are skipped, not weighted 0 at shifted places). */
static __attribute__((noinline)) void head_attention(int nr, int S, int L, int D, float scale, const float *const *qrow,
                           const float *restrict k, int64_t k_ss, const float *restrict v, int64_t v_ss,
                           const float *const *mrow, float *const *orow, float *restrict scratch) {
    float *qs = scratch;                             /* [nr, D] queries * scale */
    float *o = qs + (size_t)GROUP * D;               /* [nr, D] unnormalised outputs */
    float *w = o + (size_t)GROUP * D;                /* [nr, KEY_BLOCK] scores, then weights */
    float *run_max = w + (size_t)GROUP * KEY_BLOCK;  /* [nr] */
    float *run_sum = run_max + GROUP;                /* [nr] */
    int32_t *own = (int32_t *)(run_sum + GROUP);     /* [nr, S]: the segment's keys each row sees, in order */
    const int C = L > S ? L - S : 0;                 /* keys before the segment's own (rows past L: none) */
    int length[GROUP], longest = 0;                  /* keys each row sees */
    for (int r = 0; r < nr; r++) {
        for (int d = 0; d < D; d++) qs[(int64_t)r * D + d] = qrow[r][d] * scale;
        run_max[r] = -FLT_MAX;
        run_sum[r] = 0.0f;
        int seen = 0;
        for (int j = C; j < L; j++)
            if (!mrow || mrow[r][j] > MASKED) own[r * S + seen++] = j;
        length[r] = C + seen;
        longest = length[r] > longest ? length[r] : longest;
    }
    memset(o, 0, sizeof(float) * (size_t)nr * D);
    const vf16 zero = {0};
    for (int j0 = 0; j0 < longest; j0 += KEY_BLOCK) {
        for (int r = 0; r < nr; r++) {
            const int nb = length[r] - j0 < KEY_BLOCK ? length[r] - j0 : KEY_BLOCK;
            if (nb <= 0) continue;
            const int chunks = (nb + CHUNK - 1) / CHUNK;
            const int32_t *mine = own + r * S;
            float *wr = w + (int64_t)r * KEY_BLOCK;
            vf16 block_max = zero - FLT_MAX;
            for (int c = 0; c < chunks; c++) {
                const int first = j0 + c * CHUNK, n = nb - c * CHUNK < CHUNK ? nb - c * CHUNK : CHUNK;
                const float *qr = qs + (int64_t)r * D, *mr = mrow ? mrow[r] : NULL;
                vf16 s;
                if (first + CHUNK <= C) { /* keys before the segment's own: consecutive */
                    s = chunk_scores(D, qr, k + (int64_t)first * k_ss, k_ss, NULL, CHUNK);
                    if (mr) s += *(const vf16 *)(mr + first);
                } else {
                    int32_t key[CHUNK];
                    for (int t = 0; t < n; t++) key[t] = first + t < C ? first + t : mine[first + t - C];
                    s = chunk_scores(D, qr, k, k_ss, key, n);
                    if (mr)
                        for (int t = 0; t < n; t++) s[t] += mr[key[t]];
                }
                *(vf16 *)(wr + c * CHUNK) = s;
                block_max = vmax(block_max, s);
            }
            /* Online softmax: rescale what was summed under a smaller max, then weights exp(s - max). */
            float m = block_max[0];
            for (int t = 1; t < CHUNK; t++) m = block_max[t] > m ? block_max[t] : m;
            const float new_max = m > run_max[r] ? m : run_max[r];
            const float rescale = vexp(zero + (run_max[r] - new_max))[0];
            run_max[r] = new_max;
            if (rescale != 1.0f) {
                float *orow = o + (int64_t)r * D;
                for (int d = 0; d < D; d++) orow[d] *= rescale;
            }
            vf16 block_sum = zero;
            for (int c = 0; c < chunks; c++) {
                const vf16 e = vexp(*(vf16 *)(wr + c * CHUNK) - new_max);
                *(vf16 *)(wr + c * CHUNK) = e;
                block_sum += e;
            }
            run_sum[r] = run_sum[r] * rescale + sum_lanes(block_sum);
        }
        /* Weighted values: the keys before the segment for every row at once, then each row's own, in key order. */
        const int shared = C - j0 < KEY_BLOCK ? C - j0 : KEY_BLOCK;
        if (shared > 0) block_values(nr, shared, D, w, v + (int64_t)j0 * v_ss, v_ss, o);
        for (int r = 0; r < nr; r++) {
            const int end = length[r] < j0 + KEY_BLOCK ? length[r] : j0 + KEY_BLOCK;
            for (int j = j0 > C ? j0 : C; j < end; j++)
                weighted_value(D, w[(int64_t)r * KEY_BLOCK + j - j0], v + (int64_t)own[r * S + j - C] * v_ss,
                               o + (int64_t)r * D);
        }
    }
    for (int r = 0; r < nr; r++) {
        const float inv = 1.0f / run_sum[r];
        for (int d = 0; d < D; d++) orow[r][d] = o[(int64_t)r * D + d] * inv;
    }
}

/* The rows of one key/value head kv's query heads (group = H / Hkv of them, S rows each, head-major), from row
 * `first`, at most GROUP: their query, mask and output rows for head_attention. Returns how many. */
static int gather_rows(int first, int total, int S, int H, int group, int kv, int D, const float *q, int64_t q_sh,
                       int64_t q_ss, const float *mask, int64_t m_sh, int64_t m_ss, float *out,
                       const float *qrow[GROUP], const float *mrow[GROUP], float *orow[GROUP]) {
    const int nr = total - first < GROUP ? total - first : GROUP;
    for (int r = 0; r < nr; r++) {
        const int h = kv * group + (first + r) / S, s = (first + r) % S;
        qrow[r] = q + h * q_sh + (int64_t)s * q_ss;
        mrow[r] = mask ? mask + h * m_sh + (int64_t)s * m_ss : NULL;
        orow[r] = out + ((int64_t)s * H + h) * D;
    }
    return nr;
}

/* out [S, H, D] (contiguous) = attention of S query rows per head. q: [H, S, D] with strides (q_sh, q_ss, 1); k, v:
 * [Hkv, L, D] with strides (k_sh, k_ss, 1) and (v_sh, v_ss, 1); mask: additive [S, L] per head (stride m_sh, 0 when
 * one mask serves every head) with row stride m_ss, or NULL. The rows of each key/value head (all its query heads')
 * are cut into pieces of at most GROUP rows, fewer where that leaves a thread idle, split over `threads` OpenMP
 * threads. Returns 0, or -1 when scratch memory could not be allocated (out is then unspecified). */
int tree_attention(int S, int H, int Hkv, int L, int D, float scale, const float *q, int64_t q_sh, int64_t q_ss,
                   const float *k, int64_t k_sh, int64_t k_ss, const float *v, int64_t v_sh, int64_t v_ss,
                   const float *mask, int64_t m_sh, int64_t m_ss, float *out, int threads) {
    const int group = H / Hkv, rows = group * S;
    int piece = GROUP, failed = 0;
    if (threads > 1 && Hkv * ((rows + GROUP - 1) / GROUP) < threads) { /* smaller pieces, so every thread has one */
        const int per_head = (threads + Hkv - 1) / Hkv;
        piece = (rows + per_head - 1) / per_head;
    }
    const int pieces = (rows + piece - 1) / piece;
#pragma omp parallel num_threads(threads) if (threads > 1 && Hkv * pieces > 1) reduction(| : failed)
    {
        float *buf = aligned_alloc(64, (scratch_floats(D, S) * sizeof(float) + 63) / 64 * 64);
        /* Every thread reaches the worksharing loop, even one without scratch (it then only records the failure). */
#pragma omp for schedule(static)
        for (int t = 0; t < Hkv * pieces; t++) {
            if (!buf) {
                failed = 1;
                continue;
            }
            const int kv = t / pieces, first = t % pieces * piece;
            const int last = first + piece < rows ? first + piece : rows;
            const float *qrow[GROUP], *mrow[GROUP];
            float *orow[GROUP];
            for (int g = first; g < last; g += GROUP) {
                const int nr = gather_rows(g, last, S, H, group, kv, D, q, q_sh, q_ss, mask, m_sh, m_ss, out, qrow,
                                           mrow, orow);
                head_attention(nr, S, L, D, scale, qrow, k + kv * k_sh, k_ss, v + kv * v_sh, v_ss,
                               mask ? mrow : NULL, orow, buf);
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
    int failed = 0, most = 1; /* the most rows of one segment */
    for (int i = 0; i < n; i++) {
        const int rows = (int)table[(int64_t)i * SEG_FIELDS + SEG_S];
        most = rows > most ? rows : most;
    }
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
        float *buf = aligned_alloc(64, (scratch_floats(D, most) * sizeof(float) + 63) / 64 * 64);
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < n * Hkv; t++) {
            if (!buf) {
                failed = 1;
                continue;
            }
            const int64_t *seg = table + (int64_t)(t / Hkv) * SEG_FIELDS;
            const int kv = t % Hkv, S = (int)seg[SEG_S], L = (int)seg[SEG_L], row = (int)seg[SEG_ROW];
            const float *k = (const float *)(intptr_t)seg[SEG_K] + kv * seg[SEG_K_SH];
            const float *v = (const float *)(intptr_t)seg[SEG_V] + kv * seg[SEG_V_SH];
            const float *mask = (const float *)(intptr_t)seg[SEG_M];
            const float *qrow[GROUP], *mrow[GROUP];
            float *orow[GROUP];
            for (int g = 0; g < group * S; g += GROUP) {
                const int nr = gather_rows(g, group * S, S, H, group, kv, D, q + (int64_t)row * q_ss, q_sh, q_ss,
                                           mask, 0, seg[SEG_M_SS], out + (int64_t)row * H * D, qrow, mrow, orow);
                head_attention(nr, S, L, D, scale, qrow, k, seg[SEG_K_SS], v, seg[SEG_V_SS], mask ? mrow : NULL, orow,
                               buf);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
