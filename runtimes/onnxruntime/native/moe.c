/* MoE token unpermute and its gradient (spec 3.3); sorted_indices[t*K + k] is the row of slot (t, k). */
#include "family.h"
#include "half.h"

static OrtStatus* check_permutation(const char* op, const int32_t* s, int64_t m) {
  unsigned char* seen = (unsigned char*)geir_scratch((size_t)(m > 0 ? m : 1), 1);
  if (!seen) return ort_out_of_memory(op);
  OrtStatus* st = NULL;
  for (int64_t i = 0; i < m && !st; i++) {
    if (s[i] < 0 || s[i] >= m)
      st = ort_error(op, "sorted_indices position %ld: expected a value in [0, %ld), got %ld", (long)i, (long)m, (long)s[i]);
    else if (seen[s[i]]++)
      st = ort_error(op, "sorted_indices position %ld: value %ld repeats (expected a permutation of 0..%ld)", (long)i,
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

#if defined(__AVX2__)
/* 16 float16 / bfloat16 values as two float32 vectors. bfloat16 comes out in the unpack order (values 0-3 and
 * 8-11 in lo, 4-7 and 12-15 in hi), which pack_16 undoes; the dot below adds lanes in a fixed order either way. */
static inline void unpack_16(const uint16_t* src, int type, __m256* lo, __m256* hi) {
  __m256i x = _mm256_loadu_si256((const __m256i*)src);
  if (type == T_BFLOAT16) {
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x));
  } else {
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(x));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(x, 1));
  }
}

/* The inverse of unpack_16: two float32 vectors rounded to 16 values in memory order. */
static inline __m256i pack_16(__m256 lo, __m256 hi, int type) {
  if (type == T_BFLOAT16) return _mm256_packus_epi32(bf16_round_8(lo), bf16_round_8(hi));
  return _mm256_set_m128i(_mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT), _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
}

/* Stores 32 bytes; streamed past the cache (two 16-byte non-temporal stores) when the row allows it. */
static inline void store_32_bytes(void* p, __m256i v, int stream) {
  if (stream) {
    _mm_stream_si128((__m128i*)p, _mm256_castsi256_si128(v));
    _mm_stream_si128((__m128i*)p + 1, _mm256_extracti128_si256(v, 1));
  } else {
    _mm256_storeu_si256((__m256i*)p, v);
  }
}

/* One output row of the forward, 16 columns at a time in registers: the weighted rows' products added in k
 * order to an accumulator that never leaves its registers, then + 0 and one rounding (a NULL row is a dropped or
 * zero-weight slot: it adds +0, as the reference skips it, and its weight is not used).
 * Reading the K rows side by side keeps K sequential streams going. K = 0 gives +0. */
static void weighted_rows(const char* const* rows, const float* w, int64_t K, int type, char* out, int64_t H) {
  const __m256 zero = _mm256_setzero_ps();
  int half = type != T_FLOAT;
  size_t es = half ? 2 : 4;
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    __m256 lo = zero, hi = zero;
    for (int64_t k = 0; k < K; k++) {
      __m256 vw = _mm256_set1_ps(w[k]), a, b;
      if (!rows[k]) {
        a = b = zero;
      } else if (half) {
        unpack_16((const uint16_t*)rows[k] + i, type, &a, &b);
        a = _mm256_mul_ps(a, vw);
        b = _mm256_mul_ps(b, vw);
      } else {
        a = _mm256_mul_ps(_mm256_loadu_ps((const float*)rows[k] + i), vw);
        b = _mm256_mul_ps(_mm256_loadu_ps((const float*)rows[k] + i + 8), vw);
      }
      lo = k ? _mm256_add_ps(lo, a) : a;
      hi = k ? _mm256_add_ps(hi, b) : b;
    }
    lo = _mm256_add_ps(lo, zero);
    hi = _mm256_add_ps(hi, zero);
    if (half) {
      _mm256_storeu_si256((__m256i*)(out + (size_t)i * es), pack_16(lo, hi, type));
    } else {
      _mm256_storeu_ps((float*)out + i, lo);
      _mm256_storeu_ps((float*)out + i + 8, hi);
    }
  }
  for (; i < H; i++) {
    float acc = 0.0f;
    for (int64_t k = 0; k < K; k++) {
      float x = 0.0f;
      if (rows[k]) load_f32(rows[k] + (size_t)i * es, type, &x, 1);
      float product = rows[k] ? x * w[k] : 0.0f;
      acc = k ? acc + product : product;
    }
    acc += 0.0f;
    store_f32(&acc, type, out + (size_t)i * es, 1);
  }
}

