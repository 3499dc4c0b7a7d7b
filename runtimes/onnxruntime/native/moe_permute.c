/* MoE token permute and its gradient (schemas/moe_permute): a stable sort of the expert ids, then row copies; the
 * grad sums each token's K gradient rows in float32, k in order from +0, one rounding. sorted_indices[t*K + k] is
 * the row of slot (t, k); rows >= R were dropped by num_out_tokens. */
#include "family.h"
#include "half.h"

enum { I8 = 3, I64 = T_INT64 };
#define ID_LIMIT 16777215  /* MP-D1: ids in [0, ID_LIMIT), or the index dtype's minimum or maximum */
#define KEY_TOP (ID_LIMIT + 1)
#define RADIX_BITS 13
#define RADIX (1 << RADIX_BITS)

typedef struct {
  int64_t num_out_tokens, topk;
} PermuteKernel;

typedef struct {
  const char *src;
  char *dst;
  const int64_t *row2slot;
  const int32_t *slots;
  int64_t rows, topk, per_task, count, hidden, src_rows;
  size_t row_bytes;
  int type, failed;
} PermuteJob;

static size_t type_size(int type) { return type == I8 ? 1 : elem_size(type); }

/* The sort key of id v (MP-D1 checked before): the minimum first, then 0..ID_LIMIT-1, then the maximum. */
static uint32_t key_of(int64_t v, int64_t lo, int64_t hi) {
  return v == lo ? 0u : v == hi ? (uint32_t)KEY_TOP : (uint32_t)(v + 1);
}

