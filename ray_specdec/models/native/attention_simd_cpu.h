/* The native kernels' 16-lane vector math: the vf16 type, its fused multiply-add, selects, loads and stores of a
 * partial vector, an exp, SiLU and softplus of their own, and lane sums in a fixed tree (with 8-lane folds of the
 * same tree on AVX2), so that a key's score is the same bits whichever keys share its chunk. Static inline functions:
 * included by attention_cpu.c, ssm_scan_cpu.c and ssm_rows_cpu.c. */
#ifndef RAY_SPECDEC_ATTENTION_SIMD_CPU_H
#define RAY_SPECDEC_ATTENTION_SIMD_CPU_H

#include <stdint.h>

#include "simd_cpu.h"

typedef float vf16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));

/* vfma for 16-lane vectors (simd_cpu.h says why sums use it). */
static inline vf16 fma16(vf16 a, vf16 b, vf16 c) {
#if defined(__AVX512F__)
    return vfma(a, b, c);
#elif defined(__FMA__)
    union halves { vf16 whole; __m256 half[2]; } x = {a}, y = {b}, z = {c}, r;
    r.half[0] = _mm256_fmadd_ps(x.half[0], y.half[0], z.half[0]);
    r.half[1] = _mm256_fmadd_ps(x.half[1], y.half[1], z.half[1]);
    return r.whole;
#else
    return a * b + c;
#endif
}

static inline vf16 vselect(vi16 take_a, vf16 a, vf16 b) { return (vf16)(((vi16)a & take_a) | ((vi16)b & ~take_a)); }
static inline vf16 vmax(vf16 a, vf16 b) { return vselect(a > b, a, b); }
static inline vf16 vmin(vf16 a, vf16 b) { return vselect(a < b, a, b); }

/* Keeps fast math from reassociating what it wraps into the sum around it (where the compiler can be told). */
#if defined(__has_builtin)
#if __has_builtin(__builtin_assoc_barrier)
#define ASSOC_BARRIER(x) __builtin_assoc_barrier(x)
#elif __has_builtin(__arithmetic_fence)
#define ASSOC_BARRIER(x) __arithmetic_fence(x)
#endif
#endif
#ifndef ASSOC_BARRIER
#define ASSOC_BARRIER(x) (x)
#endif

/* exp per lane, within ~4 ulp of the exact value for inputs in [-87, 88] and exactly 0 below -87 (masked scores):
 * 2^n p(r) with n = round(x / ln 2), r = x - n ln 2 (|r| <= ln 2 / 2; ln 2 split in two so the product is exact, the
 * two subtractions kept apart: folded into one, r loses ~|n| ulp) and p the degree-6 Taylor polynomial of exp. (libm's
 * expf would be a scalar call per lane: gcc does not vectorise it into libmvec.) */
static inline vf16 vexp(vf16 x) {
    const vf16 zero = {0};
    const vi16 underflow = x < -87.0f;
    x = vmin(vmax(x, zero - 87.0f), zero + 88.0f);
    /* round(x / ln 2) as truncation of a positive number: the conversion cannot be folded away by -ffast-math */
    const vi16 n = __builtin_convertvector(x * 1.44269504f + 128.5f, vi16) - 128;
    const vf16 nf = __builtin_convertvector(n, vf16);
    const vf16 r = ASSOC_BARRIER(x - nf * 0.693145752f) - nf * 1.42860677e-6f;
    vf16 p = r * (1.0f / 720) + (1.0f / 120);
    p = p * r + (1.0f / 24);
    p = p * r + (1.0f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vf16 two_n = (vf16)((n + 127) << 23);
    return (vf16)((vi16)(p * two_n) & ~underflow);
}

/* Lanes [0, w) from `w` floats at p (the rest 0), and back: a row's tail is a vector like the others. A whole
 * vector is one load (vf16 is 4-byte aligned: any float address), never assembled on the stack: a 64-byte load of
 * what smaller stores just wrote waits for them to retire. */
static inline vf16 load_lanes(const float *p, int w) {
    if (w == 16) return *(const vf16 *)p;
#if defined(__AVX512F__)
    return (vf16)_mm512_maskz_loadu_ps((__mmask16)((1u << w) - 1), p);
#else
    vf16 v = {0};
    for (int l = 0; l < w; l++) v[l] = p[l];
    return v;
#endif
}

static inline void store_lanes(float *p, vf16 v, int w) {
    if (w == 16) {
        *(vf16 *)p = v;
        return;
    }
#if defined(__AVX512F__)
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << w) - 1), (__m512)v);
#else
    for (int l = 0; l < w; l++) p[l] = v[l];
