/* Vector helpers for the attention kernels: GCC vector types of the gemm's width, a select, and a
 * float32 exp accurate to about 1 ulp (Cephes' polynomial on [-ln2/2, ln2/2] scaled by 2^n), so the
 * softmax runs GEIR_VEC lanes at a time instead of one libm call per score. */
#ifndef GEIR_VECMATH_H
#define GEIR_VECMATH_H
#include "gemm.h"
#include "half.h"

typedef float vf __attribute__((vector_size(GEIR_VEC * 4)));
typedef int32_t vi __attribute__((vector_size(GEIR_VEC * 4)));

static inline vf vf_load(const float* p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline void vf_store(float* p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vf_splat(float x) {
  vf v = {0};
  for (int i = 0; i < GEIR_VEC; i++) v[i] = x;
  return v;
}
/* mask ? a : b, lane by lane (mask lanes are all ones or all zeros, as comparisons give). */
static inline vf vf_select(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* e^x; exactly 0 below the smallest normal result, inf above the largest, NaN for NaN. */
static inline vf vf_exp(vf x) {
  const vf lo = vf_splat(-87.33654f), hi = vf_splat(88.72283f), round = vf_splat(12582912.0f);
  vf xc = vf_select(x < lo, lo, vf_select(x > hi, hi, x));
  vf n = (xc * vf_splat(1.44269504f) + round) - round; /* nearest integer of x / ln 2 */
  vf r = (xc - n * vf_splat(0.693359375f)) - n * vf_splat(-2.12194440e-4f);
  vf p = vf_splat(1.9875691500e-4f);
  p = p * r + vf_splat(1.3981999507e-3f);
  p = p * r + vf_splat(8.3334519073e-3f);
  p = p * r + vf_splat(4.1665795894e-2f);
  p = p * r + vf_splat(1.6666665459e-1f);
  p = p * r + vf_splat(5.0000001201e-1f);
  vf y = (p * r * r + r) + vf_splat(1.0f);
  vi k = __builtin_convertvector(n, vi), top = k > 127; /* 2^128 is not a float: scale by 2^127, then 2 */
  k += top;                                              /* comparison lanes are -1 where true */
  y = y * (vf)((k + 127) << 23);
  y = vf_select(top, y + y, y);
  y = vf_select(x < lo, vf_splat(0.0f), y);
  y = vf_select(x > hi, vf_splat(__builtin_inff()), y);
  return vf_select(x != x, x, y);
}

typedef uint32_t vu __attribute__((vector_size(GEIR_VEC * 4)));

/* rnd(): each lane rounded to ``type`` (float16 / bfloat16, to nearest even) and widened back, in
 * registers; the same bits as a store_f32 / load_f32 round trip (bfloat16 NaN -> sign | 0x7fc0). */
static inline vf vf_round(int type, vf x) {
  if (type == T_BFLOAT16) {
    vu u = (vu)x, rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    vu quiet = (u & 0x80000000u) | 0x7fc00000u;
    return vf_select(x != x, (vf)quiet, (vf)rounded);
  }
  if (type != T_FLOAT16) return x;
#if defined(__AVX512F__) && GEIR_VEC == 16
  return (vf)_mm512_cvtph_ps(_mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__) && GEIR_VEC == 8
  return (vf)_mm256_cvtph_ps(_mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT));
#else
  for (int i = 0; i < GEIR_VEC; i++) x[i] = f16_to_f32_scalar(f32_to_f16_scalar(x[i]));
  return x;
#endif
}

#endif
