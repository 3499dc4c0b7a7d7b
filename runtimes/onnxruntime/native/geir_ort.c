/* geir native custom-op kernels for ONNX Runtime (CPU): the rotary ops and the MoE unpermute ops.
 *
 * ONNX Runtime's C headers are not on any registry we can reach, so this file declares the few
 * ABI entries it uses itself. The C API is an append-only table of function pointers (OrtApi);
 * each entry below is used by its slot number in that table, and the OrtCustomOp struct is laid
 * out as ONNX Runtime reads it at version 17. The oldest runtime supported is ONNX Runtime 1.17
 * (API version 17, which added KernelContext_ParallelFor); tests prove the entries on the
 * installed runtime and on 1.17.
 *
 * Numerics match geir's NumPy runtime: float32 compute, products and sums in the same order,
 * no FMA contraction (built with -ffp-contract=off), one round-to-nearest-even per output.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;

typedef struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
} OrtApiBase;

enum { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { T_UNDEFINED = 0, T_FLOAT = 1, T_INT32 = 6, T_INT64 = 7, T_FLOAT16 = 10, T_BFLOAT16 = 16 };
enum { IO_REQUIRED = 0, IO_OPTIONAL = 1 };

#define GEIR_API_VERSION 17
/* Slot numbers in OrtApi (0-based), append-only across releases. */
enum {
  SLOT_CreateStatus = 0,
  SLOT_GetErrorMessage = 2,
  SLOT_CreateCustomOpDomain = 26,
  SLOT_CustomOpDomain_Add = 27,
  SLOT_AddCustomOpDomain = 28,
  SLOT_GetTensorMutableData = 51,
  SLOT_GetTensorElementType = 60,
  SLOT_GetDimensionsCount = 61,
  SLOT_GetDimensions = 62,
  SLOT_GetTensorTypeAndShape = 65,
  SLOT_KernelInfoGetAttribute_int64 = 86,
  SLOT_KernelContext_GetInputCount = 88,
  SLOT_KernelContext_GetInput = 90,
  SLOT_KernelContext_GetOutput = 91,
  SLOT_ReleaseStatus = 93,
  SLOT_ReleaseTensorTypeAndShapeInfo = 99,
  SLOT_KernelInfoGetAttributeArray_int64 = 163,
  SLOT_GetBuildInfoString = 254,
  SLOT_KernelContext_ParallelFor = 274,
};

static const OrtApi* g_api;
#define FN(type, slot) ((type)(((void* const*)g_api)[slot]))

typedef OrtStatus* (*CreateStatusFn)(int, const char*);
typedef const char* (*GetErrorMessageFn)(const OrtStatus*);
typedef void (*ReleaseStatusFn)(OrtStatus*);
typedef OrtStatus* (*CreateCustomOpDomainFn)(const char*, OrtCustomOpDomain**);
typedef OrtStatus* (*CustomOpDomainAddFn)(OrtCustomOpDomain*, const void*);
typedef OrtStatus* (*AddCustomOpDomainFn)(OrtSessionOptions*, OrtCustomOpDomain*);
typedef OrtStatus* (*GetTensorMutableDataFn)(OrtValue*, void**);
typedef OrtStatus* (*GetTensorElementTypeFn)(const OrtTensorTypeAndShapeInfo*, int*);
typedef OrtStatus* (*GetDimensionsCountFn)(const OrtTensorTypeAndShapeInfo*, size_t*);
typedef OrtStatus* (*GetDimensionsFn)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t);
typedef OrtStatus* (*GetTensorTypeAndShapeFn)(const OrtValue*, OrtTensorTypeAndShapeInfo**);
typedef void (*ReleaseTensorTypeAndShapeInfoFn)(OrtTensorTypeAndShapeInfo*);
typedef OrtStatus* (*KernelInfoGetAttributeInt64Fn)(const OrtKernelInfo*, const char*, int64_t*);
typedef OrtStatus* (*KernelInfoGetAttributeArrayInt64Fn)(const OrtKernelInfo*, const char*, int64_t*, size_t*);
typedef OrtStatus* (*KernelContextGetInputCountFn)(const OrtKernelContext*, size_t*);
typedef OrtStatus* (*KernelContextGetInputFn)(const OrtKernelContext*, size_t, const OrtValue**);
typedef OrtStatus* (*KernelContextGetOutputFn)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**);
typedef OrtStatus* (*KernelContextParallelForFn)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*);
typedef const char* (*GetBuildInfoStringFn)(void);

/* Kernel invocations, for the start-up self-test that proves a native kernel (not a fallback) ran. */
static volatile long g_calls;
long geir_native_calls(void) { return g_calls; }

/* Every kernel allocation goes through scratch(), so the tests can make the n-th next one fail
 * (geir_fail_allocation(n)) and prove that the failure reaches the caller as an error. */
