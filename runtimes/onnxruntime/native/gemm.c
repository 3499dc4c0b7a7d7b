/* The micro-kernel behind geir_gemm (gemm.h), written with GCC vector extensions so that one source
 * compiles to AVX-512, AVX2/FMA or SSE/NEON code for the machine the library is built on (-march=native).
 * This file alone allows multiply-add contraction: attention's matrix products have no bit-exact
 * contract (spec 1: "no FMA requirement; matmul/sum order unspecified"), unlike the rotary and MoE
 * kernels, which stay bit-identical to the NumPy runtime. */
#pragma GCC optimize("fp-contract=fast")
#include "vecmath.h"

#define MR 6
#define KC 256 /* k per block: a B panel of KC x 2 vectors stays in L1 across the i tiles */

/* One rows x (nv * GEIR_VEC) tile of C at column j (rows 6, 4 or 2: a short last tile computes no more rows than
 * it needs, to within one); rows r >= mr repeat row mr - 1 and are not stored. */
static inline __attribute__((always_inline)) void tile(int rows, int nv, int64_t k, const float* const a[MR], int64_t a_step,
                                                        const float* const* b, int64_t j, float* const c[MR], int mr,
                                                        int accumulate) {
  vf acc[MR][2];
  for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = (vf){0};
  const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5];
  for (int64_t p = 0; p < k; p++) {
    const float* row = b[p] + j;
    vf b0 = vf_load(row), b1 = nv == 2 ? vf_load(row + GEIR_VEC) : (vf){0};
    int64_t o = p * a_step;
#define GEIR_ROW(r, ar)                    \
  if (rows > r) {                          \
    float s = ar[o];                       \
    acc[r][0] += s * b0;                   \
    if (nv == 2) acc[r][1] += s * b1;      \
  }
    GEIR_ROW(0, a0) GEIR_ROW(1, a1) GEIR_ROW(2, a2) GEIR_ROW(3, a3) GEIR_ROW(4, a4) GEIR_ROW(5, a5)
#undef GEIR_ROW
  }
  for (int r = 0; r < mr; r++)
    for (int v = 0; v < nv; v++) {
      float* dst = c[r] + j + v * GEIR_VEC;
      vf_store(dst, accumulate ? vf_load(dst) + acc[r][v] : acc[r][v]);
    }
}

void geir_gemm(int64_t m, int64_t n, int64_t k, const float* const* a_rows, int64_t a_step,
               const float* const* b_rows, float* const* c_rows, int accumulate) {
  if (k == 0 && !accumulate) {
    for (int64_t i = 0; i < m; i++) memset(c_rows[i], 0, (size_t)n * sizeof(float));
    return;
  }
  for (int64_t k0 = 0; k0 < k; k0 += KC) {
    int64_t kc = k - k0 < KC ? k - k0 : KC;
    int add = accumulate || k0 > 0;
    for (int64_t j = 0; j < n; j += 2 * GEIR_VEC) {
      int two = j + 2 * GEIR_VEC <= n;
      for (int64_t i = 0; i < m; i += MR) {
        int mr = m - i < MR ? (int)(m - i) : MR;
        const float* a[MR];
        float* c[MR];
        for (int r = 0; r < MR; r++) {
          int64_t row = i + (r < mr ? r : mr - 1);
          a[r] = a_rows[row] + k0 * a_step;
          c[r] = c_rows[row];
        }
        if (mr > 4)
          two ? tile(6, 2, kc, a, a_step, b_rows + k0, j, c, mr, add) : tile(6, 1, kc, a, a_step, b_rows + k0, j, c, mr, add);
        else if (mr > 2)
          two ? tile(4, 2, kc, a, a_step, b_rows + k0, j, c, mr, add) : tile(4, 1, kc, a, a_step, b_rows + k0, j, c, mr, add);
        else
          two ? tile(2, 2, kc, a, a_step, b_rows + k0, j, c, mr, add) : tile(2, 1, kc, a, a_step, b_rows + k0, j, c, mr, add);
      }
    }
  }
}

int geir_gemm_vector_floats(void) { return GEIR_VEC; }
