/* MoE token unpermute and its gradient (spec 3.3); sorted_indices[t*K + k] is the row of slot (t, k). */
#include "half.h"
#include "kernels.h"

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

static void moe_forward_task(void* user, size_t task) {
  MoeJob* j = (MoeJob*)user;
  int64_t H = j->hidden, K = j->topk;
  const int32_t* s = (const int32_t*)j->indices.data;
  size_t ts = elem_size(j->tokens.type), ps = j->has_probs ? elem_size(j->probs.type) : 0;
  float* acc = (float*)geir_scratch((size_t)(2 * H + 1) * sizeof(float), 0);
  if (!acc) {
    __atomic_store_n(&j->failed, 1, __ATOMIC_SEQ_CST);
    return;
  }
  float* row = acc + H;
  int64_t first = (int64_t)task * j->per_task, last = first + j->per_task;
  if (last > j->tokens_n) last = j->tokens_n;
  size_t row_bytes = (size_t)H * ts;
  for (int64_t t = first; t < last; t++) {
    if (t + 1 < last) /* the next token's rows are scattered over permuted_tokens: fetch them while this one sums */
      for (int64_t k = 0; k < K; k++) {
        int64_t r = s[(t + 1) * K + k];
        if (r < j->rows)
          for (size_t b = 0; b < row_bytes; b += 64) __builtin_prefetch((const char*)j->tokens.data + (size_t)r * row_bytes + b, 0, 3);
      }
    for (int64_t k = 0; k < K; k++) {
      int64_t r = s[t * K + k];
      float w = 1.0f;
      int keep = r < j->rows;
      if (j->has_probs) {
        load_f32((const char*)j->probs.data + (size_t)(t * K + k) * ps, j->probs.type, &w, 1);
        keep = keep && w != 0.0f;
      }
      const float* src = row;
      if (keep && j->tokens.type == T_FLOAT) { /* float32: weight the row where it lies, no copy */
        src = (const float*)((const char*)j->tokens.data + (size_t)r * row_bytes);
      } else if (keep) {
        load_f32((const char*)j->tokens.data + (size_t)r * row_bytes, j->tokens.type, row, (size_t)H);
      } else {
        for (int64_t i = 0; i < H; i++) row[i] = 0.0f;
      }
      /* acc = r0 * w0 (+ r1 * w1) ...: each product rounded, then added in k order, as the NumPy kernel
       * (a dropped or zero-weight slot adds 0 * w, which keeps the sign of the NumPy kernel's zeros) */
      if (k == 0 && j->has_probs)
        for (int64_t i = 0; i < H; i++) acc[i] = src[i] * w;
      else if (k == 0)
        memcpy(acc, src, (size_t)H * sizeof(float));
      else if (j->has_probs)
        for (int64_t i = 0; i < H; i++) acc[i] += src[i] * w;
      else
        for (int64_t i = 0; i < H; i++) acc[i] += src[i];
    }
    for (int64_t i = 0; i < H; i++) acc[i] += 0.0f; /* as the NumPy kernel: a lone -0 becomes +0 */
    store_f32(acc, j->tokens.type, (char*)j->out.data + (size_t)t * H * ts, (size_t)H);
  }
  free(acc);
}

#define PREFETCH_ROWS 4

/* o = d * w with non-temporal stores where the CPU has them: the output is written once and not read
 * back here, so it skips the cache (no read-for-ownership of every line). */
static void scale_row_streaming(float* o, const float* d, float w, int64_t n) {
  int64_t i = 0;
#if defined(__AVX__)
  for (; i < n && ((uintptr_t)(o + i) & 31u); i++) o[i] = d[i] * w;
  __m256 vw = _mm256_set1_ps(w);
  for (; i + 8 <= n; i += 8) _mm256_stream_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(d + i), vw));
#endif
  for (; i < n; i++) o[i] = d[i] * w;
}

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
  float *dy = buf, *row = buf + H;
  int64_t first = (int64_t)task * j->per_task, last = first + j->per_task;
  if (last > M) last = M;
  size_t row_bytes = (size_t)H * gs;
  for (int64_t r = first; r < last; r++) {
    int64_t slot = slot_of_row[r], t = slot / K;
    const char* grad_row = (const char*)j->grad.data + (size_t)t * row_bytes;
    if (r + PREFETCH_ROWS < last) { /* dY rows are read in slot order, scattered: fetch one ahead of its use */
      const char* ahead = (const char*)j->grad.data + (size_t)(slot_of_row[r + PREFETCH_ROWS] / K) * row_bytes;
      for (size_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b, 0, 3);
    }
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
      scale_row_streaming((float*)out_row, d, w, H);
    } else {
      load_f32(grad_row, j->grad.type, dy, (size_t)H);
      for (int64_t i = 0; i < H; i++) row[i] = dy[i] * w;
      store_f32(row, j->grad.type, out_row, (size_t)H);
      load_f32((const char*)j->tokens.data + (size_t)r * H * gs, j->tokens.type, row, (size_t)H);
      d = dy;
      p = row;
    }
    /* float32 dot over H, the order is the contract's to choose: 32 lanes (four independent vector sums, so
     * the adds do not wait on each other), then a fixed pairwise tree */
    float lanes[32];
    for (int l = 0; l < 32; l++) lanes[l] = 0.0f;
    int64_t i = 0;
    for (; i + 32 <= H; i += 32)
      for (int l = 0; l < 32; l++) lanes[l] += p[i + l] * d[i + l];
    for (; i < H; i++) lanes[i & 31] += p[i] * d[i];
    for (int width = 16; width > 0; width /= 2)
      for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    float dot = lanes[0];
    store_f32(&dot, j->probs.type, (char*)j->probs_grad.data + (size_t)slot * elem_size(j->probs.type), 1);
  }
#if defined(__AVX__)
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

OrtStatus* moe_forward_compute(void* kernel, OrtKernelContext* ctx) {
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

OrtStatus* moe_grad_compute(void* kernel, OrtKernelContext* ctx) {
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