static long g_fail_in = -1;
void geir_fail_allocation(long n) { __atomic_store_n(&g_fail_in, n, __ATOMIC_SEQ_CST); }
static void* scratch(size_t bytes, int zeroed) {
  if (__atomic_load_n(&g_fail_in, __ATOMIC_SEQ_CST) >= 0 && __atomic_fetch_sub(&g_fail_in, 1, __ATOMIC_SEQ_CST) == 0)
    return NULL;
  return zeroed ? calloc(bytes, 1) : malloc(bytes);
}

/* ---------------------------------------------------------------------------------------- */
/* float16 / bfloat16 <-> float32                                                            */

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN -> sign | 0x7fc0 */
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x7fc0u;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

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

static void load_f32(const void* src, int type, float* dst, size_t n) {
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

static void store_f32(const float* src, int type, void* dst, size_t n) {
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

static size_t elem_size(int type) { return type == T_FLOAT || type == T_INT32 ? 4 : type == T_INT64 ? 8 : 2; }

/* ---------------------------------------------------------------------------------------- */
/* tensor access                                                                             */

typedef struct {
  const OrtValue* value;
  int type;
  size_t rank;
  int64_t dims[8];
  int64_t size;
  void* data;
} Tensor;

static OrtStatus* error(const char* op, const char* fmt, long a, long b, long c) {
  char msg[512];
  char detail[400];
  snprintf(detail, sizeof detail, fmt, a, b, c);
  snprintf(msg, sizeof msg, "%s (geir native kernel): %s", op, detail);
  return FN(CreateStatusFn, SLOT_CreateStatus)(ORT_INVALID_ARGUMENT, msg);
}

static OrtStatus* out_of_memory(const char* op) {
  char msg[200];
  snprintf(msg, sizeof msg, "%s (geir native kernel): out of memory for a scratch buffer", op);
  return FN(CreateStatusFn, SLOT_CreateStatus)(ORT_FAIL, msg);
}

static OrtStatus* describe(const OrtValue* value, Tensor* t) {
  OrtTensorTypeAndShapeInfo* info;
  OrtStatus* st = FN(GetTensorTypeAndShapeFn, SLOT_GetTensorTypeAndShape)(value, &info);
  if (st) return st;
  size_t rank = 0;
  if (!st) st = FN(GetTensorElementTypeFn, SLOT_GetTensorElementType)(info, &t->type);
  if (!st) st = FN(GetDimensionsCountFn, SLOT_GetDimensionsCount)(info, &rank);
  if (!st && rank > 8) st = FN(CreateStatusFn, SLOT_CreateStatus)(ORT_INVALID_ARGUMENT, "rank above 8");
  if (!st) st = FN(GetDimensionsFn, SLOT_GetDimensions)(info, t->dims, rank);
  FN(ReleaseTensorTypeAndShapeInfoFn, SLOT_ReleaseTensorTypeAndShapeInfo)(info);
  if (st) return st;
  t->rank = rank;
  t->size = 1;
  for (size_t k = 0; k < rank; k++) t->size *= t->dims[k];
  t->value = value;
  return FN(GetTensorMutableDataFn, SLOT_GetTensorMutableData)((OrtValue*)value, &t->data);
}

static OrtStatus* input(OrtKernelContext* ctx, size_t index, Tensor* t, int* present) {
  size_t count = 0;
  OrtStatus* st = FN(KernelContextGetInputCountFn, SLOT_KernelContext_GetInputCount)(ctx, &count);
  if (st) return st;
  const OrtValue* value = NULL;
  if (index < count) st = FN(KernelContextGetInputFn, SLOT_KernelContext_GetInput)(ctx, index, &value);
  if (st) return st;
  *present = value != NULL;
  return value ? describe(value, t) : NULL;
}

static OrtStatus* output(OrtKernelContext* ctx, size_t index, const int64_t* dims, size_t rank, Tensor* t) {
  OrtValue* value = NULL;
  OrtStatus* st = FN(KernelContextGetOutputFn, SLOT_KernelContext_GetOutput)(ctx, index, dims, rank, &value);
  return st ? st : describe(value, t);
}

/* ---------------------------------------------------------------------------------------- */
/* rotary (spec 2.4): y = c * g + m * g[partner], as geir's NumPy kernel                     */

typedef struct {
  int64_t mode, start, end, has_slice;
  int grad;
} RotaryKernel;

typedef struct {
  const RotaryKernel* k;
  Tensor x, cos, sin, out;
  int64_t length, rows_per_task, rows, cb, cs, cn;
  int* partner;
  float* sign;
} RotaryJob;

/* y[i] = c[i] * g[i] + m[i] * g[partner(i)] over the slice, in the pair layout of the mode; the
 * partner of a position is a fixed offset within contiguous segments, so every loop is a plain
 * vectorisable pass (the two products and the sum are rounded as the NumPy kernel rounds them). */
static void rotary_row(int64_t mode, int64_t L, const float* c, const float* m, const float* g, float* y) {
  if (mode == 1) {
    for (int64_t i = 0; i < L; i += 2) {
      float a = c[i] * g[i], b = m[i] * g[i + 1];
      float d = c[i + 1] * g[i + 1], e = m[i + 1] * g[i];
      y[i] = a + b;
      y[i + 1] = d + e;
    }
    return;
  }
  int64_t seg = mode == 2 ? L / 4 : L / 2; /* pairs (i, i + seg) inside each block of 2 * seg */
  for (int64_t base = 0; base < L; base += 2 * seg) {
    const float *c0 = c + base, *m0 = m + base, *g0 = g + base;
    float* y0 = y + base;
    for (int64_t i = 0; i < seg; i++) {
      float a = c0[i] * g0[i], b = m0[i] * g0[i + seg];
      y0[i] = a + b;
    }
    for (int64_t i = seg; i < 2 * seg; i++) {
      float a = c0[i] * g0[i], b = m0[i] * g0[i - seg];
      y0[i] = a + b;
    }
  }
}

static void rotary_task(void* user, size_t task) {
  RotaryJob* j = (RotaryJob*)user;
  const RotaryKernel* k = j->k;
  int64_t d = j->x.dims[3], L = j->length, s = k->start, h = L / 2;
  int64_t S = j->x.dims[1], N = j->x.dims[2];
  size_t xs = elem_size(j->x.type), cs = elem_size(j->cos.type);
  float buf[6 * 1024];
  float *g = buf, *c = buf + 1024, *n = buf + 2 * 1024, *m = buf + 3 * 1024, *y = buf + 4 * 1024, *t = buf + 5 * 1024;
  int64_t first = (int64_t)task * j->rows_per_task, last = first + j->rows_per_task, table_row = -1;
  if (last > j->rows) last = j->rows;
  for (int64_t row = first; row < last; row++) {
    int64_t b = row / (S * N), sidx = (row / N) % S, hd = row % N;
    int64_t crow = ((j->cb == 1 ? 0 : b) * j->cs + (j->cs == 1 ? 0 : sidx)) * j->cn + (j->cn == 1 ? 0 : hd);
    if (crow != table_row) { /* c and m = (grad ? sign * sin[partner] : -sign * sin), once per table row */
      load_f32((const char*)j->cos.data + (size_t)crow * L * cs, j->cos.type, c, (size_t)L);
      load_f32((const char*)j->sin.data + (size_t)crow * L * cs, j->cos.type, n, (size_t)L);
      for (int64_t i = 0; i < L; i++) m[i] = k->grad ? j->sign[i] * n[j->partner[i]] : -j->sign[i] * n[i];
      table_row = crow;
    }
    const char* src = (const char*)j->x.data + (size_t)row * d * xs;
    char* dst = (char*)j->out.data + (size_t)row * d * xs;
    if (dst != src) {
      memcpy(dst, src, (size_t)s * xs);
      memcpy(dst + (size_t)k->end * xs, src + (size_t)k->end * xs, (size_t)(d - k->end) * xs);
    }
    if (j->x.type == T_FLOAT && k->mode != 3 && dst != src) { /* float32: straight from x into the output */
      rotary_row(k->mode, L, c, m, (const float*)(src + (size_t)s * xs), (float*)(dst + (size_t)s * xs));
      continue;
    }
    load_f32(src + (size_t)s * xs, j->x.type, g, (size_t)L);
    if (k->mode == 3 && !k->grad) { /* forward mode 3 reads the interleaved layout */
      for (int64_t i = 0; i < h; i++) {
        t[i] = g[2 * i];
        t[h + i] = g[2 * i + 1];
      }
      rotary_row(0, L, c, m, t, y);
    } else if (k->mode == 3) { /* grad mode 3 writes the interleaved layout */
      rotary_row(0, L, c, m, g, t);
      for (int64_t i = 0; i < h; i++) {
        y[2 * i] = t[i];
        y[2 * i + 1] = t[h + i];
      }
    } else {
      rotary_row(k->mode, L, c, m, g, y);
    }
    store_f32(y, j->x.type, dst + (size_t)s * xs, (size_t)L);
  }
}

static OrtStatus* rotary_compute(void* kernel, OrtKernelContext* ctx) {
  const RotaryKernel* k = (const RotaryKernel*)kernel;
  const char* op = k->grad ? "InplacePartialRotaryMulGrad" : "InplacePartialRotaryMul";
  RotaryJob j;
  memset(&j, 0, sizeof j);
  j.k = k;
  int present;
  OrtStatus* st = input(ctx, 0, &j.x, &present);
  if (!st) st = input(ctx, 1, &j.cos, &present);
  if (!st) st = input(ctx, 2, &j.sin, &present);
  if (st) return st;
  g_calls++;
  if (j.x.rank != 4 || j.cos.rank != 4 || j.sin.rank != 4)
    return error(op, "inputs must have rank 4, got %ld, %ld and %ld", (long)j.x.rank, (long)j.cos.rank, (long)j.sin.rank);
  int64_t d = j.x.dims[3], start = k->has_slice ? k->start : 0, end = k->has_slice ? k->end : d;
  if (start < 0 || start > end || end > d)
    return error(op, "partial_slice [%ld, %ld) is outside the last axis of size %ld", (long)start, (long)end, (long)d);
  RotaryKernel effective = *k;
  effective.start = start;
  effective.end = end;
  j.k = &effective;
  j.length = end - start;
  st = output(ctx, 0, j.x.dims, 4, &j.out);
  if (st) return st;
  if (j.length == 0) {
    if (j.out.data != j.x.data) memcpy(j.out.data, j.x.data, (size_t)j.x.size * elem_size(j.x.type));
    return NULL;
  }
  for (int axis = 0; axis < 4; axis++)
    if (j.cos.dims[axis] != j.sin.dims[axis])
      return error(op, "cos and sin differ in dim %ld: %ld vs %ld", axis, (long)j.cos.dims[axis], (long)j.sin.dims[axis]);
  if (j.cos.dims[3] != j.length)
    return error(op, "cos dim 3 is %ld, expected the slice length %ld", (long)j.cos.dims[3], (long)j.length, 0);
  for (int axis = 0; axis < 3; axis++)
    if (j.cos.dims[axis] != 1 && j.cos.dims[axis] != j.x.dims[axis])
      return error(op, "cos dim %ld is %ld, expected 1 or %ld", axis, (long)j.cos.dims[axis], (long)j.x.dims[axis]);
  int64_t unit = k->mode == 2 ? 4 : 2;
  if (k->mode < 0 || k->mode > 3) return error(op, "rotary_mode %ld is not one of 0, 1, 2, 3", (long)k->mode, 0, 0);
  if (j.length % unit) return error(op, "slice length %ld is not divisible by %ld", (long)j.length, (long)unit, 0);
  if (j.length > 1024) return error(op, "slice length %ld exceeds the native kernel's 1024", (long)j.length, 0, 0);
  if (j.x.type != j.out.type) return error(op, "output type %ld differs from input type %ld", j.out.type, j.x.type, 0);
  int64_t L = j.length, h = L / 2, q = L / 4;
  int partner[1024];
  float sign[1024];
  for (int64_t i = 0; i < L; i++) {
    int64_t p, first;
    if (k->mode == 1) {
      p = i ^ 1;
      first = (i % 2) == 0;
    } else if (k->mode == 2) {
      int64_t r = i % h;
      p = i - r + (r + q) % h;
      first = r < q;
    } else {
      p = (i + h) % L;
      first = i < h;
    }
    partner[i] = (int)p;
    sign[i] = first ? 1.0f : -1.0f;
  }
  j.partner = partner;
  j.sign = sign;
  j.cb = j.cos.dims[0];
  j.cs = j.cos.dims[1];
  j.cn = j.cos.dims[2];
  j.rows = j.x.dims[0] * j.x.dims[1] * j.x.dims[2];
  int64_t per_row = d > 0 ? d : 1;
  j.rows_per_task = (1 << 16) / per_row + 1;
  size_t tasks = (size_t)((j.rows + j.rows_per_task - 1) / j.rows_per_task);
  if (tasks <= 1) {
    if (tasks) rotary_task(&j, 0);
    return NULL;
  }
  return FN(KernelContextParallelForFn, SLOT_KernelContext_ParallelFor)(ctx, rotary_task, tasks, 0, &j);
}

/* ---------------------------------------------------------------------------------------- */
/* MoE token unpermute (spec 3.3); sorted_indices[t*K + k] is the row of slot (t, k)          */

static OrtStatus* check_permutation(const char* op, const int32_t* s, int64_t m) {
  unsigned char* seen = (unsigned char*)scratch((size_t)(m > 0 ? m : 1), 1);
  if (!seen) return out_of_memory(op);
  OrtStatus* st = NULL;
  for (int64_t i = 0; i < m && !st; i++) {
    if (s[i] < 0 || s[i] >= m)
      st = error(op, "sorted_indices position %ld: expected a value in [0, %ld), got %ld", (long)i, (long)m, (long)s[i]);
    else if (seen[s[i]]++)
      st = error(op, "sorted_indices position %ld: value %ld repeats (expected a permutation of 0..%ld)", (long)i,
                 (long)s[i], (long)(m - 1));
  }
  free(seen);
  return st;
}

typedef struct {
  Tensor tokens, grad, indices, probs, out, probs_grad;
  int has_probs, has_tokens;
  int64_t tokens_n, topk, hidden, rows, per_task;
  int32_t* slot_of_row; /* the grad's inverse of sorted_indices */
  int failed;           /* a task could not allocate its row buffer: the kernel returns an error */
} MoeJob;

static void moe_forward_task(void* user, size_t task) {
  MoeJob* j = (MoeJob*)user;
  int64_t H = j->hidden, K = j->topk;
  const int32_t* s = (const int32_t*)j->indices.data;
  size_t ts = elem_size(j->tokens.type), ps = j->has_probs ? elem_size(j->probs.type) : 0;
  float* acc = (float*)scratch((size_t)(2 * H + 1) * sizeof(float), 0);
  if (!acc) {
    __atomic_store_n(&j->failed, 1, __ATOMIC_SEQ_CST);
    return;
  }
  float* row = acc + H;
  int64_t first = (int64_t)task * j->per_task, last = first + j->per_task;
  if (last > j->tokens_n) last = j->tokens_n;
  for (int64_t t = first; t < last; t++) {
    for (int64_t k = 0; k < K; k++) {
      int64_t r = s[t * K + k];
      float w = 1.0f;
      int keep = r < j->rows;
      if (j->has_probs) {
        load_f32((const char*)j->probs.data + (size_t)(t * K + k) * ps, j->probs.type, &w, 1);
        keep = keep && w != 0.0f;
      }
      if (keep) {
        load_f32((const char*)j->tokens.data + (size_t)r * H * ts, j->tokens.type, row, (size_t)H);
        if (j->has_probs)
          for (int64_t i = 0; i < H; i++) row[i] *= w;
      } else {
        for (int64_t i = 0; i < H; i++) row[i] = j->has_probs ? 0.0f * w : 0.0f;
      }
      if (k == 0)
        memcpy(acc, row, (size_t)H * sizeof(float));
      else
        for (int64_t i = 0; i < H; i++) acc[i] += row[i];
    }
    for (int64_t i = 0; i < H; i++) acc[i] += 0.0f; /* as the NumPy kernel: a lone -0 becomes +0 */
    store_f32(acc, j->tokens.type, (char*)j->out.data + (size_t)t * H * ts, (size_t)H);
  }
  free(acc);
}

/* The grad walks the OUTPUT rows in order (slot_of_row inverts sorted_indices): permuted_tokens is
 * read and permuted_tokens_grad written sequentially, and with expert-sorted rows the dY reads
 * sweep each expert's tokens in order. */
static void moe_grad_task(void* user, size_t task) {
  MoeJob* j = (MoeJob*)user;
  int64_t H = j->hidden, K = j->topk, M = j->tokens_n * K;
  const int32_t* slot_of_row = j->slot_of_row;
  size_t gs = elem_size(j->grad.type);
  float* buf = (float*)scratch((size_t)(2 * H + 1) * sizeof(float), 0);
  if (!buf) {
    __atomic_store_n(&j->failed, 1, __ATOMIC_SEQ_CST);
    return;
  }
  float *dy = buf, *row = buf + H;
  int64_t first = (int64_t)task * j->per_task, last = first + j->per_task;
  if (last > M) last = M;
  for (int64_t r = first; r < last; r++) {
    int64_t slot = slot_of_row[r], t = slot / K;
    const char* grad_row = (const char*)j->grad.data + (size_t)t * H * gs;
    char* out_row = (char*)j->out.data + (size_t)r * H * gs;
    if (!j->has_probs) {
      memcpy(out_row, grad_row, (size_t)H * gs);
      continue;
    }
    float w;
    load_f32((const char*)j->probs.data + (size_t)slot * elem_size(j->probs.type), j->probs.type, &w, 1);
    const float* d;
    const float* p;
    if (j->grad.type == T_FLOAT) { /* float32: read and write the tensors directly, one pass each */
      d = (const float*)grad_row;
      p = (const float*)((const char*)j->tokens.data + (size_t)r * H * gs);
      float* o = (float*)out_row;
      for (int64_t i = 0; i < H; i++) o[i] = d[i] * w;
    } else {
      load_f32(grad_row, j->grad.type, dy, (size_t)H);
      for (int64_t i = 0; i < H; i++) row[i] = dy[i] * w;
      store_f32(row, j->grad.type, out_row, (size_t)H);
      load_f32((const char*)j->tokens.data + (size_t)r * H * gs, j->tokens.type, row, (size_t)H);
      d = dy;
      p = row;
    }
    float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* float32 dot over H; the order is the contract's to choose */
    int64_t i = 0;
    for (; i + 8 <= H; i += 8)
      for (int l = 0; l < 8; l++) lanes[l] += p[i + l] * d[i + l];
    for (; i < H; i++) lanes[0] += p[i] * d[i];
    float dot = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    store_f32(&dot, j->probs.type, (char*)j->probs_grad.data + (size_t)slot * elem_size(j->probs.type), 1);
  }
  free(buf);
}

static OrtStatus* moe_run(OrtKernelContext* ctx, const char* op, MoeJob* j, void (*task)(void*, size_t),
                          int64_t items, int64_t per_item) {
  j->per_task = (1 << 15) / (per_item + 1) + 1;
  size_t tasks = (size_t)((items + j->per_task - 1) / j->per_task);
  OrtStatus* st = NULL;
  if (tasks == 1)
    task(j, 0);
  else if (tasks > 1)
    st = FN(KernelContextParallelForFn, SLOT_KernelContext_ParallelFor)(ctx, task, tasks, 0, j);
  if (!st && __atomic_load_n(&j->failed, __ATOMIC_SEQ_CST)) st = out_of_memory(op);
  return st;
}

static OrtStatus* moe_forward_compute(void* kernel, OrtKernelContext* ctx) {
  const char* op = "MoeTokenUnpermute";
  MoeJob j;
  memset(&j, 0, sizeof j);
  int present;
  OrtStatus* st = input(ctx, 0, &j.tokens, &present);
  if (!st) st = input(ctx, 1, &j.indices, &present);
  if (!st) st = input(ctx, 2, &j.probs, &j.has_probs);
  if (st) return st;
  g_calls++;
  if (j.tokens.rank != 2 || j.indices.rank != 1 || (j.has_probs && j.probs.rank != 2))
    return error(op, "expected ranks 2, 1 and 2, got %ld, %ld and %ld", (long)j.tokens.rank, (long)j.indices.rank,
                 (long)(j.has_probs ? j.probs.rank : 2));
  int64_t m = j.indices.dims[0];
  j.topk = j.has_probs ? j.probs.dims[1] : 1;
  j.tokens_n = j.has_probs ? j.probs.dims[0] : m;
  if (j.tokens_n * j.topk != m)
    return error(op, "len(sorted_indices) = %ld, expected tokens * topK = %ld * %ld", (long)m, (long)j.tokens_n,
                 (long)j.topk);
  st = check_permutation(op, (const int32_t*)j.indices.data, m);
  if (st) return st;
  j.rows = j.tokens.dims[0];
  j.hidden = j.tokens.dims[1];
  int64_t dims[2] = {j.tokens_n, j.hidden};
  st = output(ctx, 0, dims, 2, &j.out);
  return st ? st : moe_run(ctx, op, &j, moe_forward_task, j.tokens_n, j.hidden * j.topk);
}

static OrtStatus* moe_grad_compute(void* kernel, OrtKernelContext* ctx) {
  const char* op = "MoeTokenUnpermuteGrad";
  MoeJob j;
  memset(&j, 0, sizeof j);
  int present;
  OrtStatus* st = input(ctx, 0, &j.tokens, &j.has_tokens);
  if (!st) st = input(ctx, 1, &j.grad, &present);
  if (!st) st = input(ctx, 2, &j.indices, &present);
  if (!st) st = input(ctx, 3, &j.probs, &j.has_probs);
  if (st) return st;
  g_calls++;
  if (j.grad.rank != 2 || j.indices.rank != 1) return error(op, "expected ranks 2 and 1, got %ld and %ld",
                                                           (long)j.grad.rank, (long)j.indices.rank, 0);
  if (j.has_probs && !j.has_tokens) return error(op, "probs needs permuted_tokens", 0, 0, 0);
  int64_t m = j.indices.dims[0];
  j.tokens_n = j.grad.dims[0];
  j.hidden = j.grad.dims[1];
  j.topk = j.has_probs ? j.probs.dims[1] : 1;
  if (j.has_probs && (j.probs.rank != 2 || j.probs.dims[0] != j.tokens_n))
    return error(op, "probs must be (tokens, topK) with tokens = %ld", (long)j.tokens_n, 0, 0);
  if (j.tokens_n * j.topk != m)
    return error(op, "len(sorted_indices) = %ld, expected tokens * topK = %ld * %ld", (long)m, (long)j.tokens_n,
                 (long)j.topk);
  if (j.has_tokens && (j.tokens.rank != 2 || j.tokens.dims[0] != m || j.tokens.dims[1] != j.hidden))
    return error(op, "permuted_tokens must be (%ld, %ld)", (long)m, (long)j.hidden, 0);
  st = check_permutation(op, (const int32_t*)j.indices.data, m);
  if (st) return st;
  int64_t dims[2] = {m, j.hidden}, pdims[2] = {j.tokens_n, j.topk};
  st = output(ctx, 0, dims, 2, &j.out);
  if (!st) st = output(ctx, 1, pdims, 2, &j.probs_grad);
  if (st) return st;
  if (!j.has_probs) memset(j.probs_grad.data, 0, (size_t)j.probs_grad.size * elem_size(j.probs_grad.type));
  j.slot_of_row = (int32_t*)scratch((size_t)(m > 0 ? m : 1) * sizeof(int32_t), 0);
  if (!j.slot_of_row) return out_of_memory(op);
  const int32_t* s = (const int32_t*)j.indices.data;
  for (int64_t i = 0; i < m; i++) j.slot_of_row[s[i]] = (int32_t)i;
  st = moe_run(ctx, op, &j, moe_grad_task, m, j.hidden);
  free(j.slot_of_row);
  return st;
}

/* ---------------------------------------------------------------------------------------- */
/* registration: one OrtCustomOp per (op, dtype combination), laid out at version 17          */

typedef struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const struct OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
  const char* (*GetName)(const struct OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const struct OrtCustomOp*);
  int (*GetInputType)(const struct OrtCustomOp*, size_t);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp*);
  int (*GetOutputType)(const struct OrtCustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const struct OrtCustomOp*, size_t);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp*, size_t);
  int (*GetInputMemoryType)(const struct OrtCustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const struct OrtCustomOp*);
  int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp*);
  int (*GetVariadicOutputMinArity)(const struct OrtCustomOp*);
  int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp*);
  OrtStatus* (*CreateKernelV2)(const struct OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
  OrtStatus* (*InferOutputShapeFn)(const struct OrtCustomOp*, void*);
  int (*GetStartVersion)(const struct OrtCustomOp*);
  int (*GetEndVersion)(const struct OrtCustomOp*);
} OrtCustomOp;