#endif

/* The grad's dY rows (scattered) are fetched this many output rows ahead of their use. */
#define GRAD_PREFETCH_ROWS 4

/* The forward: out[t] = sum over k of probs[t, k] * permuted_tokens[s[t*K + k]], each product rounded, then added
 * in k order, as the NumPy kernel (w = 1 without probs multiplies exactly; a dropped or zero-weight slot adds +0,
 * which with the final + 0 is the reference's skip: neither its row nor its weight reaches the sum); then + 0 (a
 * lone -0 becomes +0) and one rounding. The next token's rows, scattered over permuted_tokens, are fetched ahead. */
static void moe_forward_task(void* user, size_t task) {
  MoeJob* j = (MoeJob*)user;
  int64_t H = j->hidden, K = j->topk;
  const int32_t* s = (const int32_t*)j->indices.data;
  size_t ts = elem_size(j->tokens.type), ps = j->has_probs ? elem_size(j->probs.type) : 0;
  /* per slot of a token: its row (NULL when dropped or weighted 0) and weight; then two float32 rows (the portable
   * path's accumulator and widened row) */
  size_t bytes = (size_t)K * (sizeof(char*) + sizeof(float)) + (size_t)(2 * H + 1) * sizeof(float);
  char* scratch = (char*)geir_scratch(bytes, 0);
  if (!scratch) {
    __atomic_store_n(&j->failed, 1, __ATOMIC_SEQ_CST);
    return;
  }
  const char** rows = (const char**)scratch;
  float* w = (float*)(rows + K);
  int64_t first = (int64_t)task * j->per_task, last = first + j->per_task;
  if (last > j->tokens_n) last = j->tokens_n;
  size_t row_bytes = (size_t)H * ts;
  for (int64_t t = first; t < last; t++) {
    for (int64_t k = 0; t + 1 < last && k < K; k++) {
      int64_t ahead = s[(t + 1) * K + k];
      if (ahead < j->rows)
        for (size_t b = 0; b < row_bytes; b += 64) __builtin_prefetch((const char*)j->tokens.data + (size_t)ahead * row_bytes + b, 0, 3);
    }
    for (int64_t k = 0; k < K; k++) {
      int64_t r = s[t * K + k];
      w[k] = 1.0f;
      if (j->has_probs) load_f32((const char*)j->probs.data + (size_t)(t * K + k) * ps, j->probs.type, &w[k], 1);
      rows[k] = r < j->rows && w[k] != 0.0f ? (const char*)j->tokens.data + (size_t)r * row_bytes : NULL;
    }
    char* out_row = (char*)j->out.data + (size_t)t * row_bytes;
#if defined(__AVX2__)
    weighted_rows(rows, w, K, j->tokens.type, out_row, H);
#else
    float *acc = w + K, *row = acc + H;
    for (int64_t i = 0; i < H; i++) acc[i] = 0.0f; /* K = 0: no slot, +0 */
    for (int64_t k = 0; k < K; k++) {
      if (!rows[k]) { /* a skipped slot adds +0 */
        for (int64_t i = 0; i < H; i++) acc[i] = k == 0 ? 0.0f : acc[i] + 0.0f;
        continue;
      }
      const float* src = (const float*)rows[k]; /* float32: weight the row where it lies, no copy */
      if (j->tokens.type != T_FLOAT) {
        load_f32(rows[k], j->tokens.type, row, (size_t)H);
        src = row;
      }
      for (int64_t i = 0; i < H; i++) acc[i] = k == 0 ? src[i] * w[k] : acc[i] + src[i] * w[k];
    }
    for (int64_t i = 0; i < H; i++) acc[i] += 0.0f;
    store_f32(acc, j->tokens.type, out_row, (size_t)H);
#endif
  }
  free(scratch);
}

#if defined(__AVX2__)
/* One float16 / bfloat16 grad row in one pass: out = round(dy * w), and the float32 dot of dy with the token
 * row p (four vector sums over blocks of 32, a fixed tree, then the tail in order). The lanes do not depend on
 * where the output lies, so an aligned and an unaligned caller buffer give the same dot; aligned rows are
 * streamed past the cache. */
