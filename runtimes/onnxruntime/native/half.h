/* float16 / bfloat16 <-> float32 conversions (round to nearest even), F16C where the CPU has it. */
#ifndef GEIR_HALF_H
#define GEIR_HALF_H
#include "abi.h"

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN -> sign | 0x7fc0, as ml_dtypes */
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fc0u;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

#if defined(__AVX2__)
/* f32_to_bf16 on the 8 lanes of a float32 vector (AVX2): the bfloat16 bits in the low half of each 32-bit lane. */
static inline __m256i bf16_round_8(__m256 v) {
  __m256i u = _mm256_castps_si256(v), top = _mm256_srli_epi32(u, 16);
  __m256i lsb = _mm256_and_si256(top, _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  __m256i quiet = _mm256_or_si256(_mm256_and_si256(top, _mm256_set1_epi32(0x8000)), _mm256_set1_epi32(0x7fc0));
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet),
                                              _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
#endif

static inline float f16_to_f32_scalar(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu, u;
  float f;
  if (em >= 0x7c00u) {
    u = sign | 0x7f800000u | ((em & 0x3ffu) << 13);
  } else {
    u = em << 13;
    memcpy(&f, &u, 4);
    f *= 5.192296858534828e33f; /* 2^112: rebias the exponent; subnormals stay exact */
    memcpy(&u, &f, 4);
    u |= sign;
  }
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_f16_scalar(float value) { /* round to nearest even */
  uint32_t u;
  memcpy(&u, &value, 4);
  uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to infinity */
  if (a < 0x38800000u) {                                  /* float16 subnormal or zero */
    float f;
    memcpy(&f, &a, 4);
    f += 0.5f; /* the float32 addition rounds at float16's subnormal step, to nearest even */
    uint32_t r;
    memcpy(&r, &f, 4);
    return (uint16_t)(sign | (r - 0x3f000000u));
  }
  uint32_t odd = (a >> 13) & 1u;
  a += 0xc8000fffu + odd; /* rebias the exponent by -112 and round */
  return (uint16_t)(sign | (a >> 13));
}

static inline void load_f32(const void* src, int type, float* dst, size_t n) {
  size_t i = 0;
  if (type == T_FLOAT) {
    memcpy(dst, src, n * 4);
  } else if (type == T_BFLOAT16) {
    const uint16_t* s = (const uint16_t*)src;
    for (; i < n; i++) dst[i] = bf16_to_f32(s[i]);
  } else {
    const uint16_t* s = (const uint16_t*)src;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i))));
#endif
    for (; i < n; i++) dst[i] = f16_to_f32_scalar(s[i]);
  }
}

static inline void store_f32(const float* src, int type, void* dst, size_t n) {
  size_t i = 0;
  if (type == T_FLOAT) {
    memcpy(dst, src, n * 4);
  } else if (type == T_BFLOAT16) {
    uint16_t* d = (uint16_t*)dst;
    for (; i < n; i++) d[i] = f32_to_bf16(src[i]);
  } else {
    uint16_t* d = (uint16_t*)dst;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128((__m128i*)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) d[i] = f32_to_f16_scalar(src[i]);
  }
}

static inline size_t elem_size(int type) { return type == T_FLOAT || type == T_INT32 ? 4 : type == T_INT64 ? 8 : 2; }

#endif