#endif
}

/* x / (1 + exp(-x)) per lane (a few ulp of the exact value). */
static inline vf16 vsilu(vf16 x) { return x / (vexp(-x) + 1.0f); }

/* log(1 + u) per lane for u in [0, 1]: 2 atanh(s), s = u / (2 + u) in [0, 1/3], by its series to s^15 (the next term
 * is below 1e-9 of the result); no cancellation, so tiny u keep their relative accuracy. */
static inline vf16 vlog1p_unit(vf16 u) {
    const vf16 s = u / (u + 2.0f), s2 = s * s;
    vf16 p = s2 * (1.0f / 15) + (1.0f / 13);
    p = p * s2 + (1.0f / 11);
    p = p * s2 + (1.0f / 9);
    p = p * s2 + (1.0f / 7);
    p = p * s2 + (1.0f / 5);
    p = p * s2 + (1.0f / 3);
    p = p * s2 + 1.0f;
    return 2.0f * s * p;
}

/* torch's softplus (beta 1, threshold 20: x above it is returned as it is) per lane, as max(x, 0) + log1p(exp(-|x|)),
 * which neither overflows nor loses a negative x's small result. */
static inline vf16 vsoftplus(vf16 x) {
    const vf16 zero = {0};
    const vf16 y = vmax(x, zero) + vlog1p_unit(vexp(vmin(x, zero - x)));
    return vselect(x > 20.0f, x, y);
}

/* Lane t of the result: the sum of p[t]'s 16 lanes, always in the same tree (lanes i and i + 8 first, then i + 4,
 * i + 2, i + 1), so a key's score is the same whichever keys share its chunk. */
static inline vf16 sum_lanes16(const vf16 p[16]) {
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

#ifndef __AVX512F__
/* The same lane-sum tree as sum_lanes16, in 8-lane vectors (one AVX2 register each), for 8 keys whose 16 lanes of
 * partial sums are a[t] = lanes 0-7 + lanes 8-15 (the tree's first step, done by the caller). fold4 of keys A, B:
 * lanes 0-3 A's a_i + a_{i+4}, lanes 4-7 B's; fold2 of [A | B] and [C | D]: [A's x_i + x_{i+2}, i < 2 | C's | B's |
 * D's]; fold1 of [A C | B D] and [E G | F H]: the sums of A C E G B D F H. Each is a permute (or an in-lane
 * shuffle) and one add, where sum_lanes16 with 16-lane vectors costs many cross-register shuffles on AVX2. */
typedef float vf8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));

static inline vf8 fold4(vf8 a, vf8 b) {
    const vi8 lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = {4, 5, 6, 7, 12, 13, 14, 15};
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
static inline vf8 fold2(vf8 a, vf8 b) {
    const vi8 lo = {0, 1, 8, 9, 4, 5, 12, 13}, hi = {2, 3, 10, 11, 6, 7, 14, 15};
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
static inline vf8 fold1(vf8 a, vf8 b) {
    const vi8 lo = {0, 2, 8, 10, 4, 6, 12, 14}, hi = {1, 3, 9, 11, 5, 7, 13, 15};
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
#endif

#endif
