/* The few-row GEMM of gemm_cpu.c, for the other native kernels. */
#ifndef RAY_SPECDEC_GEMM_CPU_H
#define RAY_SPECDEC_GEMM_CPU_H

#include <stdint.h>

/* Element formats of a packed weight ("panels"); the numbers are part of linear_panels' interface. */
#define PANEL_F32 0
#define PANEL_F16 1
#define PANEL_BF16 2

/* y[r] = x[r] @ W^T (+ bias), W [n_out, n_in] as panels of `format`; rows are x_stride / y_stride floats apart. */
void gemm_rows(int format, int rows, int n_out, int n_in, const void *restrict P, const float *restrict bias,
               const float *restrict x, int x_stride, float *restrict y, int y_stride);

/* Threads for work of this many multiply-adds: torch's intra-op count when it is big enough to pay for waking them
 * (set_threads), else 1. */
int threads_for_macs(int64_t macs);

#endif