static float half_grad_row(const uint16_t* dy, const uint16_t* p, uint16_t* out, int type, float w, int64_t n) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 vw = _mm256_set1_ps(w);
  int stream = ((uintptr_t)out & 15u) == 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 d0, d1, p0, p1;
    unpack_16(dy + i, type, &d0, &d1);
    __m256 o0 = _mm256_mul_ps(d0, vw), o1 = _mm256_mul_ps(d1, vw);
    store_32_bytes(out + i, pack_16(o0, o1, type), stream);
    unpack_16(p + i, type, &p0, &p1);
    int a = (int)((i >> 4) & 1) * 2;
    acc[a] = _mm256_add_ps(acc[a], _mm256_mul_ps(p0, d0));
    acc[a + 1] = _mm256_add_ps(acc[a + 1], _mm256_mul_ps(p1, d1));
  }
  __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  float dot = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
  for (; i < n; i++) {
    float d, t, o;
    load_f32(dy + i, type, &d, 1);
    load_f32(p + i, type, &t, 1);
    o = d * w;
    store_f32(&o, type, out + i, 1);
    dot += t * d;
  }
  return dot;
}

/* The float32 grad row in one pass: out = dy * w (streamed when the row allows it) and the dot of dy with p,
 * whose lane l sums the elements i with i mod 32 = l (four vector sums), then a fixed pairwise tree. */
static float f32_grad_row(const float* dy, const float* p, float* out, float w, int64_t n) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 vw = _mm256_set1_ps(w);
  int stream = ((uintptr_t)out & 15u) == 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int q = 0; q < 4; q++) {
      __m256 d = _mm256_loadu_ps(dy + i + 8 * q);
      store_32_bytes(out + i + 8 * q, _mm256_castps_si256(_mm256_mul_ps(d, vw)), stream);
      acc[q] = _mm256_add_ps(acc[q], _mm256_mul_ps(_mm256_loadu_ps(p + i + 8 * q), d));
    }
  float lanes[32];
  for (int q = 0; q < 4; q++) _mm256_storeu_ps(lanes + 8 * q, acc[q]);
  for (; i < n; i++) {
    out[i] = dy[i] * w;
    lanes[i & 31] += p[i] * dy[i];
  }
  for (int width = 16; width > 0; width /= 2)
    for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
  return lanes[0];
}
#else
/* The same row without vector instructions: the conversions through float32 rows in scratch (2 * n floats). */
static float portable_grad_row(const char* dy_row, const char* token_row, char* out, int type, float w, int64_t n,
                               float* scratch) {
  float *d = scratch, *p = scratch + n;
  load_f32(dy_row, type, d, (size_t)n);
  for (int64_t i = 0; i < n; i++) p[i] = d[i] * w;
  store_f32(p, type, out, (size_t)n);
  load_f32(token_row, type, p, (size_t)n);
  float lanes[32] = {0.0f};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int l = 0; l < 32; l++) lanes[l] += p[i + l] * d[i + l];
  for (; i < n; i++) lanes[i & 31] += p[i] * d[i];
  for (int width = 16; width > 0; width /= 2)
    for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
  return lanes[0];
}
#endif

/* The grad walks the OUTPUT rows in order (slot_of_row inverts sorted_indices): permuted_tokens is
 * read and permuted_tokens_grad written sequentially, and with expert-sorted rows the dY reads
 * sweep each expert's tokens in order. */
