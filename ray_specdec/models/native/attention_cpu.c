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

/* Keys per block: a block's keys and values (2 x 128 x D floats) stay in cache while every row of the group uses
 * them; each row's scores and weights for the block are one row of scratch. */
#define KEY_BLOCK 128
/* Keys per chunk: one vector of scores. */
#define CHUNK 16
/* Rows per group (the callers cut a segment's rows into groups of at most this many). */
#define GROUP 16

typedef float vf16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));
/* A vf16 is one register with AVX-512 and two with AVX2 (16 registers in all), so the loops that keep many of them
 * live are cut smaller there: keys whose scores accumulate at once (chunk_scores), and value columns per pass
 * (block_values). Only the grouping changes; every lane's sums are the same operations in the same order. */
#ifdef __AVX512F__
#define SCORE_KEYS CHUNK
#define WIDE_VALUES 1
#else
#define SCORE_KEYS 4
#define WIDE_VALUES 0
#endif

/* Scratch floats one row group of a segment of S rows needs: its scaled queries and unnormalised outputs [GROUP, D]
 * each, its scores / weights for one key block [GROUP, KEY_BLOCK], running maxima and sums [GROUP] each, and each
 * row's visible keys among the segment's own [GROUP, S] (int32). */
static size_t scratch_floats(int D, int S) {
    return (size_t)2 * GROUP * D + (size_t)GROUP * KEY_BLOCK + 2 * GROUP + (size_t)GROUP * S;
}

/* A key of the segment's own rows whose mask is at most this is not visible to the row (float32's lowest: masked). */
#define MASKED (-FLT_MAX / 2)

static inline vf16 vselect(vi16 take_a, vf16 a, vf16 b) { return (vf16)(((vi16)a & take_a) | ((vi16)b & ~take_a)); }
static inline vf16 vmax(vf16 a, vf16 b) { return vselect(a > b, a, b); }
static inline vf16 vmin(vf16 a, vf16 b) { return vselect(a < b, a, b); }

/* exp per lane, within ~2 ulp of expf for inputs in [-87, 88] and exactly 0 below -87 (masked scores): 2^n p(r) with
 * n = round(x / ln 2), r = x - n ln 2 (|r| <= ln 2 / 2; ln 2 split in two so the product is exact) and p the degree-6
 * Taylor polynomial of exp. (libm's expf would be a scalar call per lane: gcc does not vectorise it into libmvec.) */
static inline vf16 vexp(vf16 x) {
    const vf16 zero = {0};
    const vi16 underflow = x < -87.0f;
    x = vmin(vmax(x, zero - 87.0f), zero + 88.0f);
    /* round(x / ln 2) as truncation of a positive number: the conversion cannot be folded away by -ffast-math */
    const vi16 n = __builtin_convertvector(x * 1.44269504f + 128.5f, vi16) - 128;
    const vf16 nf = __builtin_convertvector(n, vf16);
    const vf16 r = x - nf * 0.693145752f - nf * 1.42860677e-6f;
    vf16 p = r * (1.0f / 720) + (1.0f / 120);
    p = p * r + (1.0f / 24);
    p = p * r + (1.0f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vf16 two_n = (vf16)((n + 127) << 23);
    return (vf16)((vi16)(p * two_n) & ~underflow);
}

/* Lane t of the result: the sum of p[t]'s 16 lanes, always in the same tree (lanes i and i + 8 first, then i + 4,
 * i + 2, i + 1), so a key's score is the same whichever keys share its chunk. */
static inline vf16 sum_lanes16(const vf16 p[CHUNK]) {
    const vi16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi16 hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi16 lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi16 hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vi16 lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi16 hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const vi16 lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi16 hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vf16 a[8], b[4], c[2];
#pragma GCC unroll 8
    for (int m = 0; m < 8; m++) /* lanes 0-7: key 2m's 8 partial sums; 8-15: key 2m + 1's */
        a[m] = __builtin_shuffle(p[2 * m], p[2 * m + 1], lo8) + __builtin_shuffle(p[2 * m], p[2 * m + 1], hi8);
#pragma GCC unroll 4
    for (int m = 0; m < 4; m++) /* 4 lanes per key, keys 4m .. 4m + 3 */
        b[m] = __builtin_shuffle(a[2 * m], a[2 * m + 1], lo4) + __builtin_shuffle(a[2 * m], a[2 * m + 1], hi4);
#pragma GCC unroll 2
    for (int m = 0; m < 2; m++) /* 2 lanes per key, keys 8m .. 8m + 7 */
        c[m] = __builtin_shuffle(b[2 * m], b[2 * m + 1], lo2) + __builtin_shuffle(b[2 * m], b[2 * m + 1], hi2);
    return __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], hi1);
}

