/* The per-head attention of attention_cpu.c for one width of row vectors, included once per width with
 *   RL (rows per group: the vector's lanes), VR / VRI (float / int32 vectors of RL lanes) and FN(name) (a name with
 *   the width appended) defined.
 * Scores, running maxima and sums are vectors with one lane per query row; values and outputs stay 16-wide. On CPUs
 * that run 512-bit vectors as two 256-bit halves (AMD Zen 4), 8-lane score vectors do groups of up to 8 rows in half
 * the time. */

static inline VR FN(vselect)(VRI take_a, VR a, VR b) { return (VR)(((VRI)a & take_a) | ((VRI)b & ~take_a)); }
static inline VR FN(vmax)(VR a, VR b) { return FN(vselect)(a > b, a, b); }
static inline VR FN(vmin)(VR a, VR b) { return FN(vselect)(a < b, a, b); }

/* exp per lane, within ~2 ulp of expf for inputs in [-87, 88] and exactly 0 below -87 (masked scores): 2^n p(r) with
 * n = round(x / ln 2), r = x - n ln 2 (|r| <= ln 2 / 2; ln 2 split in two so the product is exact) and p the degree-6
 * Taylor polynomial of exp. (libm's expf would be a scalar call per lane here: gcc does not vectorise these loops
 * into libmvec calls.) */
static inline VR FN(vexp)(VR x) {
    const VR zero = {0};
    const VRI underflow = x < -87.0f;
    x = FN(vmin)(FN(vmax)(x, zero - 87.0f), zero + 88.0f);
    /* round(x / ln 2) as truncation of a positive number: the conversion cannot be folded away by -ffast-math */
    const VRI n = __builtin_convertvector(x * 1.44269504f + 128.5f, VRI) - 128;
    const VR nf = __builtin_convertvector(n, VR);
    const VR r = x - nf * 0.693145752f - nf * 1.42860677e-6f;
    VR p = r * (1.0f / 720) + (1.0f / 120);
    p = p * r + (1.0f / 24);
    p = p * r + (1.0f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const VR two_n = (VR)((n + 127) << 23);
    return (VR)((VRI)(p * two_n) & ~underflow);
}

/* One query head, one group of nr <= RL rows, one per vector lane: rows [nr, D] (row stride q_ss) over keys /
 * values [L, D] (row strides k_ss / v_ss) with an additive mask [nr, L] (row stride m_ss, or NULL) -> out rows
 * (stride o_ss). The scores of a key for all rows of the group are one vector, accumulated over d from the key's
 * entries (broadcast) and the group's queries laid out d-major (qt), so no horizontal sums are needed. */
static void FN(head_attention)(int nr, int L, int D, float scale, const float *restrict q, int64_t q_ss,
                               const float *restrict k, int64_t k_ss, const float *restrict v, int64_t v_ss,
                               const float *restrict mask, int64_t m_ss, float *restrict out, int64_t o_ss,
                               float *restrict scratch) {
    VR *qt = (VR *)scratch;                                       /* [D] vectors: qt[d][r] = q[r][d] * scale */
    VR *sc = (VR *)(scratch + (size_t)D * RL);                    /* [KEY_BLOCK] vectors: scores, then weights */
    float *o = scratch + (size_t)D * RL + (size_t)KEY_BLOCK * RL; /* [nr, D] unnormalised outputs */
    float *stats = o + (size_t)nr * D;                            /* rescale factors, per lane */
    for (int d = 0; d < D; d++) {
        float *col = (float *)(qt + d);
        for (int r = 0; r < RL; r++) col[r] = r < nr ? q[(int64_t)r * q_ss + d] * scale : 0.0f;
    }
    VR run_max, run_sum = {0};
    for (int r = 0; r < RL; r++) run_max[r] = -FLT_MAX;
    float *og = o;
    memset(og, 0, sizeof(float) * (size_t)nr * D);
    for (int j0 = 0; j0 < L; j0 += KEY_BLOCK) {
        const int nb = L - j0 < KEY_BLOCK ? L - j0 : KEY_BLOCK;
        const float *kb = k + (int64_t)j0 * k_ss;
        int j = 0;
        for (; j + KEYS_AT_ONCE <= nb; j += KEYS_AT_ONCE) {
            VR acc[KEYS_AT_ONCE];
            const float *kj[KEYS_AT_ONCE];
            for (int t = 0; t < KEYS_AT_ONCE; t++) {
                acc[t] = (VR){0};
                kj[t] = kb + (int64_t)(j + t) * k_ss;
            }
            for (int d = 0; d < D; d++) {
                const VR w = qt[d];
                for (int t = 0; t < KEYS_AT_ONCE; t++) acc[t] += kj[t][d] * w;
            }
            for (int t = 0; t < KEYS_AT_ONCE; t++) sc[j + t] = acc[t];
        }
        for (; j < nb; j++) {
            const float *kj = kb + (int64_t)j * k_ss;
            VR acc = {0};
            for (int d = 0; d < D; d++) acc += kj[d] * qt[d];
            sc[j] = acc;
        }
        if (mask)
            for (int r = 0; r < nr; r++) {
                const float *mr = mask + (int64_t)r * m_ss + j0;
                for (int jj = 0; jj < nb; jj++) sc[jj][r] += mr[jj];
            }
        /* Online softmax, per lane: rescale what was summed under a smaller max, then weights exp(s - max). */
        VR new_max = run_max;
        for (int jj = 0; jj < nb; jj++) new_max = FN(vmax)(sc[jj], new_max);
        const VR rs = FN(vexp)(run_max - new_max);
        float *rescale = stats;
        *(VR *)rescale = rs;
        run_sum *= rs;
        run_max = new_max;
        for (int r = 0; r < nr; r++)
            if (rescale[r] != 1.0f)
                for (int d = 0; d < D; d++) og[(int64_t)r * D + d] *= rescale[r];
        VR block_sum = {0};
        for (int jj = 0; jj < nb; jj++) {
            sc[jj] = FN(vexp)(sc[jj] - new_max);
            block_sum += sc[jj];
        }
        run_sum += block_sum;
        /* Weighted values: 64-wide column chunks, then 16-wide, then single columns. */
        const float *vb = v + (int64_t)j0 * v_ss;
        int c = 0;
        for (; c + 64 <= D; c += 64) weighted_values(4, nr, nb, c, D, (const float *)sc, RL, vb, v_ss, og);
        for (; c + 16 <= D; c += 16) weighted_values(1, nr, nb, c, D, (const float *)sc, RL, vb, v_ss, og);
        for (; c < D; c++)
            for (int r = 0; r < nr; r++) {
                float acc = 0.0f;
                for (int jj = 0; jj < nb; jj++) acc += sc[jj][r] * vb[(int64_t)jj * v_ss + c];
                og[(int64_t)r * D + c] += acc;
            }
    }
    for (int r = 0; r < nr; r++) {
        const float inv = 1.0f / run_sum[r];
        for (int d = 0; d < D; d++) out[(int64_t)r * o_ss + d] = og[(int64_t)r * D + d] * inv;
    }
}
