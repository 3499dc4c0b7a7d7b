/* Register-tiled float32 matrix multiply over row pointers, for the attention kernels.
 *
 * C(i, j) (=, or += when accumulate) sum_p A(i, p) * B(p, j) for i < m, j < n, p < k, where
 * A(i, p) = a_rows[i][p * a_step], B(p, j) = b_rows[p][j] and row i of C is c_rows[i]. Rows given by
 * pointers let the attention kernels multiply gathered keys in place (no copy into a dense matrix) and
 * read a transposed operand through a_step. n must be a multiple of GEIR_VEC floats and every B and C
 * row must be readable / writable for n floats (the callers pad their rows with zeros). ``work`` holds
 * geir_gemm_work_floats(n, k) floats, the copies of operand blocks (gemm.c says why); each thread its own.
 *
 * The micro-kernel keeps a 6 x 2*GEIR_VEC tile of C in registers and uses fused multiply-adds where
 * the CPU has them; the summation order over p is fixed (blocks of GEIR_KC, then p ascending), so equal
 * inputs give equal bits on every run. */
#ifndef GEIR_GEMM_H
#define GEIR_GEMM_H
#include "abi.h"

#if defined(__AVX512F__)
#define GEIR_VEC 16
#elif defined(__AVX__)
#define GEIR_VEC 8
#else
#define GEIR_VEC 4 /* SSE, NEON: 16-byte vectors */
#endif

/* n rounded up to a whole number of vectors: the padded row width of every gemm operand. */
static inline int64_t geir_padded(int64_t n) { return (n + GEIR_VEC - 1) / GEIR_VEC * GEIR_VEC; }

#define GEIR_KC 256 /* steps of p per block: a B panel of GEIR_KC x 2 vectors is 16 KiB with AVX2, half of L1 */
#define GEIR_MC 120 /* rows of A per block (a multiple of the 6-row tile): 120 KiB of packed A, in L2 */

/* The steps of p in one block of a product over k steps: GEIR_KC, or all of k when fewer (at least 1). */
static inline int64_t geir_gemm_block_steps(int64_t k) { return k < 1 ? 1 : k < GEIR_KC ? k : GEIR_KC; }

/* Floats of the work buffer for a product n wide over k steps: a packed B block and a packed A block, each no
 * deeper than k (a product n wide over a few steps, as a large head group gives, needs no GEIR_KC-deep block). */
static inline int64_t geir_gemm_work_floats(int64_t n, int64_t k) {
  return geir_gemm_block_steps(k) * (geir_padded(n) + GEIR_MC);
}

GEIR_INTERNAL void geir_gemm(int64_t m, int64_t n, int64_t k, const float* const* a_rows, int64_t a_step,
                             const float* const* b_rows, float* const* c_rows, int accumulate, float* work);
/* The vector width and tile the library was built with, for the benchmark's report. */
int geir_gemm_vector_floats(void);

#endif