/* The sum of a vector's lanes, in a fixed tree (as sum_lanes16 does per key). */
static inline float sum_lanes(vf16 x) {
    for (int half = 8; half >= 1; half /= 2) {
        vf16 shifted = {0};
        for (int i = 0; i < half; i++) shifted[i] = x[i + half];
        x += shifted;
    }
    return x[0];
}

/* Scores of one row (scaled query qs [D]) against the keys at kp[0..n), n <= CHUNK: lane t = the dot product with
 * key t, each key's products summed in D / 16 vectors of partial sums in order, then sum_lanes16; lanes past n are
 * float32's lowest (no weight). Head sizes that are not a multiple of 16 add their last products as one more
 * zero-padded vector. */
static inline vf16 chunk_scores(int D, const float *restrict qs, const float *const *kp, int n) {
    vf16 p[CHUNK];
    const int full = D / 16 * 16;
    if (n == CHUNK && full == D) { /* the common case, with every loop over keys unrolled (p stays in registers) */
        for (int t0 = 0; t0 < CHUNK; t0 += SCORE_KEYS) {
            vf16 acc[SCORE_KEYS]; /* in registers, apart from p (which sum_lanes16 reads from memory) */
            const float *keys[SCORE_KEYS];
#pragma GCC unroll 16
            for (int t = 0; t < SCORE_KEYS; t++) acc[t] = (vf16){0}, keys[t] = kp[t0 + t];
            for (int d = 0; d < D; d += 16) {
                const vf16 qd = *(const vf16 *)(qs + d);
#pragma GCC unroll 16
                for (int t = 0; t < SCORE_KEYS; t++) acc[t] += qd * *(const vf16 *)(keys[t] + d);
            }
#pragma GCC unroll 16
            for (int t = 0; t < SCORE_KEYS; t++) p[t0 + t] = acc[t];
        }
        return sum_lanes16(p);
    }
    for (int t = 0; t < CHUNK; t++) {
        vf16 acc = {0};
        if (t < n) {
            const float *kt = kp[t];
            for (int d = 0; d < full; d += 16) acc += *(const vf16 *)(qs + d) * *(const vf16 *)(kt + d);
            if (full < D) {
                vf16 qv = {0}, kv = {0};
                for (int d = full; d < D; d++) qv[d - full] = qs[d], kv[d - full] = kt[d];
                acc += qv * kv;
            }
        }
        p[t] = acc;
    }
    vf16 s = sum_lanes16(p);
    for (int t = n; t < CHUNK; t++) s[t] = -FLT_MAX;
    return s;
}

/* o[r] += sum_j w[r][j] v[j] for NR rows from r0 (weights w [rows, KEY_BLOCK]) and one value column chunk [c, c + NV *
 * 16): NR rows x NV vectors accumulate in registers while the block's value rows stream past, each row's sum in key
 * order (NR and NV compile-time constants). */
static inline __attribute__((always_inline)) void weighted_rows(const int NR, const int NV, int r0, int nb, int c,
                                                                int D, const float *restrict w,
                                                                const float *restrict v, int64_t v_ss,
                                                                float *restrict o) {
    vf16 acc[4][4];
    for (int r = 0; r < NR; r++)
        for (int x = 0; x < NV; x++) acc[r][x] = *(const vf16 *)(o + (int64_t)(r0 + r) * D + c + 16 * x);
    for (int j = 0; j < nb; j++) {
        const float *vj = v + (int64_t)j * v_ss + c;
        vf16 vv[4];
        for (int x = 0; x < NV; x++) vv[x] = *(const vf16 *)(vj + 16 * x);
        for (int r = 0; r < NR; r++) {
            const float wr = w[(int64_t)(r0 + r) * KEY_BLOCK + j];
            for (int x = 0; x < NV; x++) acc[r][x] += wr * vv[x];
        }
    }
    for (int r = 0; r < NR; r++)
        for (int x = 0; x < NV; x++) *(vf16 *)(o + (int64_t)(r0 + r) * D + c + 16 * x) = acc[r][x];
}

/* weighted_rows for all nr rows of a group, 4 at a time. */
static inline __attribute__((always_inline)) void weighted_values(const int NV, int nr, int nb, int c, int D,
                                                                  const float *restrict w, const float *restrict v,
                                                                  int64_t v_ss, float *restrict o) {
    int r0 = 0;
    for (; r0 + 4 <= nr; r0 += 4) weighted_rows(4, NV, r0, nb, c, D, w, v, v_ss, o);
    switch (nr - r0) {
        case 3: weighted_rows(3, NV, r0, nb, c, D, w, v, v_ss, o); break;
        case 2: weighted_rows(2, NV, r0, nb, c, D, w, v, v_ss, o); break;
        case 1: weighted_rows(1, NV, r0, nb, c, D, w, v, v_ss, o); break;
    }
}