static void moe_grad_task(void* user, size_t task) {
  MoeJob* j = (MoeJob*)user;
  int64_t H = j->hidden, K = j->topk, M = j->tokens_n * K;
  const int32_t* slot_of_row = j->slot_of_row;
  size_t gs = elem_size(j->grad.type);
  float* buf = (float*)geir_scratch((size_t)(2 * H + 1) * sizeof(float), 0);
  if (!buf) {
    __atomic_store_n(&j->failed, 1, __ATOMIC_SEQ_CST);
    return;
  }
  int64_t first = (int64_t)task * j->per_task, last = first + j->per_task;
  if (last > M) last = M;
  size_t row_bytes = (size_t)H * gs;
  for (int64_t r = first; r < last; r++) {
    int64_t slot = slot_of_row[r], t = slot / K;
    const char* grad_row = (const char*)j->grad.data + (size_t)t * row_bytes;
    if (r + GRAD_PREFETCH_ROWS < last) { /* dY rows are read in slot order, scattered: fetch one ahead of its use */
      const char* ahead = (const char*)j->grad.data + (size_t)(slot_of_row[r + GRAD_PREFETCH_ROWS] / K) * row_bytes;
      for (size_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b, 0, 3);
    }
    char* out_row = (char*)j->out.data + (size_t)r * H * gs;
    if (!j->has_probs) {
      memcpy(out_row, grad_row, (size_t)H * gs);
      continue;
    }
    float w;
    load_f32((const char*)j->probs.data + (size_t)slot * elem_size(j->probs.type), j->probs.type, &w, 1);
    const char* token_row = (const char*)j->tokens.data + (size_t)r * row_bytes;
#if defined(__AVX2__)
    float dot = j->grad.type == T_FLOAT
                    ? f32_grad_row((const float*)grad_row, (const float*)token_row, (float*)out_row, w, H)
                    : half_grad_row((const uint16_t*)grad_row, (const uint16_t*)token_row, (uint16_t*)out_row,
                                    j->grad.type, w, H);
#else
    float dot = portable_grad_row(grad_row, token_row, out_row, j->grad.type, w, H, buf);
#endif
    store_f32(&dot, j->probs.type, (char*)j->probs_grad.data + (size_t)slot * elem_size(j->probs.type), 1);
  }
#if defined(__AVX2__)
  _mm_sfence(); /* streamed stores are visible before the task ends */
#endif
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
  if (!st && __atomic_load_n(&j->failed, __ATOMIC_SEQ_CST)) st = ort_out_of_memory(op);
  return st;
}

static OrtStatus* moe_forward_compute(void* kernel, OrtKernelContext* ctx) {
  const char* op = "MoeTokenUnpermute";
  MoeJob j;
  memset(&j, 0, sizeof j);
  int present;
  OrtStatus* st = ort_input(ctx, 0, &j.tokens, &present);
  if (!st) st = ort_input(ctx, 1, &j.indices, &present);
  if (!st) st = ort_input(ctx, 2, &j.probs, &j.has_probs);
  if (st) return st;
  g_calls++;
  if (j.tokens.rank != 2 || j.indices.rank != 1 || (j.has_probs && j.probs.rank != 2))
    return ort_error(op, "expected ranks 2, 1 and 2, got %ld, %ld and %ld", (long)j.tokens.rank, (long)j.indices.rank,
                 (long)(j.has_probs ? j.probs.rank : 2));
  int64_t m = j.indices.dims[0];
  j.topk = j.has_probs ? j.probs.dims[1] : 1;
  j.tokens_n = j.has_probs ? j.probs.dims[0] : m;
  if (j.tokens_n * j.topk != m)
    return ort_error(op, "len(sorted_indices) = %ld, expected tokens * topK = %ld * %ld", (long)m, (long)j.tokens_n,
                 (long)j.topk);
  st = check_permutation(op, (const int32_t*)j.indices.data, m);
  if (st) return st;
  j.rows = j.tokens.dims[0];
  j.hidden = j.tokens.dims[1];
  int64_t dims[2] = {j.tokens_n, j.hidden};
  st = ort_output(ctx, 0, dims, 2, &j.out);
  return st ? st : moe_run(ctx, op, &j, moe_forward_task, j.tokens_n, j.hidden * j.topk);
}