enum { K_ROPE, K_ROPE_GRAD, K_MOE, K_MOE_GRAD };

typedef struct {
  OrtCustomOp op; /* first member: ONNX Runtime passes &op back to us */
  int kind, n_in, n_out, in_types[4], out_types[2], optional_in;
} GeirOp;

static const char* op_name(const OrtCustomOp* op) {
  static const char* names[] = {"InplacePartialRotaryMul", "InplacePartialRotaryMulGrad", "MoeTokenUnpermute",
                                "MoeTokenUnpermuteGrad"};
  return names[((const GeirOp*)op)->kind];
}
static const char* provider(const OrtCustomOp* op) { return "CPUExecutionProvider"; }
static int in_type(const OrtCustomOp* op, size_t i) { return ((const GeirOp*)op)->in_types[i]; }
static size_t in_count(const OrtCustomOp* op) { return (size_t)((const GeirOp*)op)->n_in; }
static int out_type(const OrtCustomOp* op, size_t i) { return ((const GeirOp*)op)->out_types[i]; }
static size_t out_count(const OrtCustomOp* op) { return (size_t)((const GeirOp*)op)->n_out; }
static int in_characteristic(const OrtCustomOp* op, size_t i) {
  return (((const GeirOp*)op)->optional_in >> i) & 1 ? IO_OPTIONAL : IO_REQUIRED;
}
static int out_characteristic(const OrtCustomOp* op, size_t i) { return IO_REQUIRED; }
static int memory_type(const OrtCustomOp* op, size_t i) { return 0; }
static int one(const OrtCustomOp* op) { return 1; }
static int last_version(const OrtCustomOp* op) { return 2147483647; }

