/* Native CPU glue between a prefill step's QKV products and its attention (float32), for the batch-invariant lean
 * forward's prefill chunks (models/lean_forward.py, `_PrefillWrites`).
 *
 * Why: in torch, the rotary of a step's ~1,000 prefill rows is a dozen strided passes per layer (slices, a
 * negation, two concatenations, two products and a sum, for queries and keys each), and every chunk's keys and
 * values are then copied once more into its cache. At 32 requests on the 2-core machine that was ~9% of the loop
 * (py-spy). Here one pass per layer reads q, k and v where the products left them, and writes the rotated queries
 * [H, R, D] for the attention, and the rotated keys and the values straight into each chunk's cache rows.
 *
 * Bits: the rotary is HF's rotate-half form element for element, x * cos + rotate_half(x) * sin, each product and
 * the sum rounded on its own as torch's kernels round them (no fused multiply-add: this function is compiled with
 * fp-contract off), so queries, keys and values are the torch path's bits (tests/models/test_prefill_writes.py). */
#include <stdint.h>
#include <stdlib.h>

#define PARALLEL_MIN_ROW_ELEMENTS 32768

/* Columns of a segment table row (PREFILL_* in models/native/__init__.py): a chunk's first row in the step's rows,
 * its row count, the cache row its first row goes to, its cache layer's keys (address, head stride, row stride in
 * floats), then its values'. */
enum { SEG_FIRST, SEG_ROWS, SEG_DEST, SEG_K, SEG_K_HS, SEG_K_RS, SEG_V, SEG_V_HS, SEG_V_RS, SEG_FIELDS };

/* out[0..D) = x rotated by the rotary's first `rotary` dims (rotate-half), the rest copied. */
__attribute__((optimize("fp-contract=off"))) static void rotate_row(float *restrict out, const float *restrict x,
                                                                     int D, int rotary, const float *restrict cos,
                                                                     const float *restrict sin) {
    const int half = rotary / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i] * cos[i], b = -x[i + half] * sin[i];
        out[i] = a + b;
    }
    for (int i = half; i < rotary; i++) {
        const float a = x[i] * cos[i], b = x[i - half] * sin[i];
        out[i] = a + b;
    }
    for (int i = rotary; i < D; i++) out[i] = x[i];
}

/* One layer's prefill rows: q [H heads, R rows, D] at (q_hs, q_rs) floats apart, k and v likewise with Hkv heads;
 * cos / sin [R, rotary] (each row's position's). Writes query [H, R, D] (rotated; NULL: not needed, as for the last
 * layer, whose attention no logits need) and, for each of the n_seg segments of `table` [n_seg, SEG_FIELDS], its
 * rows' rotated keys and values to its cache rows dest.. (the buffers must hold them). Returns 0, or -1 when a
 * segment's rows fall outside [0, R) or out of memory. */
int prefill_writes(int R, int H, int Hkv, int D, int rotary, const float *q, int64_t q_hs, int64_t q_rs,
                   const float *k, int64_t k_hs, int64_t k_rs, const float *v, int64_t v_hs, int64_t v_rs,
                   const float *cos, const float *sin, float *query, int n_seg, const int64_t *table, int threads) {
    if (R <= 0) return 0;
    int *segment_of = malloc(sizeof(int) * (size_t)R);
    if (!segment_of) return -1;
    for (int r = 0; r < R; r++) segment_of[r] = -1;
    for (int s = 0; s < n_seg; s++) {
        const int64_t *t = table + (int64_t)s * SEG_FIELDS;
        if (t[SEG_FIRST] < 0 || t[SEG_ROWS] < 0 || t[SEG_FIRST] + t[SEG_ROWS] > R) {
            free(segment_of);
            return -1;
        }
        for (int64_t r = t[SEG_FIRST]; r < t[SEG_FIRST] + t[SEG_ROWS]; r++) segment_of[r] = s;
    }
    const int64_t elements = (int64_t)R * (H + 2 * Hkv) * D;
#pragma omp parallel for num_threads(threads) if (threads > 1 && elements >= PARALLEL_MIN_ROW_ELEMENTS)
    for (int r = 0; r < R; r++) {
        const float *c = cos + (int64_t)r * rotary, *s = sin + (int64_t)r * rotary;
        if (query)
            for (int h = 0; h < H; h++)
                rotate_row(query + ((int64_t)h * R + r) * D, q + h * q_hs + r * q_rs, D, rotary, c, s);
        if (segment_of[r] < 0) continue;
        const int64_t *t = table + (int64_t)segment_of[r] * SEG_FIELDS;
        const int64_t row = t[SEG_DEST] + (r - t[SEG_FIRST]);
        float *keys = (float *)(intptr_t)t[SEG_K], *values = (float *)(intptr_t)t[SEG_V];
        for (int h = 0; h < Hkv; h++) {
            rotate_row(keys + h * t[SEG_K_HS] + row * t[SEG_K_RS], k + h * k_hs + r * k_rs, D, rotary, c, s);
            const float *src = v + h * v_hs + r * v_rs;
            float *dst = values + h * t[SEG_V_HS] + row * t[SEG_V_RS];
            for (int i = 0; i < D; i++) dst[i] = src[i];
        }
    }
    free(segment_of);
    return 0;
}