static OrtStatus* moe_grad_compute(void* kernel, OrtKernelContext* ctx) {
  const char* op = "MoeTokenUnpermuteGrad";
  MoeJob j;
  memset(&j, 0, sizeof j);
  int present;
  OrtStatus* st = ort_input(ctx, 0, &j.tokens, &j.has_tokens);
  if (!st) st = ort_input(ctx, 1, &j.grad, &present);
  if (!st) st = ort_input(ctx, 2, &j.indices, &present);
  if (!st) st = ort_input(ctx, 3, &j.probs, &j.has_probs);
  if (st) return st;
  g_calls++;
  if (j.grad.rank != 2 || j.indices.rank != 1) return ort_error(op, "expected ranks 2 and 1, got %ld and %ld",
                                                           (long)j.grad.rank, (long)j.indices.rank, 0);
  if (j.has_probs && !j.has_tokens) return ort_error(op, "probs needs permuted_tokens", 0, 0, 0);
  int64_t m = j.indices.dims[0];
  j.tokens_n = j.grad.dims[0];
  j.hidden = j.grad.dims[1];
  j.topk = j.has_probs ? j.probs.dims[1] : 1;
  if (j.has_probs && (j.probs.rank != 2 || j.probs.dims[0] != j.tokens_n))
    return ort_error(op, "probs must be (tokens, topK) with tokens = %ld", (long)j.tokens_n, 0, 0);
  if (j.tokens_n * j.topk != m)
    return ort_error(op, "len(sorted_indices) = %ld, expected tokens * topK = %ld * %ld", (long)m, (long)j.tokens_n,
                 (long)j.topk);
  if (j.has_tokens && (j.tokens.rank != 2 || j.tokens.dims[0] != m || j.tokens.dims[1] != j.hidden))
    return ort_error(op, "permuted_tokens must be (%ld, %ld)", (long)m, (long)j.hidden, 0);
  st = check_permutation(op, (const int32_t*)j.indices.data, m);
  if (st) return st;
  int64_t dims[2] = {m, j.hidden}, pdims[2] = {j.tokens_n, j.topk};
  st = ort_output(ctx, 0, dims, 2, &j.out);
  if (!st) st = ort_output(ctx, 1, pdims, 2, &j.probs_grad);
  if (st) return st;
  if (!j.has_probs) memset(j.probs_grad.data, 0, (size_t)j.probs_grad.size * elem_size(j.probs_grad.type));
  j.slot_of_row = (int32_t*)geir_scratch((size_t)(m > 0 ? m : 1) * sizeof(int32_t), 0);
  if (!j.slot_of_row) return ort_out_of_memory(op);
  const int32_t* s = (const int32_t*)j.indices.data;
  for (int64_t i = 0; i < m; i++) j.slot_of_row[s[i]] = (int32_t)i;
  st = moe_run(ctx, op, &j, moe_grad_task, m, j.hidden);
  free(j.slot_of_row);
  return st;
}


/* The kernels keep no state: padded_mode and restore_shape are ignored, as by the contract (MU-W1/MG-W1: CANN's
 * A2/A3 tilings ignore padded_mode, issue 27) and by the NumPy kernels.
 *
 * Forward (permuted_tokens, sorted_indices, probs) -> unpermuted_tokens; grad (permuted_tokens,
 * unpermuted_tokens_grad, sorted_indices, probs) -> (permuted_tokens_grad, probs_grad). Within one token dtype the
 * row whose probs dtype is the token dtype comes first: the variant ONNX Runtime matches when probs is absent. */
static const unsigned char FORWARD_TYPES[][4] = {
    {F32, I32, F32, F32},    {F32, I32, F16, F32},    {F32, I32, BF16, F32},
    {F16, I32, F16, F16},    {F16, I32, F32, F16},    {F16, I32, BF16, F16},
    {BF16, I32, BF16, BF16}, {BF16, I32, F32, BF16}, {BF16, I32, F16, BF16}};
static const unsigned char GRAD_TYPES[][6] = {
    {F32, F32, I32, F32, F32, F32},       {F32, F32, I32, F16, F32, F16},       {F32, F32, I32, BF16, F32, BF16},
    {F16, F16, I32, F16, F16, F16},       {F16, F16, I32, F32, F16, F32},       {F16, F16, I32, BF16, F16, BF16},
    {BF16, BF16, I32, BF16, BF16, BF16}, {BF16, BF16, I32, F32, BF16, F32}, {BF16, BF16, I32, F16, BF16, F16}};

static const GeirOpDesc OPS[] = {
    {.name = "MoeTokenUnpermute", .n_in = 3, .n_out = 1, .optional_in = 1 << 2,
     .attributes = "padded_mode,restore_shape", GEIR_COMBOS(FORWARD_TYPES), .compute = moe_forward_compute},
    {.name = "MoeTokenUnpermuteGrad", .n_in = 4, .n_out = 2, .optional_in = (1 << 0) | (1 << 3),
     .attributes = "padded_mode,restore_shape", GEIR_COMBOS(GRAD_TYPES), .compute = moe_grad_compute},
};
GEIR_FAMILY(moe, OPS);