typedef struct {
  int kind;
  RotaryKernel rotary;
} Kernel;

static OrtStatus* create_kernel_v2(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  Kernel* k = (Kernel*)calloc(1, sizeof(Kernel));
  if (!k) return FN(CreateStatusFn, SLOT_CreateStatus)(ORT_FAIL, "out of memory");
  k->kind = ((const GeirOp*)op)->kind;
  if (k->kind == K_ROPE || k->kind == K_ROPE_GRAD) {
    int64_t slice[2] = {0, 0};
    size_t n = 2;
    OrtStatus* st = FN(KernelInfoGetAttributeInt64Fn, SLOT_KernelInfoGetAttribute_int64)(info, "rotary_mode",
                                                                                        &k->rotary.mode);
    if (st) { FN(ReleaseStatusFn, SLOT_ReleaseStatus)(st); k->rotary.mode = 0; }
    st = FN(KernelInfoGetAttributeArrayInt64Fn, SLOT_KernelInfoGetAttributeArray_int64)(info, "partial_slice", slice, &n);
    if (st) { FN(ReleaseStatusFn, SLOT_ReleaseStatus)(st); n = 2; slice[0] = slice[1] = 0; }
    if (n != 0 && n != 2) { free(k); return error(op_name(op), "partial_slice has %ld elements", (long)n, 0, 0); }
    k->rotary.has_slice = n == 2;
    k->rotary.start = slice[0];
    k->rotary.end = slice[1];
    k->rotary.grad = k->kind == K_ROPE_GRAD;
  }
  *out = k;
  return NULL;
}

