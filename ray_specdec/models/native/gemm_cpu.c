/* Few-row products y = x @ W^T (+ bias) on CPU over a packed copy of W ("panels"): the GEMM behind the Mamba
 * drafter's native forward and cpu_gemm's "native" path for the target's Linear layers.
 *
 * Why: a decode or verify forward multiplies 1 to a few dozen rows by every weight, so it is bound by reading the
 * weights; MKL's few-row paths are far from that bound on some CPUs. Here up to ROW_BLOCK rows x a pass of outputs
 * (64 with AVX-512, 16 with AVX2) accumulate in registers while a slice of the weight's panel streams past.
 *
 * Panels come in three element formats, one kernel: float32, and float16 or bfloat16 for a weight whose every
 * value is exactly representable in that format (checked in Python: a model loaded from a half-precision checkpoint
 * and run in float32 is such a weight). Each half value widens to the same float32 before the same multiply-add, in
 * the same order, so the product is the float32 panels' bit for bit, from half the bytes: on the 2-core development
 * machine that made the default target's few-row products 1.3-1.8x faster (`python -m benchmarks.cpu_gemm`). The
 * widening is one instruction per 16 values with AVX-512 (or two per 8 with F16C / AVX2); `half_panels_fast()` says
 * whether this build has it, and Python packs half panels only then.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include "gemm_cpu.h"
#include "simd_cpu.h"

#define LANES 16 /* outputs per panel block of the narrow kind (and the padding of the last) */
/* Rows accumulated at once, and how many vectors of outputs a pass over the inputs carries: ROW_BLOCK x PASS_VECS
 * accumulators plus PASS_VECS weight vectors and a broadcast must fit the register file. AVX-512 (32 registers):
 * 6 rows x a whole 64-output block (24 + 4 + 1). AVX2 (16): 6 rows x 16 outputs (12 + 2 + 1), four passes over a
 * 64-output block; 64 outputs at once there spilled the accumulators and ran ~20x slower. The grouping does not
 * change any output's sum: each is its bias plus x[i] * w[i] multiply-added in input order. */
#define ROW_BLOCK 6
#ifdef __AVX512F__
#define PASS_VECS 4
#else
#define PASS_VECS 2
#endif
/* Accumulators a product of one or two rows spreads over (up to a whole block): with AVX2, 16 outputs of one row
 * are too few independent sums to hide the multiply-add latency, so one row takes a 64-output block per pass and
 * two rows 32 outputs. (AVX-512 takes a whole block per pass for any rows.) */
#define FEW_ROWS_VECS 8

#if defined(__AVX512F__) || (defined(__F16C__) && defined(__AVX2__))
#define FAST_HALF 1
#else
#define FAST_HALF 0
#endif

int half_panels_fast(void) { return FAST_HALF; }

/* One half value (PANEL_F16 or PANEL_BF16) widened to float32: exact, subnormals, infinities and NaN included. */
static inline float widen(const int FMT, uint16_t h) {
    uint32_t bits;
    if (FMT == PANEL_BF16) {
        bits = (uint32_t)h << 16;
    } else {
        uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
        if (e == 0x1f) {
            bits = sign | 0x7f800000u | (m << 13);
        } else if (e) {
            bits = sign | ((e + 112) << 23) | (m << 13);
        } else if (m == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            e = 113;
            while (!(m & 0x400)) m <<= 1, e--;
            bits = sign | (e << 23) | ((m & 0x3ff) << 13);
        }
    }
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

/* VL consecutive panel elements at `p` (element index `i`) widened to float32; FMT is a compile-time constant. */
static inline __attribute__((always_inline)) vreg load_panel(const int FMT, const void *p, int64_t i) {
    if (FMT == PANEL_F32) return *(const vreg *)((const float *)p + i);
    const uint16_t *h = (const uint16_t *)p + i;
#if defined(__AVX512F__)
    __m256i bits = _mm256_loadu_si256((const __m256i *)h);
    if (FMT == PANEL_F16) return (vreg)_mm512_cvtph_ps(bits);
    return (vreg)_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16);
#elif defined(__F16C__) && defined(__AVX2__)
    __m128i bits = _mm_loadu_si128((const __m128i *)h);
    if (FMT == PANEL_F16) return (vreg)_mm256_cvtph_ps(bits);
    return (vreg)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#else
    vreg out;
    for (int k = 0; k < VL; k++) out[k] = widen(FMT, h[k]);
    return out;
#endif
}

