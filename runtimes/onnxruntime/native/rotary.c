/* Rotary position embedding and its gradient (spec 2.4): y = c * g + m * g[partner], as geir's NumPy kernel.
 *
 * Numerics match the NumPy runtime: float32 compute, products and sums in the same order, no FMA
 * contraction (built with -ffp-contract=off), one round-to-nearest-even per output. */
#include "family.h"
#include "half.h"

/* Attributes, read once when ONNX Runtime creates the kernel (rotary_create). */
typedef struct {
  int64_t mode, start, end, has_slice;
  int grad;
} RotaryKernel;

typedef struct {
  const RotaryKernel* k;
  Tensor x, cos, sin, out;
  int64_t length, rows_per_task, rows, cb, cs, cn;
  int64_t* partner;
  float* sign;
  int failed; /* a task could not allocate its row buffers: the kernel returns an error */
} RotaryJob;

/* The pair tables of geir.schemas.rotary.rotation: partner[i] is the position i rotates with, sign[i] +1 on the
 * first element of its pair, -1 on the second. */
static void rotary_tables(int64_t mode, int64_t L, int64_t* partner, float* sign) {
  int64_t h = L / 2, q = L / 4;
  for (int64_t i = 0; i < L; i++) {
    int64_t p, first;
    if (mode == 1) {
      p = i ^ 1;
      first = (i % 2) == 0;
    } else if (mode == 2) {
      int64_t r = i % h;
      p = i - r + (r + q) % h;
      first = r < q;
    } else {
      p = (i + h) % L;
      first = i < h;
    }
    partner[i] = p;
    sign[i] = first ? 1.0f : -1.0f;
  }
}

/* The same tables with int partners, exported (not hidden) for the test that compares them with geir.schemas.rotary.rotation.
 * Returns 0, or -1 when its buffer cannot be allocated. */
int geir_rotary_tables(int64_t mode, int64_t L, int* partner, float* sign) {
  int64_t* wide = (int64_t*)geir_scratch((size_t)(L > 0 ? L : 1) * sizeof(int64_t), 0);
  if (!wide) return -1;
  rotary_tables(mode, L, wide, sign);
  for (int64_t i = 0; i < L; i++) partner[i] = (int)wide[i];
  free(wide);
  return 0;
}

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