static void* create_kernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info) {
  void* k = NULL;
  OrtStatus* st = create_kernel_v2(op, api, info, &k);
  if (st) FN(ReleaseStatusFn, SLOT_ReleaseStatus)(st);
  return k;
}

static OrtStatus* compute_v2(void* kernel, OrtKernelContext* ctx) {
  Kernel* k = (Kernel*)kernel;
  if (k->kind == K_ROPE || k->kind == K_ROPE_GRAD) return rotary_compute(&k->rotary, ctx);
  return k->kind == K_MOE ? moe_forward_compute(k, ctx) : moe_grad_compute(k, ctx);
}

static void compute(void* kernel, OrtKernelContext* ctx) {
  OrtStatus* st = compute_v2(kernel, ctx);
  if (st) FN(ReleaseStatusFn, SLOT_ReleaseStatus)(st);
}

static void destroy(void* kernel) { free(kernel); }

#define MAX_OPS 40
static GeirOp g_ops[MAX_OPS];
static int g_op_count;

static void add_op(int kind, int n_in, const int* in, int n_out, const int* out, int optional_in) {
  GeirOp* g = &g_ops[g_op_count++];
  memset(g, 0, sizeof *g);
  g->kind = kind;
  g->n_in = n_in;
  g->n_out = n_out;
  memcpy(g->in_types, in, (size_t)n_in * sizeof(int));
  memcpy(g->out_types, out, (size_t)n_out * sizeof(int));
  g->optional_in = optional_in;
  OrtCustomOp* op = &g->op;
  op->version = GEIR_API_VERSION;
  op->CreateKernel = create_kernel;
  op->GetName = op_name;
  op->GetExecutionProviderType = provider;
  op->GetInputType = in_type;
  op->GetInputTypeCount = in_count;
  op->GetOutputType = out_type;
  op->GetOutputTypeCount = out_count;
  op->KernelCompute = compute;
  op->KernelDestroy = destroy;
  op->GetInputCharacteristic = in_characteristic;
  op->GetOutputCharacteristic = out_characteristic;
  op->GetInputMemoryType = memory_type;
  op->GetVariadicInputMinArity = one;
  op->GetVariadicInputHomogeneity = one;
  op->GetVariadicOutputMinArity = one;
  op->GetVariadicOutputHomogeneity = one;
  op->CreateKernelV2 = create_kernel_v2;
  op->KernelComputeV2 = compute_v2;
  op->InferOutputShapeFn = NULL;
  op->GetStartVersion = one;
  op->GetEndVersion = last_version;
}