/* One register block: NR rows x NV vectors of outputs, accumulated over all n_in inputs in registers. Called with
 * constant FMT, NR and NV, so that the accumulators stay in registers. P points at the block's first output column
 * in a panel [n_in, ld]. */
static inline __attribute__((always_inline)) void gemm_block(
    const int FMT, const int NR, const int NV, int n_in, const void *restrict P, int ld, const float *restrict bias,
    const float *restrict x, int x_stride, float *restrict y, int y_stride, const char *prefetch, int prefetch_lines) {
    vreg acc[ROW_BLOCK][FEW_ROWS_VECS];
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) {
            vreg b = {0};
            if (bias) b = *(const vreg *)(bias + v * VL);
            acc[r][v] = b;
        }
    for (int i = 0; i < n_in; i++) {
        for (int l = 0; l < prefetch_lines; l++) /* into L2 (locality 2), for reading */
            __builtin_prefetch(prefetch + ((int64_t)i * prefetch_lines + l) * 64, 0, 2);
        vreg wv[FEW_ROWS_VECS];
        for (int v = 0; v < NV; v++) wv[v] = load_panel(FMT, P, (int64_t)i * ld + v * VL);
        for (int r = 0; r < NR; r++) {
            const float xi = x[(int64_t)r * x_stride + i];
            for (int v = 0; v < NV; v++) acc[r][v] = vfma(xi + (vreg){0}, wv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < NV; v++) *(vreg *)(y + (int64_t)r * y_stride + v * VL) = acc[r][v];
}

#define BLOCK(NR, NV) gemm_block(FMT, NR, NV, n_in, panel_, ld, b_, xr, x_stride, y_, y_stride_, pf_, pf_lines_)
#define FOR_ROWS(NV)                         \
    switch (nr) {                            \
        case 1: BLOCK(1, NV); break;         \
        case 2: BLOCK(2, NV); break;         \
        case 3: BLOCK(3, NV); break;         \
        case 4: BLOCK(4, NV); break;         \
        case 5: BLOCK(5, NV); break;         \
        default: BLOCK(6, NV); break;        \
    }
/* Vectors per pass over a block of `width` outputs (64 or LANES) for products of `rows` rows: the whole block where
 * it fits the register budget. */
#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define PASS(width, rows) MIN((width) / VL, (rows) <= 2 ? FEW_ROWS_VECS / (rows) : PASS_VECS)

/* One pass of block b over all rows: `pass` vectors of outputs at column c of the block (first output o), whose
 * panel slice starts at P with row stride ld (element format FMT), in groups of ROW_BLOCK rows. */
static inline __attribute__((always_inline)) void gemm_pass(
    const int FMT, int rows, int n_in, const void *restrict P, int ld, int b, int n64, int n16, int tail, int o, int c,
    int pass, const float *restrict bias, const float *restrict padded_bias, float *restrict padded_out,
    const float *restrict x, int x_stride, float *restrict y, int y_stride, const char *next, int64_t next_bytes) {
    const void *panel_ = P;
    /* the groups after the first read the slice from cache, bound by the multiply-adds: they prefetch `next` (the
     * panel this thread takes next) into L2, spread evenly over their inputs, so that reading it overlaps them */
    const int64_t next_lines = (next_bytes + 63) / 64, groups = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
    const int pf_lines =
        next && groups > 1 ? (int)((next_lines + (groups - 1) * n_in - 1) / ((groups - 1) * n_in)) : 0;
    for (int r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
        const int nr = rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK;
        const int64_t pf_first = (int64_t)(r0 / ROW_BLOCK - 1) * n_in * pf_lines;
        const int pf_lines_ = r0 && pf_first < next_lines ? pf_lines : 0;
        const char *pf_ = pf_lines_ ? next + pf_first * 64 : NULL;
        const float *xr = x + (int64_t)r0 * x_stride;
        float *yr = y + (int64_t)r0 * y_stride;
        if (b < n64 + n16) {
            const float *b_ = bias ? bias + o + c : NULL;
            float *y_ = yr + o + c;
            const int y_stride_ = y_stride;
            if (b >= n64) {
                FOR_ROWS(PASS(LANES, ROW_BLOCK))
            } else if (rows == 1) {
                BLOCK(1, PASS(64, 1));
            } else if (rows == 2) {
                BLOCK(2, PASS(64, 2));
            } else {
                FOR_ROWS(PASS(64, ROW_BLOCK))
            }
        } else {
            const float *b_ = bias ? padded_bias + c : NULL;
            float *y_ = padded_out + c;
            const int y_stride_ = LANES;
            FOR_ROWS(PASS(LANES, ROW_BLOCK))
            for (int r = 0; r < nr; r++)
                for (int j = c; j < c + pass * VL && j < tail; j++)
                    yr[(int64_t)r * y_stride + o + j] = padded_out[r * LANES + j];
        }
    }
}

/* Half panels are widened once per pass for products of at least this many rows: the pass's slice of the panel,
 * [n_in, pass vectors], becomes float32 in a scratch buffer of the thread's (at most WIDEN_MAX_BYTES: it must stay
 * in the core's cache), and every group of ROW_BLOCK rows reads that instead of widening it again. The values are
 * the same floats (widening is exact) in the same order, so the bits are those of the unwidened kernel. On the
 * 2-core AVX2 EPYC, the default target's 25 weights for 512 rows: 111 ms widening per group, 77-82 ms once per
 * pass (F.linear: 82-102). Few rows stay on the half panels: their products are bound by reading the weight, which
 * the half format halves. */
#define WIDEN_MIN_ROWS (4 * ROW_BLOCK)
#define WIDEN_MAX_BYTES (256 * 1024)

/* gemm_pass on float32 panels, compiled once for every format's widened passes (inlined into each, it tripled the
 * build time of a portable x86-64 build). */
static __attribute__((noinline)) void gemm_pass_f32(
    int rows, int n_in, const float *restrict P, int ld, int b, int n64, int n16, int tail, int o, int c, int pass,
    const float *restrict bias, const float *restrict padded_bias, float *restrict padded_out,
    const float *restrict x, int x_stride, float *restrict y, int y_stride, const char *next, int64_t next_bytes) {
    gemm_pass(PANEL_F32, rows, n_in, P, ld, b, n64, n16, tail, o, c, pass, bias, padded_bias, padded_out, x,
              x_stride, y, y_stride, next, next_bytes);
}

/* y[r] = x[r] @ W^T (+ bias) for rows r, W [n_out, n_in] given as panels P (pack_panels in native/__init__.py):
 * the columns of W^T ([n_in, n_out]) cut into blocks of 64 outputs, then of 16, then the rest padded with zeros to
 * 16, each block stored [n_in, 64 or 16] contiguously, one after the other; so block o starts at element o * n_in and
 * is read front to back. The padded tail goes through the same vector code as every other block (its extra outputs
 * are dropped): every output is computed the same way in every panel format. (A dot product per output over the
 * weight's own layout chains every multiply-add of a row into one accumulator and was latency-bound: ~4x slower.)
 * A block is computed in passes of PASS_VECS vectors of outputs (one pass with AVX-512, 16 outputs with AVX2), each
 * pass over all rows in groups of ROW_BLOCK, so that the pass's slice of the panel stays in cache across the groups.
 * Output blocks are claimed one at a time by `threads` OpenMP threads: a thread that another process preempts
 * mid-product leaves its blocks to the other instead of holding it at the end (each block is still computed whole by
 * one thread, in the same order, so the result is the same bits). A thread claims its next block before it computes
 * this one, and the groups of rows after the first prefetch that block's panel (gemm_pass): a first group reads its
 * panel from memory, the others from cache bound by the multiply-adds, and the prefetch lets the two overlap. On the
 * 2-core AVX-512 machine, 16 rows through a 127M-weight stack of half panels took 1.56x one row's time, 2.08x
 * without. On the 2-core machine, in process at 32 requests
 * (tree none, fresh prompts, prefill's products on this path) beside a process busy 0.5 ms of every 2 ms: 758 / 732
 * tokens/s against 688 / 691 with a static split; 853 against 851 with nothing beside. */
static inline __attribute__((always_inline)) void gemm_panels(
    const int FMT, int rows, int n_out, int n_in, const void *restrict P, const float *restrict bias,
    const float *restrict x, int x_stride, float *restrict y, int y_stride, int threads) {
    const int elem = FMT == PANEL_F32 ? 4 : 2;
    const int n64 = n_out / 64, n16 = (n_out - 64 * n64) / 16, tail = n_out - 64 * n64 - 16 * n16;
    const int blocks = n64 + n16 + (tail > 0);
    const int64_t widen_floats = (int64_t)n_in * PASS_VECS * VL;
    const int widen = FMT != PANEL_F32 && rows >= WIDEN_MIN_ROWS && widen_floats * 4 <= WIDEN_MAX_BYTES;
    (void)threads;
    int claimed = 0; /* blocks handed out: each thread claims its next block before it computes this one */
#pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
    {
        float *wide = widen ? aligned_alloc(64, (size_t)(widen_floats * 4 + 63) / 64 * 64) : NULL;
        int b = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (b < blocks) {
            const int nb = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            const int o = b < n64 ? 64 * b : 64 * n64 + 16 * (b - n64);
            const int ld = b < n64 ? 64 : LANES;
            const void *panel = (const char *)P + (int64_t)o * n_in * elem;
            const int next_o = nb < n64 ? 64 * nb : 64 * n64 + 16 * (nb - n64);
            const char *next = nb < blocks ? (const char *)P + (int64_t)next_o * n_in * elem : NULL;
            const int64_t next_bytes = next ? (int64_t)n_in * (nb < n64 ? 64 : LANES) * elem : 0;
            float padded_bias[LANES] = {0}, padded_out[ROW_BLOCK * LANES];
            if (b == n64 + n16 && bias)
                for (int j = 0; j < tail; j++) padded_bias[j] = bias[o + j];
            const int pass = rows <= 2 ? PASS(ld, rows) : PASS(ld, ROW_BLOCK);
            for (int c = 0; c < ld; c += pass * VL) {
                const void *slice = (const char *)panel + (int64_t)c * elem;
                const char *pf = c + pass * VL >= ld ? next : NULL; /* the block's last pass prefetches */
                if (wide) { /* this pass's slice as float32 [n_in, pass * VL], read by every group of rows */
                    const int width = pass * VL;
                    for (int i = 0; i < n_in; i++)
                        for (int v = 0; v < pass; v++)
                            *(vreg *)(wide + (int64_t)i * width + v * VL) =
                                load_panel(FMT, slice, (int64_t)i * ld + v * VL);
                    gemm_pass_f32(rows, n_in, wide, width, b, n64, n16, tail, o, c, pass, bias, padded_bias,
                                  padded_out, x, x_stride, y, y_stride, pf, next_bytes);
                } else if (FMT == PANEL_F32) {
                    gemm_pass_f32(rows, n_in, slice, ld, b, n64, n16, tail, o, c, pass, bias, padded_bias,
                                  padded_out, x, x_stride, y, y_stride, pf, next_bytes);
                } else {
                    gemm_pass(FMT, rows, n_in, slice, ld, b, n64, n16, tail, o, c, pass, bias, padded_bias,
                              padded_out, x, x_stride, y, y_stride, pf, next_bytes);
                }
            }
            b = nb;
        }
        free(wide);
    }
}

/* Threads for a product of this many multiply-adds: more only where waking them pays (set by native/__init__.py). */
static int parallel_min_macs = 1 << 19;
static int max_threads = 1;

void set_threads(int threads, int min_macs) {
    max_threads = threads;
    parallel_min_macs = min_macs;
}

int threads_for_macs(int64_t macs) { return macs >= parallel_min_macs ? max_threads : 1; }

static int threads_for(int rows, int n_out, int n_in) { return threads_for_macs((int64_t)rows * n_out * n_in); }

void gemm_rows(int format, int rows, int n_out, int n_in, const void *restrict P, const float *restrict bias,
               const float *restrict x, int x_stride, float *restrict y, int y_stride) {
    const int threads = threads_for(rows, n_out, n_in);
    if (format == PANEL_F16)
        gemm_panels(PANEL_F16, rows, n_out, n_in, P, bias, x, x_stride, y, y_stride, threads);
    else if (format == PANEL_BF16)
        gemm_panels(PANEL_BF16, rows, n_out, n_in, P, bias, x, x_stride, y, y_stride, threads);
    else
        gemm_panels(PANEL_F32, rows, n_out, n_in, P, bias, x, x_stride, y, y_stride, threads);
}

/* y [rows, n_out] = x [rows, n_in] @ W^T (+ bias), W as panels of `format` (PANEL_*): a Linear layer's product for
 * a few rows (cpu_gemm's "native" path). */
void linear_panels(int format, int rows, int n_out, int n_in, const void *P, const float *bias, const float *x,
                   float *y) {
    gemm_rows(format, rows, n_out, n_in, P, bias, x, n_in, y, n_out);
}