/* row2slot: a stable LSD radix sort of the slots by key (two passes of 13 bits cover keys up to 2^26). */
static OrtStatus* stable_sort(const char* op, const uint32_t* keys, int64_t m, int64_t* row2slot) {
  int64_t* tmp = (int64_t*)geir_scratch((size_t)(m > 0 ? m : 1) * sizeof(int64_t), 0);
  int64_t* count = (int64_t*)geir_scratch((RADIX + 1) * sizeof(int64_t), 0);
  if (!tmp || !count) {
    free(tmp);
    free(count);
    return ort_out_of_memory(op);
  }
  for (int64_t i = 0; i < m; i++) tmp[i] = i;
  int64_t *from = tmp, *to = row2slot;
  for (int pass = 0; pass < 2; pass++) {
    int shift = pass * RADIX_BITS;
    memset(count, 0, (RADIX + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < m; i++) count[((keys[from[i]] >> shift) & (RADIX - 1)) + 1]++;
    for (int b = 0; b < RADIX; b++) count[b + 1] += count[b];
    for (int64_t i = 0; i < m; i++) to[count[(keys[from[i]] >> shift) & (RADIX - 1)]++] = from[i];
    int64_t* swap = from;
    from = to;
    to = swap;
  }
  /* after two passes the result is back in tmp's partner: from == tmp when the pass count is even */
  if (from != row2slot) memcpy(row2slot, from, (size_t)m * sizeof(int64_t));
  free(tmp);
  free(count);
  return NULL;
}

static void copy_rows_task(void* user, size_t task) {
  PermuteJob* j = (PermuteJob*)user;
  int64_t first = (int64_t)task * j->per_task, last = first + j->per_task;
  if (last > j->count) last = j->count;
  for (int64_t r = first; r < last; r++) {
    int64_t t = j->row2slot[r] / j->topk;
    memcpy(j->dst + (size_t)r * j->row_bytes, j->src + (size_t)t * j->row_bytes, j->row_bytes);
  }
}

static int64_t kept_rows(int64_t n, int64_t m) {
  int64_t rows = n <= 0 ? n + m : n;
  return rows < 0 ? 0 : rows > m ? m : rows;
}

static OrtStatus* permute_compute(void* state, OrtKernelContext* ctx) {
  const char* op = "MoeTokenPermute";
  const PermuteKernel* k = (const PermuteKernel*)state;
  Tensor tokens, indices, out, sorted;
  int present;
  OrtStatus* st = ort_input(ctx, 0, &tokens, &present);
  if (!st) st = ort_input(ctx, 1, &indices, &present);
  if (st) return st;
  g_calls++;
  if (tokens.rank < 2 || (indices.rank != 1 && indices.rank != 2) || indices.dims[0] != tokens.dims[0])
    return ort_error(op, "expected tokens of rank >= 2 and indices (tokens[, topK]) with dim 0 %ld, got ranks %ld, %ld",
                     (long)tokens.dims[0], (long)tokens.rank, (long)indices.rank);
  int64_t m = indices.size, topk = indices.rank == 2 ? indices.dims[1] : 1;
  int wide = indices.type == I64;
  int64_t lo = wide ? INT64_MIN : INT32_MIN, hi = wide ? INT64_MAX : INT32_MAX;
  for (int64_t i = 0; i < m; i++) {
    int64_t v = wide ? ((const int64_t*)indices.data)[i] : ((const int32_t*)indices.data)[i];
    if ((v < 0 || v >= ID_LIMIT) && v != lo && v != hi)
      return ort_errorf(op, "indices position %lld: expected an expert id in [0, %d) or the dtype's minimum or maximum, "
                        "got %lld", (long long)i, ID_LIMIT, (long long)v);
  }
  uint32_t* keys = (uint32_t*)geir_scratch((size_t)(m > 0 ? m : 1) * sizeof(uint32_t), 0);
  int64_t* row2slot = (int64_t*)geir_scratch((size_t)(m > 0 ? m : 1) * sizeof(int64_t), 0);
  if (!keys || !row2slot) {
    free(keys);
    free(row2slot);
    return ort_out_of_memory(op);
  }
  for (int64_t i = 0; i < m; i++)
    keys[i] = key_of(wide ? ((const int64_t*)indices.data)[i] : ((const int32_t*)indices.data)[i], lo, hi);
  st = stable_sort(op, keys, m, row2slot);
  free(keys);
  int64_t rows = kept_rows(k->num_out_tokens, m), dims[8], sdims[1] = {m};
  for (size_t d = 0; d < tokens.rank; d++) dims[d] = tokens.dims[d];
  dims[0] = rows;
  if (!st) st = ort_output(ctx, 0, dims, tokens.rank, &out);
  if (!st) st = ort_output(ctx, 1, sdims, 1, &sorted);
  if (!st) {
    for (int64_t r = 0; r < m; r++) ((int32_t*)sorted.data)[row2slot[r]] = (int32_t)r;
    PermuteJob j;
    memset(&j, 0, sizeof j);
    j.src = (const char*)tokens.data;
    j.dst = (char*)out.data;
    j.row2slot = row2slot;
    j.topk = topk;
    j.count = rows;
    j.row_bytes = (size_t)(tokens.dims[0] > 0 ? tokens.size / tokens.dims[0] : 0) * type_size(tokens.type);
    j.per_task = (int64_t)((1 << 16) / (j.row_bytes + 1)) + 1;
    size_t tasks = (size_t)((rows + j.per_task - 1) / j.per_task);
    st = ort_parallel(ctx, copy_rows_task, tasks, &j);
  }
  free(row2slot);
  return st;
}

/* One token's gradient: acc = +0, then += each of its K rows that exist (r < R), in k order; one rounding. */
static void grad_task(void* user, size_t task) {
  PermuteJob* j = (PermuteJob*)user;
  int64_t H = j->hidden, K = j->topk;
  float* buf = (float*)geir_scratch((size_t)(2 * H + 1) * sizeof(float), 0);
  if (!buf) {
    __atomic_store_n(&j->failed, 1, __ATOMIC_SEQ_CST);
    return;
  }
  float *acc = buf, *row = buf + H;
  size_t es = elem_size(j->type), row_bytes = (size_t)H * es;
  int64_t first = (int64_t)task * j->per_task, last = first + j->per_task;
  if (last > j->count) last = j->count;
  for (int64_t t = first; t < last; t++) {
    for (int64_t i = 0; i < H; i++) acc[i] = 0.0f;
    for (int64_t k = 0; k < K; k++) {
      int64_t r = j->slots[t * K + k];
      if (r >= j->src_rows) continue; /* a dropped row adds nothing */
      const char* src = j->src + (size_t)r * row_bytes;
      const float* x = (const float*)src;
      if (j->type != T_FLOAT) {
        load_f32(src, j->type, row, (size_t)H);
        x = row;
      }
      for (int64_t i = 0; i < H; i++) acc[i] += x[i];
    }
    store_f32(acc, j->type, j->dst + (size_t)t * row_bytes, (size_t)H);
  }
  free(buf);
}

static OrtStatus* permute_grad_compute(void* state, OrtKernelContext* ctx) {
  const char* op = "MoeTokenPermuteGrad";
  const PermuteKernel* k = (const PermuteKernel*)state;
  Tensor grad, indices, out;
  int present;
  OrtStatus* st = ort_input(ctx, 0, &grad, &present);
  if (!st) st = ort_input(ctx, 1, &indices, &present);
  if (st) return st;
  g_calls++;
  int64_t m = indices.rank == 1 ? indices.dims[0] : -1;
  if (grad.rank != 2 || m < 0 || k->topk < 1 || m % k->topk)
    return ort_error(op, "expected a rank-2 gradient and sorted_indices of a multiple of num_topk = %ld, got ranks "
                     "%ld and %ld", (long)k->topk, (long)grad.rank, (long)indices.rank);
  const int32_t* s = (const int32_t*)indices.data;
  unsigned char* seen = (unsigned char*)geir_scratch((size_t)(m > 0 ? m : 1), 1);
  if (!seen) return ort_out_of_memory(op);
  for (int64_t i = 0; i < m && !st; i++) {
    if (s[i] < 0 || s[i] >= m)
      st = ort_error(op, "sorted_indices position %ld: expected a value in [0, %ld), got %ld", (long)i, (long)m, (long)s[i]);
    else if (seen[s[i]]++)
      st = ort_error(op, "sorted_indices position %ld: value %ld repeats", (long)i, (long)s[i], 0);
  }
  free(seen);
  int64_t dims[2] = {m / k->topk, grad.dims[1]};
  if (!st) st = ort_output(ctx, 0, dims, 2, &out);
  if (st) return st;
  PermuteJob j;
  memset(&j, 0, sizeof j);
  j.src = (const char*)grad.data;
  j.dst = (char*)out.data;
  j.slots = s;
  j.topk = k->topk;
  j.count = dims[0];
  j.hidden = grad.dims[1];
  j.src_rows = grad.dims[0];
  j.type = grad.type;
  j.per_task = (1 << 15) / (j.hidden * j.topk + 1) + 1;
  size_t tasks = (size_t)((j.count + j.per_task - 1) / j.per_task);
  st = ort_parallel(ctx, grad_task, tasks, &j);
  if (!st && __atomic_load_n(&j.failed, __ATOMIC_SEQ_CST)) st = ort_out_of_memory(op);
  return st;
}

static OrtStatus* permute_create(const GeirOpDesc* op, const OrtKernelInfo* info, void** state) {
  PermuteKernel* k = (PermuteKernel*)calloc(1, sizeof(PermuteKernel));
  if (!k) return FN(CreateStatusFn, SLOT_CreateStatus)(ORT_FAIL, "out of memory");
  const char* name = op->variant ? "num_topk" : "num_out_tokens";
  int64_t* field = op->variant ? &k->topk : &k->num_out_tokens;
  OrtStatus* st = FN(KernelInfoGetAttributeInt64Fn, SLOT_KernelInfoGetAttribute_int64)(info, name, field);
  if (st) { /* absent: num_out_tokens defaults to 0; num_topk is required (the schema refuses its absence) */
    FN(ReleaseStatusFn, SLOT_ReleaseStatus)(st);
    *field = 0;
  }
  *state = k;
  return NULL; /* padded_mode is honoured by refusal: the rules reject True before any session exists */
}

/* (tokens, indices) -> (permute_tokens, sorted_indices); (permuted_output_grad, sorted_indices) -> input_grad. */
static const unsigned char FORWARD_TYPES[][4] = {
    {BF16, I32, BF16, I32}, {BF16, I64, BF16, I32}, {F16, I32, F16, I32}, {F16, I64, F16, I32},
    {F32, I32, F32, I32},   {F32, I64, F32, I32},   {I8, I32, I8, I32},   {I8, I64, I8, I32}};
static const unsigned char GRAD_TYPES[][3] = {{BF16, I32, BF16}, {F16, I32, F16}, {F32, I32, F32}};

static const GeirOpDesc OPS[] = {
    {.name = "MoeTokenPermute", .n_in = 2, .n_out = 2, .attributes = "num_out_tokens,padded_mode",
     GEIR_COMBOS(FORWARD_TYPES), .variant = 0, .create = permute_create, .compute = permute_compute, .destroy = free},
    {.name = "MoeTokenPermuteGrad", .n_in = 2, .n_out = 1, .attributes = "num_topk,padded_mode",
     GEIR_COMBOS(GRAD_TYPES), .variant = 1, .create = permute_create, .compute = permute_grad_compute,
     .destroy = free},
};
GEIR_FAMILY(moe_permute, OPS);