#if defined(__AVX2__)
static inline __m256 widen_8(const uint16_t* p, int type) {
  __m128i h = _mm_loadu_si128((const __m128i*)p);
  if (type == T_BFLOAT16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

/* 8 float32 lanes rounded to nearest even, in memory order. */
static inline void narrow_8(uint16_t* p, __m256 v, int type) {
  __m128i h;
  if (type == T_BFLOAT16) {
    __m256i r = bf16_round_8(v);
    h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  } else {
    h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
  }
  _mm_storeu_si128((__m128i*)p, h);
}

/* Whether half_rotary_row handles this slice: modes 0-2 whose pair offset is whole vectors (mode 1 pairs
 * neighbours inside a vector). */
static int half_rotary_fits(int64_t mode, int64_t L) {
  return L % 8 == 0 && (mode == 1 || (mode == 0 && (L / 2) % 8 == 0) || (mode == 2 && (L / 4) % 8 == 0));
}

/* rotary_row on a float16 / bfloat16 slice, converted in registers: y = c * g + m * g[partner], each product
 * and the sum rounded as rotary_row rounds them. g and y must not overlap. */
static void half_rotary_row(int64_t mode, int64_t L, const float* c, const float* m, const uint16_t* g, uint16_t* y,
                            int type) {
  int64_t seg = mode == 2 ? L / 4 : L / 2;
  for (int64_t i = 0; i < L; i += 8) {
    __m256 x = widen_8(g + i, type), partner;
    if (mode == 1)
      partner = _mm256_permute_ps(x, 0xb1); /* swap neighbours: (0 1) (2 3) ... */
    else
      partner = widen_8(g + ((i / seg) % 2 ? i - seg : i + seg), type);
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(c + i), x), b = _mm256_mul_ps(_mm256_loadu_ps(m + i), partner);
    narrow_8(y + i, _mm256_add_ps(a, b), type);
  }
}
#endif

static void rotary_task(void* user, size_t task) {
  RotaryJob* j = (RotaryJob*)user;
  const RotaryKernel* k = j->k;
  int64_t d = j->x.dims[3], L = j->length, s = k->start, h = L / 2;
  int64_t S = j->x.dims[1], N = j->x.dims[2];
  size_t xs = elem_size(j->x.type), cs = elem_size(j->cos.type);
  float* buf = (float*)geir_scratch((size_t)(6 * L) * sizeof(float), 0); /* any slice length: on the heap */
  if (!buf) {
    __atomic_store_n(&j->failed, 1, __ATOMIC_SEQ_CST);
    return;
  }
  float *g = buf, *c = buf + L, *n = buf + 2 * L, *m = buf + 3 * L, *y = buf + 4 * L, *t = buf + 5 * L;
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
#if defined(__AVX2__)
    if (j->x.type != T_FLOAT && dst != src && half_rotary_fits(k->mode, L)) {
      half_rotary_row(k->mode, L, c, m, (const uint16_t*)(src + (size_t)s * xs), (uint16_t*)(dst + (size_t)s * xs),
                      j->x.type);
      continue;
    }
#endif
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
  free(buf);
}

static OrtStatus* rotary_compute(void* kernel, OrtKernelContext* ctx) {
  const RotaryKernel* k = (const RotaryKernel*)kernel;
  const char* op = k->grad ? "InplacePartialRotaryMulGrad" : "InplacePartialRotaryMul";
  RotaryJob j;
  memset(&j, 0, sizeof j);
  j.k = k;
  int present;
  OrtStatus* st = ort_input(ctx, 0, &j.x, &present);
  if (!st) st = ort_input(ctx, 1, &j.cos, &present);
  if (!st) st = ort_input(ctx, 2, &j.sin, &present);
  if (st) return st;
  g_calls++;
  if (j.x.rank != 4 || j.cos.rank != 4 || j.sin.rank != 4)
    return ort_error(op, "inputs must have rank 4, got %ld, %ld and %ld", (long)j.x.rank, (long)j.cos.rank, (long)j.sin.rank);
  int64_t d = j.x.dims[3], start = k->has_slice ? k->start : 0, end = k->has_slice ? k->end : d;
  if (start < 0 || start > end || end > d)
    return ort_error(op, "partial_slice [%ld, %ld) is outside the last axis of size %ld", (long)start, (long)end, (long)d);
  RotaryKernel effective = *k;
  effective.start = start;
  effective.end = end;
  j.k = &effective;
  j.length = end - start;
  st = ort_output(ctx, 0, j.x.dims, 4, &j.out);
  if (st) return st;
  /* the identity: an empty slice, or an empty x/cos/sin (the grad's arch35 empty-tensor key; the forward's rules
   * allow empty tensors only with an empty slice). Nothing of cos/sin is read. */
  if (j.length == 0 || j.x.size == 0 || j.cos.size == 0 || j.sin.size == 0) {
    if (j.out.data != j.x.data) memcpy(j.out.data, j.x.data, (size_t)j.x.size * elem_size(j.x.type));
    return NULL;
  }
  for (int axis = 0; axis < 4; axis++)
    if (j.cos.dims[axis] != j.sin.dims[axis])
      return ort_error(op, "cos and sin differ in dim %ld: %ld vs %ld", axis, (long)j.cos.dims[axis], (long)j.sin.dims[axis]);
  if (j.cos.dims[3] != j.length)
    return ort_error(op, "cos dim 3 is %ld, expected the slice length %ld", (long)j.cos.dims[3], (long)j.length, 0);
  for (int axis = 0; axis < 3; axis++)
    if (j.cos.dims[axis] != 1 && j.cos.dims[axis] != j.x.dims[axis])
      return ort_error(op, "cos dim %ld is %ld, expected 1 or %ld", axis, (long)j.cos.dims[axis], (long)j.x.dims[axis]);
  int64_t unit = k->mode == 2 ? 4 : 2;
  if (k->mode < 0 || k->mode > 3) return ort_error(op, "rotary_mode %ld is not one of 0, 1, 2, 3", (long)k->mode, 0, 0);
  if (j.length % unit) return ort_error(op, "slice length %ld is not divisible by %ld", (long)j.length, (long)unit, 0);
  if (j.x.type != j.out.type) return ort_error(op, "output type %ld differs from input type %ld", j.out.type, j.x.type, 0);
  /* the pair tables, for a slice of any length (no limit the schema does not state) */
  j.partner = (int64_t*)geir_scratch((size_t)j.length * (sizeof(int64_t) + sizeof(float)), 0);
  if (!j.partner) return ort_out_of_memory(op);
  j.sign = (float*)(j.partner + j.length);
  rotary_tables(k->mode, j.length, j.partner, j.sign);
  j.cb = j.cos.dims[0];
  j.cs = j.cos.dims[1];
  j.cn = j.cos.dims[2];
  j.rows = j.x.dims[0] * j.x.dims[1] * j.x.dims[2];
  int64_t per_row = d > 0 ? d : 1;
  j.rows_per_task = (1 << 16) / per_row + 1;
  size_t tasks = (size_t)((j.rows + j.rows_per_task - 1) / j.rows_per_task);
  if (tasks == 1)
    rotary_task(&j, 0);
  else if (tasks > 1)
    st = FN(KernelContextParallelForFn, SLOT_KernelContext_ParallelFor)(ctx, rotary_task, tasks, 0, &j);
  free(j.partner);
  if (!st && __atomic_load_n(&j.failed, __ATOMIC_SEQ_CST)) st = ort_out_of_memory(op);
  return st;
}


enum { FORWARD, GRAD };

static OrtStatus* rotary_create(const GeirOpDesc* op, const OrtKernelInfo* info, void** state) {
  RotaryKernel* k = (RotaryKernel*)calloc(1, sizeof(RotaryKernel));
  if (!k) return FN(CreateStatusFn, SLOT_CreateStatus)(ORT_FAIL, "out of memory");
  int64_t slice[2] = {0, 0};
  size_t n = 2;
  OrtStatus* st = FN(KernelInfoGetAttributeInt64Fn, SLOT_KernelInfoGetAttribute_int64)(info, "rotary_mode", &k->mode);
  if (st) { FN(ReleaseStatusFn, SLOT_ReleaseStatus)(st); k->mode = 0; }
  st = FN(KernelInfoGetAttributeArrayInt64Fn, SLOT_KernelInfoGetAttributeArray_int64)(info, "partial_slice", slice, &n);
  if (st) { FN(ReleaseStatusFn, SLOT_ReleaseStatus)(st); n = 2; slice[0] = slice[1] = 0; }
  if (n != 0 && n != 2) { free(k); return ort_error(op->name, "partial_slice has %ld elements", (long)n, 0, 0); }
  k->has_slice = n == 2;
  k->start = slice[0];
  k->end = slice[1];
  k->grad = op->variant == GRAD;
  *state = k;
  return NULL;
}

/* (x, cos, sin) -> y. The forward takes cos/sin of x's dtype or float32; the grad any float dtype. */
static const unsigned char FORWARD_TYPES[][4] = {
    {F32, F32, F32, F32}, {F16, F32, F32, F16}, {F16, F16, F16, F16}, {BF16, F32, F32, BF16},
    {BF16, BF16, BF16, BF16}};
static const unsigned char GRAD_TYPES[][4] = {
    {F32, F32, F32, F32},    {F32, F16, F16, F32},    {F32, BF16, BF16, F32},
    {F16, F32, F32, F16},    {F16, F16, F16, F16},    {F16, BF16, BF16, F16},
    {BF16, F32, F32, BF16}, {BF16, F16, F16, BF16}, {BF16, BF16, BF16, BF16}};

static const GeirOpDesc OPS[] = {
    {.name = "InplacePartialRotaryMul", .n_in = 3, .n_out = 1, .attributes = "rotary_mode,partial_slice",
     GEIR_COMBOS(FORWARD_TYPES), .variant = FORWARD, .create = rotary_create, .compute = rotary_compute,
     .destroy = free},
    {.name = "InplacePartialRotaryMulGrad", .n_in = 3, .n_out = 1, .attributes = "rotary_mode,partial_slice",
     GEIR_COMBOS(GRAD_TYPES), .variant = GRAD, .create = rotary_create, .compute = rotary_compute,
     .destroy = free},
};
GEIR_FAMILY(rotary, OPS);