static void declare_ops(void) {
  static const int floats[3] = {T_FLOAT, T_FLOAT16, T_BFLOAT16};
  if (g_op_count) return;
  for (int a = 0; a < 3; a++) {
    int x = floats[a];
    for (int b = 0; b < 3; b++) {
      int c = floats[b];
      int grad_in[3] = {x, c, c}, out1[1] = {x};
      add_op(K_ROPE_GRAD, 3, grad_in, 1, out1, 0);
      if (c == x || c == T_FLOAT) add_op(K_ROPE, 3, grad_in, 1, out1, 0);
    }
    /* within one token dtype, probs dtype == token dtype first: the variant matched when probs is absent */
    for (int b = -1; b < 3; b++) {
      int p = b < 0 ? x : floats[b];
      if (b >= 0 && p == x) continue;
      int fwd_in[3] = {x, T_INT32, p}, fwd_out[1] = {x};
      add_op(K_MOE, 3, fwd_in, 1, fwd_out, 1 << 2);
      int grad_in[4] = {x, x, T_INT32, p}, grad_out[2] = {x, p};
      add_op(K_MOE_GRAD, 4, grad_in, 2, grad_out, (1 << 0) | (1 << 3));
    }
  }
}

/* The entry ONNX Runtime calls from SessionOptions.register_custom_ops_library. */
OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(GEIR_API_VERSION);
  if (!api) return NULL; /* older runtime: nothing registered, the function bodies run instead */
  g_api = api;
  declare_ops();
  OrtCustomOpDomain* domain = NULL;
  OrtStatus* st = FN(CreateCustomOpDomainFn, SLOT_CreateCustomOpDomain)("ai.cann", &domain);
  for (int i = 0; !st && i < g_op_count; i++) st = FN(CustomOpDomainAddFn, SLOT_CustomOpDomain_Add)(domain, &g_ops[i].op);
  if (!st) st = FN(AddCustomOpDomainFn, SLOT_AddCustomOpDomain)(options, domain);
  return st;
}

/* ABI probe for the tests: entries whose effect can be observed without a session. */
int geir_probe_abi(char* out, size_t size) {
  const OrtApi* api = g_api;
  if (!api) return -1;
  OrtStatus* st = FN(CreateStatusFn, SLOT_CreateStatus)(ORT_INVALID_ARGUMENT, "geir probe");
  const char* message = FN(GetErrorMessageFn, SLOT_GetErrorMessage)(st);
  int same = strcmp(message, "geir probe") == 0;
  FN(ReleaseStatusFn, SLOT_ReleaseStatus)(st);
  snprintf(out, size, "%s", FN(GetBuildInfoStringFn, SLOT_GetBuildInfoString)());
  return same;
}