/* weighted_values over every column: 64-wide chunks, then 16-wide, then single columns. */
static void block_values(int nr, int nb, int D, const float *restrict w, const float *restrict v, int64_t v_ss,
                         float *restrict o) {
    int c = 0;
    if (WIDE_VALUES)
        for (; c + 64 <= D; c += 64) weighted_values(4, nr, nb, c, D, w, v, v_ss, o);
    for (; c + 16 <= D; c += 16) weighted_values(1, nr, nb, c, D, w, v, v_ss, o);
    if (c < D) /* key by key, as weighted_value does: a sum over keys in one loop would be vectorised (reordered) */
        for (int j = 0; j < nb; j++)
            for (int r = 0; r < nr; r++)
                for (int x = c; x < D; x++)
                    o[(int64_t)r * D + x] += w[(int64_t)r * KEY_BLOCK + j] * v[(int64_t)j * v_ss + x];
}

/* o += w * vr for one row's unnormalised output o [D] and one value row vr: the multiply-adds of weighted_values,
 * column for column (a key of the row's own, at its place in the row's key order). */
static inline void weighted_value(int D, float w, const float *restrict vr, float *restrict o) {
    int c = 0;
    for (; c + 16 <= D; c += 16) *(vf16 *)(o + c) += w * *(const vf16 *)(vr + c);
    for (; c < D; c++) o[c] += w * vr[c];
}

/* One query head, one group of nr <= GROUP rows of a segment whose S rows are the last S of the L keys: rows [nr, D]
 * (row stride q_ss) over keys / values [L, D] (row strides k_ss / v_ss) with an additive mask [nr, L] (row stride
 * m_ss, or NULL) -> out rows (stride o_ss).
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
static void head_attention(int nr, int S, int L, int D, float scale, const float *restrict q, int64_t q_ss,
                           const float *restrict k, int64_t k_ss, const float *restrict v, int64_t v_ss,
                           const float *restrict mask, int64_t m_ss, float *restrict out, int64_t o_ss,
                           float *restrict scratch) {
    float *qs = scratch;                             /* [nr, D] queries * scale */
    float *o = qs + (size_t)GROUP * D;               /* [nr, D] unnormalised outputs */
    float *w = o + (size_t)GROUP * D;                /* [nr, KEY_BLOCK] scores, then weights */
    float *run_max = w + (size_t)GROUP * KEY_BLOCK;  /* [nr] */
    float *run_sum = run_max + GROUP;                /* [nr] */
    int32_t *own = (int32_t *)(run_sum + GROUP);     /* [nr, S]: the segment's keys each row sees, in order */
    const int C = L > S ? L - S : 0;                 /* keys before the segment's own (rows past L: none) */
    int length[GROUP], longest = 0;                  /* keys each row sees */
    for (int r = 0; r < nr; r++) {
        for (int d = 0; d < D; d++) qs[(int64_t)r * D + d] = q[(int64_t)r * q_ss + d] * scale;
        run_max[r] = -FLT_MAX;
        run_sum[r] = 0.0f;
        int seen = 0;
        for (int j = C; j < L; j++)
            if (!mask || mask[(int64_t)r * m_ss + j] > MASKED) own[r * S + seen++] = j;
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
                const float *kp[CHUNK];
                int key[CHUNK];
                for (int t = 0; t < n; t++) {
                    key[t] = first + t < C ? first + t : mine[first + t - C];
                    kp[t] = k + (int64_t)key[t] * k_ss;
                }
                vf16 s = chunk_scores(D, qs + (int64_t)r * D, kp, n);
                if (mask) {
                    const float *mr = mask + (int64_t)r * m_ss;
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
        for (int d = 0; d < D; d++) out[(int64_t)r * o_ss + d] = o[(int64_t)r * D + d] * inv;
    }
}

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
        float *buf = aligned_alloc(64, (scratch_floats(D, S) * sizeof(float) + 63) / 64 * 64);
        /* Every thread reaches the worksharing loop, even one without scratch (it then only records the failure). */
#pragma omp for schedule(static)
        for (int h = 0; h < H; h++) {
            if (!buf) {
                failed = 1;
                continue;
            }
            const int kv = h / group;
            for (int g = 0; g < S; g += GROUP) {
                const int nr = S - g < GROUP ? S - g : GROUP;
                head_attention(
                    nr, S, L, D, scale, q + h * q_sh + g * q_ss, q_ss, k + kv * k_sh, k_ss, v + kv * v_sh, v_ss,
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
            for (int g = 0; g < S; g += GROUP) {
                const int nr = S - g < GROUP ? S - g : GROUP;
                head_attention(
                    nr, S, L, D, scale, q + h * q_sh + (int64_t)(row + g) * q_ss, q_ss, k, seg[SEG_K_SS], v,
                    seg[SEG_V_SS], mask ? mask + g * m_ss : NULL, m_ss, out + ((int64_t)(row + g) * H + h) * D,
                    (int64_t)H * D, buf);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
