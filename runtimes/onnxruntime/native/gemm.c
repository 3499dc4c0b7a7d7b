/* The micro-kernel behind geir_gemm (gemm.h), written with GCC vector extensions so that one source
 * compiles to AVX-512, AVX2/FMA or SSE/NEON code for the machine the library is built on (-march=native).
 * This file alone allows multiply-add contraction: attention's matrix products have no bit-exact
 * contract (spec 1: "no FMA requirement; matmul/sum order unspecified"), unlike the rotary and MoE
 * kernels, which stay bit-identical to the NumPy runtime.
 *
 * Packing. Within a block of GEIR_KC steps of p, a tile reads a panel of B (KC rows of 2 vectors) and
 * MR rows of A. Read in place, rows whose addresses are a multiple of 512 bytes apart (the transposed
 * operands of 128 heads) or gathered key rows of 2 KiB fall into a few of L1's 64 cache sets and evict
 * each other: every load comes from L2 (measured 52-72 GFLOP/s at the CANN attention shapes, against
 * 85-97 for the same code on small contiguous operands). So B is copied into contiguous panels once per
 * block when four tiles or more reuse them, and an A whose steps are farther apart than a cache line
 * into tiles interleaved by p; blocks of GEIR_MC rows of A then meet every panel while they sit in L2.
 * The copies move floats unchanged and the sums keep their order, so the bits are those of the
 * unpacked loops. */
#pragma GCC optimize("fp-contract=fast")
#include "vecmath.h"

#define MR 6
#define PACK_B_MIN_ROWS (4 * MR) /* fewer tiles than that read B in place: the copy would cost more than it saves */

/* Whether ``lines`` cache lines ``stride`` bytes apart stay in L1 together (a model of the 32 KiB, 8-way,
 * 64-set L1 of current x86 cores: lines a multiple of 64 bytes apart use 64 / gcd(stride / 64, 64) sets),
 * with half of it left for the other operand. */
static int stays_in_l1(int64_t stride, int64_t lines) {
  if (stride <= 64 || stride % 64) return lines <= 256;
  int64_t a = (stride / 64) % 64, b = 64;
  while (a) {
    int64_t t = b % a;
    b = a;
    a = t;
  }
  return lines <= 4 * (64 / b);
}

/* Whether B is worth copying: enough tiles read it, and its rows are gathered (no common stride) or so far
 * apart that a panel does not stay in L1. */
static int pack_b_needed(int64_t m, const float* const* b_rows, int64_t kc) {
  if (m < PACK_B_MIN_ROWS || kc < 2) return 0;
  int64_t stride = (int64_t)((const char*)b_rows[1] - (const char*)b_rows[0]);
  for (int64_t p = 2; p < kc; p++)
    if ((const char*)b_rows[p] - (const char*)b_rows[p - 1] != stride) return 1;
  return stride < 0 || !stays_in_l1(stride, kc);
}

/* One rows x (nv * GEIR_VEC) tile of C at column j (rows 6, 4 or 2: a short last tile computes no more rows than
 * it needs, to within one); rows r >= mr repeat row mr - 1 and are not stored. A is the packed tile ``ap``
 * (A(r, p) = ap[p * MR + r]) when ``packed_a``, else the rows a[r] read every a_step floats; B is the packed panel
 * ``bp`` (nv vectors per p) when ``packed_b``, else the rows b[p] from column j. */
static inline __attribute__((always_inline)) void tile(int rows, int nv, int packed_a, int packed_b, int64_t kc,
                                                        const float* ap, const float* const a[MR], int64_t a_step,
                                                        const float* bp, const float* const* b, int64_t j,
                                                        float* const c[MR], int mr, int add) {
  vf acc[MR][2];
  for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = (vf){0};
  const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5];
  for (int64_t p = 0; p < kc; p++) {
    const float* row = packed_b ? bp + p * nv * GEIR_VEC : b[p] + j;
    vf b0 = vf_load(row), b1 = nv == 2 ? vf_load(row + GEIR_VEC) : (vf){0};
    int64_t o = p * a_step;
#define GEIR_ROW(r, ar)                          \
  if (rows > r) {                                \
    float s = packed_a ? ap[p * MR + r] : ar[o]; \
    acc[r][0] += s * b0;                         \
    if (nv == 2) acc[r][1] += s * b1;            \
  }
    GEIR_ROW(0, a0) GEIR_ROW(1, a1) GEIR_ROW(2, a2) GEIR_ROW(3, a3) GEIR_ROW(4, a4) GEIR_ROW(5, a5)
#undef GEIR_ROW
  }
  for (int r = 0; r < mr; r++)
    for (int v = 0; v < nv; v++) {
      float* dst = c[r] + j + v * GEIR_VEC;
      vf_store(dst, add ? vf_load(dst) + acc[r][v] : acc[r][v]);
    }
}

/* The tile for mr rows, a full (two) or half panel, and the operand forms. */
static inline __attribute__((always_inline)) void tile_for(int mr, int two, int packed_a, int packed_b, int64_t kc,
                                                            const float* ap, const float* const a[MR], int64_t a_step,
                                                            const float* bp, const float* const* b, int64_t j,
                                                            float* const c[MR], int add) {
  int rows = mr > 4 ? 6 : mr > 2 ? 4 : 2;
#define GEIR_TILE(r, nv) tile(r, nv, packed_a, packed_b, kc, ap, a, a_step, bp, b, j, c, mr, add)
  if (rows == 6)
    two ? GEIR_TILE(6, 2) : GEIR_TILE(6, 1);
  else if (rows == 4)
    two ? GEIR_TILE(4, 2) : GEIR_TILE(4, 1);
  else
    two ? GEIR_TILE(2, 2) : GEIR_TILE(2, 1);
#undef GEIR_TILE
}

