/* The register-wide float vector of the native kernels, and the fused multiply-add they write their sums with. */
#ifndef RAY_SPECDEC_SIMD_CPU_H
#define RAY_SPECDEC_SIMD_CPU_H

#include <math.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

/* One hardware vector of floats (GCC / Clang vector extension), loadable from any float address: 16 floats with
 * AVX-512, else 8 (AVX2's width; a wider value is split into two registers per operand, and loops that keep many
 * of them live no longer fit the register file). */
#ifdef __AVX512F__
typedef float vreg __attribute__((vector_size(64), aligned(4)));
#define VL 16
#else
typedef float vreg __attribute__((vector_size(32), aligned(4)));
#define VL 8
#endif

/* a * b + c, rounded once where the CPU has fused multiply-add. A sum that must be the same bits on two paths (a
 * product row in a block of 6 rows or alone, an attention output column summed by one loop or another) is written
 * with these, not left to the compiler's contraction of a * b + c, which depends on the loop around it: GCC tuned
 * for AMD Zen (-march=native there) leaves a loop with a single accumulator chain as a multiply and an add
 * (avoid_fma_chains) and fuses the same sum in a loop of two chains. */
static inline vreg vfma(vreg a, vreg b, vreg c) {
#if defined(__AVX512F__)
    return (vreg)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vreg)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline float sfma(float a, float b, float c) {
#if defined(__AVX512F__) || defined(__FMA__)
    return fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

#endif