/* B(p, j) for p < kc into panels of 2 vectors (the last one 1 vector when n is an odd number of them), the
 * panel of column j at bp + j * kc. */
static void pack_b(const float* const* b_rows, int64_t kc, int64_t n, float* bp) {
  for (int64_t p = 0; p < kc; p++) {
    const float* row = b_rows[p];
    for (int64_t j = 0; j < n; j += 2 * GEIR_VEC) {
      float* dst = bp + j * kc;
      if (j + 2 * GEIR_VEC <= n) {
        vf_store(dst + p * 2 * GEIR_VEC, vf_load(row + j));
        vf_store(dst + p * 2 * GEIR_VEC + GEIR_VEC, vf_load(row + j + GEIR_VEC));
      } else {
        vf_store(dst + p * GEIR_VEC, vf_load(row + j));
      }
    }
  }
}

/* Rows [i0, i0 + mc) of A at steps [k0, k0 + kc) into tiles of MR rows, p-major within a tile, tile t at
 * ap + t * kc (a short tile repeats its last row, as tile() reads it). */
static void pack_a(const float* const* a_rows, int64_t a_step, int64_t k0, int64_t i0, int64_t mc, int64_t kc,
                   float* ap) {
  for (int64_t t = 0; t < mc; t += MR) {
    int mr = mc - t < MR ? (int)(mc - t) : MR;
    const float* a[MR];
    for (int r = 0; r < MR; r++) a[r] = a_rows[i0 + t + (r < mr ? r : mr - 1)] + k0 * a_step;
    float* dst = ap + t * kc;
    for (int64_t p = 0; p < kc; p++)
      for (int r = 0; r < MR; r++) dst[p * MR + r] = a[r][p * a_step];
  }
}

void geir_gemm(int64_t m, int64_t n, int64_t k, const float* const* a_rows, int64_t a_step,
               const float* const* b_rows, float* const* c_rows, int accumulate, float* work) {
  if (k == 0 && !accumulate) {
    for (int64_t i = 0; i < m; i++) memset(c_rows[i], 0, (size_t)n * sizeof(float));
    return;
  }
  float *bp = work, *ap = work + geir_gemm_block_steps(k) * n;
  for (int64_t k0 = 0; k0 < k; k0 += GEIR_KC) {
    int64_t kc = k - k0 < GEIR_KC ? k - k0 : GEIR_KC;
    int add = accumulate || k0 > 0;
    int packed_a = a_step > 1 && !stays_in_l1(a_step * (int64_t)sizeof(float), kc);
    int packed_b = pack_b_needed(m, b_rows + k0, kc);
    if (packed_b) pack_b(b_rows + k0, kc, n, bp);
    for (int64_t i0 = 0; i0 < m; i0 += GEIR_MC) {
      int64_t mc = m - i0 < GEIR_MC ? m - i0 : GEIR_MC;
      if (packed_a) pack_a(a_rows, a_step, k0, i0, mc, kc, ap);
      for (int64_t j = 0; j < n; j += 2 * GEIR_VEC) {
        int two = j + 2 * GEIR_VEC <= n;
        for (int64_t t = 0; t < mc; t += MR) {
          int mr = mc - t < MR ? (int)(mc - t) : MR;
          const float* a[MR];
          float* c[MR];
          for (int r = 0; r < MR; r++) {
            int64_t row = i0 + t + (r < mr ? r : mr - 1);
            a[r] = a_rows[row] + k0 * a_step;
            c[r] = c_rows[row];
          }
          const float *ap_t = ap + t * kc, *panel = bp + j * kc, *const *b = b_rows + k0;
          if (packed_a && packed_b)
            tile_for(mr, two, 1, 1, kc, ap_t, a, a_step, panel, b, j, c, add);
          else if (packed_a)
            tile_for(mr, two, 1, 0, kc, ap_t, a, a_step, panel, b, j, c, add);
          else if (packed_b)
            tile_for(mr, two, 0, 1, kc, ap_t, a, a_step, panel, b, j, c, add);
          else
            tile_for(mr, two, 0, 0, kc, ap_t, a, a_step, panel, b, j, c, add);
        }
      }
    }
  }
}

int geir_gemm_vector_floats(void) { return GEIR_VEC; }

/* Test hook: C = (or +=) A B with A(i, p) = a[i * a_row + p * a_step], row p of B at b + b_offsets[p] and row i
 * of C at c + i * c_row, through geir_gemm with a work buffer of its own. n must be a multiple of
 * geir_gemm_vector_floats(). Returns 0, or -1 when a buffer cannot be allocated. */
int geir_gemm_rows(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row, int64_t a_step, const float* b,
                   const int64_t* b_offsets, float* c, int64_t c_row, int accumulate) {
  if (m < 0 || n < 0 || k < 0 || n % GEIR_VEC) return -1;
  size_t pointers = (size_t)(2 * m + k + 1);
  float* work = (float*)geir_scratch((size_t)geir_gemm_work_floats(n, k) * sizeof(float), 0);
  void** rows = (void**)geir_scratch(pointers * sizeof(void*), 0);
  if (!work || !rows) {
    free(work);
    free(rows);
    return -1;
  }
  const float** a_rows = (const float**)rows;
  const float** b_rows = a_rows + m;
  float** c_rows = (float**)(b_rows + k);
  for (int64_t i = 0; i < m; i++) {
    a_rows[i] = a + i * a_row;
    c_rows[i] = c + i * c_row;
  }
  for (int64_t p = 0; p < k; p++) b_rows[p] = b + b_offsets[p];
  geir_gemm(m, n, k, a_rows, a_step, b_rows, c_rows, accumulate, work);
  free(work);
  free(rows);
  return 0;
}
