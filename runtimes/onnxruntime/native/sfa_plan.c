/* The plan of a sparse attention call (sfa.h): attributes, shapes, row metadata (spec 4.5), the data
 * rules (spec 4.8, 4.11: lengths, then block ids, then page ids, first violation reported) and the selected
 * keys of every (query row, KV head) pair; sfa_keys.c numbers the distinct ones and widens them to float32.
 *
 * The selection is geir.schemas.sparse_attention.selection's, written again here for the kernel; the
 * suite compares the two (a probe reads which keys each row saw). */
#include "sfa.h"

#include <unistd.h>

static const char* const FORWARD_NAME = "SparseFlashAttention";
static const char* const GRAD_NAME = "SparseFlashAttentionGrad";

static void release(OrtStatus* st) {
  if (st) FN(ReleaseStatusFn, SLOT_ReleaseStatus)(st);
}

static int64_t attr_int(const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t v = fallback;
  OrtStatus* st = FN(KernelInfoGetAttributeInt64Fn, SLOT_KernelInfoGetAttribute_int64)(info, name, &v);
  if (st) {
    release(st);
    return fallback;
  }
  return v;
}

static void attr_string(const OrtKernelInfo* info, const char* name, char* out, size_t cap, const char* fallback) {
  size_t size = cap;
  OrtStatus* st = FN(KernelInfoGetAttributeStringFn, SLOT_KernelInfoGetAttribute_string)(info, name, out, &size);
  if (st) { /* absent, or longer than any layout name: the fallback, or a name no layout has */
    release(st);
    snprintf(out, cap, "%s", size > cap ? "?" : fallback);
  }
}

OrtStatus* sfa_read_attributes(const OrtKernelInfo* info, int grad, SfaKernel* k) {
  const char* op = grad ? GRAD_NAME : FORWARD_NAME;
  memset(k, 0, sizeof *k);
  k->grad = grad;
  OrtStatus* st = FN(KernelInfoGetAttributeFloatFn, SLOT_KernelInfoGetAttribute_float)(info, "scale_value", &k->scale);
  if (st) {
    release(st);
    return ort_errorf(op, "attribute 'scale_value' is required");
  }
  if (!(k->scale - k->scale == 0.0f)) return ort_errorf(op, "attribute 'scale_value': expected a finite value");
  k->block_size = attr_int(info, "sparse_block_size", 1);
  k->mode = attr_int(info, "sparse_mode", 3);
  if (k->block_size < 1)
    return ort_errorf(op, "attribute 'sparse_block_size': expected >= 1, got %lld", (long long)k->block_size);
  if (k->mode != 0 && k->mode != 3)
    return ort_errorf(op, "attribute 'sparse_mode': expected 0 or 3, got %lld", (long long)k->mode);
  char layout_q[16], layout_kv[16];
  attr_string(info, grad ? "layout" : "layout_query", layout_q, sizeof layout_q, "BSND");
  if (strcmp(layout_q, "BSND") && strcmp(layout_q, "TND"))
    return ort_errorf(op, "attribute '%s': expected BSND or TND, got %s", grad ? "layout" : "layout_query", layout_q);
  k->tnd = strcmp(layout_q, "TND") == 0;
  if (!grad) {
    attr_string(info, "layout_kv", layout_kv, sizeof layout_kv, "BSND");
    k->paged = strcmp(layout_kv, "PA_BSND") == 0;
    if (!k->paged && strcmp(layout_kv, layout_q))
      return ort_errorf(op, "attribute 'layout_kv': expected %s or PA_BSND, got %s", layout_q, layout_kv);
    k->lse = attr_int(info, "return_softmax_lse", 0) != 0;
  }
  return NULL;
}

void sfa_plan_free(SfaPlan* p) {
  free(p->batch);
  free(p->start);
  free(p->entry_key);
  free(p->flat_of_compact);
  free(p->kw);
  if (p->vw != p->kw) free(p->vw);
  memset(p, 0, sizeof *p);
}

/* ---- shapes ---------------------------------------------------------------------------------------- */

static int same_dims(const Tensor* a, const Tensor* b, size_t upto) {
  if (a->rank != b->rank) return 0;
  for (size_t i = 0; i < upto && i < a->rank; i++)
    if (a->dims[i] != b->dims[i]) return 0;
  return 1;
}

static OrtStatus* check_half(const SfaPlan* p, const Tensor* t, const char* name) {
  if (t->type != p->type) return ort_errorf(p->op, "%s: expected the dtype of query", name);
  return NULL;
}

static OrtStatus* check_int32_vector(const SfaPlan* p, const Tensor* t, const char* name, int64_t length) {
  if (t->type != T_INT32 || t->rank != 1 || (length >= 0 && t->dims[0] != length))
    return ort_errorf(p->op, "%s: expected an int32 vector of length %lld", name, (long long)length);
  return NULL;
}

static OrtStatus* read_inputs(OrtKernelContext* ctx, SfaPlan* p) {
  const SfaKernel* k = p->k;
  int grad = k->grad, one;
  size_t i_value = grad ? 7 : 2, i_indices = grad ? 2 : 3, i_lq = grad ? 8 : 5, i_lkv = grad ? 9 : 6,
         i_qr = grad ? 10 : 7, i_kr = grad ? 11 : 8;
  int has_kr = 0;
  OrtStatus* st = ort_input(ctx, 0, &p->query, &one);
  if (!st) st = ort_input(ctx, 1, &p->key, &one);
  if (!st) st = ort_input(ctx, i_value, &p->value, &p->has_value);
  if (!st) st = ort_input(ctx, i_indices, &p->indices, &one);
  if (!st && !grad) st = ort_input(ctx, 4, &p->table, &p->has_table);
  if (!st) st = ort_input(ctx, i_lq, &p->lengths_q, &p->has_lq);
  if (!st) st = ort_input(ctx, i_lkv, &p->lengths_kv, &p->has_lkv);
  if (!st) st = ort_input(ctx, i_qr, &p->query_rope, &p->has_rope);
  if (!st) st = ort_input(ctx, i_kr, &p->key_rope, &has_kr);
  if (!st && !grad) st = ort_input(ctx, 9, &p->sinks, &p->has_sinks);
  if (st) return st;
  if (p->has_rope != has_kr) return ort_errorf(p->op, "query_rope and key_rope must both be present or both absent");
  if (!grad && !p->has_value) return ort_errorf(p->op, "value is required");
  return NULL;
}

static OrtStatus* check_shapes(SfaPlan* p, const Tensor* d_out) {
  const SfaKernel* k = p->k;
  const Tensor *q = &p->query, *key = &p->key;
  size_t qrank = k->tnd ? 3 : 4, krank = k->paged ? 4 : qrank;
  p->type = q->type;
  if (p->type != T_FLOAT16 && p->type != T_BFLOAT16) return ort_errorf(p->op, "query: expected float16 or bfloat16");
  if (q->rank != qrank || key->rank != krank)
    return ort_errorf(p->op, "query and key: expected ranks %zu and %zu, got %zu and %zu", qrank, krank, q->rank,
                      key->rank);
  OrtStatus* st = check_half(p, key, "key");
  if (st) return st;
  for (size_t i = 0; i < q->rank; i++)
    if (q->dims[i] <= 0) return ort_errorf(p->op, "query dim %zu is %lld: no dimension may be 0", i, (long long)q->dims[i]);
  for (size_t i = 0; i < key->rank; i++)
    if (key->dims[i] <= 0) return ort_errorf(p->op, "key dim %zu is %lld: no dimension may be 0", i, (long long)key->dims[i]);
  p->rows = k->tnd ? q->dims[0] : q->dims[0] * q->dims[1];
  p->n1 = q->dims[qrank - 2];
  p->d = q->dims[qrank - 1];
  p->n2 = key->dims[krank - 2];
  p->key_rows = key->size / (p->n2 * key->dims[krank - 1]);
  if (key->dims[krank - 1] != p->d)
    return ort_errorf(p->op, "key head dim is %lld, expected the query's %lld", (long long)key->dims[krank - 1],
                      (long long)p->d);
  if (p->n1 % p->n2) return ort_errorf(p->op, "N1 = %lld is not a multiple of N2 = %lld", (long long)p->n1, (long long)p->n2);
  p->g = p->n1 / p->n2;
  if (!k->tnd && !k->paged && key->dims[0] != q->dims[0])
    return ort_errorf(p->op, "key batch is %lld, expected the query's %lld", (long long)key->dims[0], (long long)q->dims[0]);
  p->seq_q = k->tnd ? 0 : q->dims[1];
  p->seq_kv = k->tnd || k->paged ? 0 : key->dims[1];
  if (p->has_value) {
    if ((st = check_half(p, &p->value, "value"))) return st;
    if (!same_dims(&p->value, key, krank - 1) || p->value.dims[krank - 1] <= 0)
      return ort_errorf(p->op, "value: expected the leading dims of key");
    p->d2 = p->value.dims[krank - 1];
  } else {
    p->d2 = d_out->dims[qrank - 1];
  }
  if (p->d2 > p->d) return ort_errorf(p->op, "D2 = %lld exceeds D = %lld", (long long)p->d2, (long long)p->d);
  const Tensor* ind = &p->indices;
  if (ind->type != T_INT32 || ind->rank != qrank || !same_dims(ind, q, qrank - 2) || ind->dims[qrank - 2] != p->n2 ||
      ind->dims[qrank - 1] <= 0)
    return ort_errorf(p->op, "sparse_indices: expected int32 (%s, N2 = %lld, K > 0)", k->tnd ? "T1" : "B, S1",
                      (long long)p->n2);
  p->k_entries = ind->dims[qrank - 1];
  p->dr = 0;
  if (p->has_rope) {
    const Tensor *qr = &p->query_rope, *kr = &p->key_rope;
    if ((st = check_half(p, qr, "query_rope")) || (st = check_half(p, kr, "key_rope"))) return st;
    if (!same_dims(qr, q, qrank - 1) || !same_dims(kr, key, krank - 1) || qr->dims[qrank - 1] <= 0 ||
        kr->dims[krank - 1] != qr->dims[qrank - 1])
      return ort_errorf(p->op, "query_rope / key_rope: expected the leading dims of query / key and one rope dim");
    p->dr = qr->dims[qrank - 1];
  }
  p->dk = p->d + p->dr;
  /* batches and lengths */
  if (k->tnd) {
    if (!p->has_lq || !p->has_lkv) return ort_errorf(p->op, "TND needs actual_seq_lengths_query and _kv");
    p->batches = p->lengths_q.dims[0];
    if ((st = check_int32_vector(p, &p->lengths_q, "actual_seq_lengths_query", -1))) return st;
    if (p->batches < 1) return ort_errorf(p->op, "actual_seq_lengths_query: expected at least one batch");
  } else {
    p->batches = q->dims[0];
    if (!k->grad && p->has_lq && (st = check_int32_vector(p, &p->lengths_q, "actual_seq_lengths_query", p->batches)))
      return st;
  }
  if (p->has_lkv && !(k->grad && !k->tnd) &&
      (st = check_int32_vector(p, &p->lengths_kv, "actual_seq_lengths_kv", p->batches)))
    return st;
  if (k->paged) {
    const Tensor* t = &p->table;
    if (!p->has_table || t->type != T_INT32 || t->rank != 2 || t->dims[0] != p->batches || t->dims[1] < 1)
      return ort_errorf(p->op, "block_table: expected int32 (B = %lld, max_blocks >= 1)", (long long)p->batches);
    if (!p->has_lkv) return ort_errorf(p->op, "PA_BSND needs actual_seq_lengths_kv");
    p->block_num = key->dims[0];
    p->page = key->dims[1];
    p->max_blocks = t->dims[1];
    if (!k->tnd) p->seq_kv = p->max_blocks * p->page;
  } else if (p->has_table) {
    return ort_errorf(p->op, "block_table is only read with layout_kv PA_BSND");
  }
  if (p->has_sinks && (p->sinks.type != T_FLOAT || p->sinks.rank != 1 || p->sinks.dims[0] != p->n1))
    return ort_errorf(p->op, "sinks: expected float32 (N1 = %lld,)", (long long)p->n1);
  p->pairs = p->rows * p->n2;
  p->dkp = geir_padded(p->dk);
  p->d2p = geir_padded(p->d2);
  p->gp = geir_padded(p->g);
  return NULL;
}

/* ---- lengths (SA-D1, SF-D2, PA-D1) ----------------------------------------------------------------- */

static OrtStatus* check_per_batch(const SfaPlan* p, const char* rule, const char* name, const Tensor* t, int64_t limit) {
  const int32_t* v = (const int32_t*)t->data;
  for (int64_t b = 0; b < t->dims[0]; b++)
    if (v[b] < 0 || v[b] > limit)
      return ort_errorf(p->op, "[%s] %s position %lld: expected a length in [0, %lld], got %d", rule, name, (long long)b,
                        (long long)limit, v[b]);
  return NULL;
}

static OrtStatus* check_cumulative(const SfaPlan* p, const char* name, const Tensor* t, int64_t limit) {
  const int32_t* v = (const int32_t*)t->data;
  if (v[0] < 0) return ort_errorf(p->op, "[SA-D1] %s position 0: expected a first cumulative length >= 0, got %d", name, v[0]);
  for (int64_t b = 1; b < t->dims[0]; b++)
    if (v[b] < v[b - 1])
      return ort_errorf(p->op, "[SA-D1] %s position %lld: expected a non-decreasing value (>= %d), got %d", name,
                        (long long)b, v[b - 1], v[b]);
  if (v[t->dims[0] - 1] > limit)
    return ort_errorf(p->op, "[SA-D1] %s position %lld: expected a last value <= %lld, got %d", name,
                      (long long)(t->dims[0] - 1), (long long)limit, v[t->dims[0] - 1]);
  return NULL;
}

static OrtStatus* check_lengths(const SfaPlan* p) {
  const SfaKernel* k = p->k;
  const char *lq = "actual_seq_lengths_query", *lkv = "actual_seq_lengths_kv";
  OrtStatus* st = NULL;
  if (k->paged) {
    st = check_per_batch(p, "PA-D1", lkv, &p->lengths_kv, p->max_blocks * p->page);
    if (!st && k->tnd) st = check_cumulative(p, lq, &p->lengths_q, p->query.dims[0]);
    if (!st && !k->tnd && p->has_lq) st = check_per_batch(p, "SF-D2", lq, &p->lengths_q, p->seq_q);
  } else if (k->tnd) {
    st = check_cumulative(p, lq, &p->lengths_q, p->query.dims[0]);
    if (!st) st = check_cumulative(p, lkv, &p->lengths_kv, p->key.dims[0]);
  } else if (!k->grad) {
    if (p->has_lq) st = check_per_batch(p, "SF-D2", lq, &p->lengths_q, p->seq_q);
    if (!st && p->has_lkv) st = check_per_batch(p, "SF-D2", lkv, &p->lengths_kv, p->seq_kv);
  }
  return st;
}

/* ---- rows (spec 4.5) ------------------------------------------------------------------------------- */

static OrtStatus* describe_rows(SfaPlan* p) {
  const SfaKernel* k = p->k;
  int64_t n = p->rows;
  p->batch = (int64_t*)geir_scratch((size_t)n * 6 * sizeof(int64_t) + (size_t)n, 0);
  if (!p->batch) return ort_out_of_memory(p->op);
  p->s1 = p->batch + n;
  p->s1_len = p->s1 + n;
  p->s2_len = p->s1_len + n;
  p->kv_start = p->s2_len + n;
  p->threshold = p->kv_start + n;
  p->active = (unsigned char*)(p->threshold + n);
  const int32_t* aq = p->has_lq ? (const int32_t*)p->lengths_q.data : NULL;
  const int32_t* akv = p->has_lkv ? (const int32_t*)p->lengths_kv.data : NULL;
  int64_t b = 0, B = p->batches;
  for (int64_t q = 0; q < n; q++) {
    int64_t s1, s1_len, s2_len, kv_start = 0, batch;
    if (!k->tnd) {
      batch = q / p->seq_q;
      s1 = q % p->seq_q;
      int honour = !k->grad; /* the grad ignores BSND lengths (SG-W1) */
      s1_len = honour && aq ? aq[batch] : p->seq_q;
      s2_len = honour && akv ? akv[batch] : p->seq_kv;
      kv_start = batch * p->seq_kv;
      p->active[q] = s1 < s1_len;
    } else {
      while (b < B && aq[b] <= q) b++;
      p->active[q] = b < B;
      batch = b < B ? b : B - 1;
      int64_t q0 = batch > 0 ? aq[batch - 1] : 0;
      s1 = q - q0;
      s1_len = aq[batch] - q0;
      if (k->paged) {
        s2_len = akv[batch];
      } else {
        kv_start = batch > 0 ? akv[batch - 1] : 0;
        s2_len = akv[batch] - kv_start;
      }
    }
    p->batch[q] = batch;
    p->s1[q] = s1;
    p->s1_len[q] = s1_len;
    p->s2_len[q] = s2_len;
    p->kv_start[q] = kv_start;
    p->threshold[q] = k->mode == 0 ? s2_len : s2_len - s1_len + s1 + 1;
  }
  return NULL;
}

static int reads(const SfaPlan* p, int64_t q) { return p->active[q] && p->threshold[q] > 0; }

static void row_subject(const SfaPlan* p, int64_t q, int64_t head, char* out, size_t cap) {
  if (p->k->tnd)
    snprintf(out, cap, "row (t=%lld, n2=%lld)", (long long)q, (long long)head);
  else
    snprintf(out, cap, "row (b=%lld, s1=%lld, n2=%lld)", (long long)p->batch[q], (long long)p->s1[q], (long long)head);
}

/* ---- block ids (SA-D3) and the selection ----------------------------------------------------------- */

/* ceil(a / b) for a >= 0, b >= 1, without overflow for any block size up to INT64_MAX. */
static int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

/* SA-D3 on every entry of a row the op reads; ``stamp`` marks the ids seen in this row. */
static OrtStatus* check_row(const SfaPlan* p, int64_t q, int64_t head, const int32_t* row, int64_t* seen, int64_t stamp) {
  int64_t bs = p->k->block_size, nb = ceil_div(p->s2_len[q], bs);
  int padded = 0;
  char subject[96];
  for (int64_t i = 0; i < p->k_entries; i++) {
    int32_t v = row[i];
    if (v == -1) {
      padded = 1;
      continue;
    }
    const char* why = NULL;
    if (v < 0 || v >= nb)
      why = "expected -1 or a block id in [0, NB_b)";
    else if (padded)
      why = "expected -1 (padding only after the last valid block id)";
    else if (seen[v] == stamp)
      why = "expected a block id not listed before";
    if (why) {
      row_subject(p, q, head, subject, sizeof subject);
      return ort_errorf(p->op, "[SA-D3] sparse_indices %s entry %lld: %s (NB_b = %lld), got %d", subject, (long long)i,
                        why, (long long)nb, v);
    }
    seen[v] = stamp;
  }
  return NULL;
}

/* The key positions (relative to the batch) a row selects, in entry order, written to ``out`` when it is not
 * NULL; returns their count. Only the first min(K, ceil(thr / bs)) entries count, a -1 ends the row, and a
 * block is cut at the threshold (spec 4.5). */
static int64_t selected(const SfaPlan* p, int64_t q, const int32_t* row, int64_t* out) {
  int64_t thr = p->threshold[q], bs = p->k->block_size, count = 0;
  int64_t valid = ceil_div(thr, bs) < p->k_entries ? ceil_div(thr, bs) : p->k_entries;
  for (int64_t i = 0; i < valid && row[i] != -1; i++) {
    int64_t begin = (int64_t)row[i] * bs; /* row[i] < ceil(S2b / bs) (checked): begin < S2b, no overflow */
    int64_t end = bs >= thr - begin ? thr : begin + bs;
    for (int64_t j = begin; j < end; j++, count++)
      if (out) out[count] = j;
  }
  return count;
}

static OrtStatus* select_keys(SfaPlan* p) {
  const int32_t* indices = (const int32_t*)p->indices.data;
  int64_t nb_max = 1, K = p->k_entries;
  for (int64_t q = 0; q < p->rows; q++)
    if (reads(p, q) && ceil_div(p->s2_len[q], p->k->block_size) > nb_max) nb_max = ceil_div(p->s2_len[q], p->k->block_size);
  p->start = (int64_t*)geir_scratch((size_t)(p->pairs + 1) * sizeof(int64_t), 0);
  int64_t* seen = (int64_t*)geir_scratch((size_t)nb_max * sizeof(int64_t), 0);
  if (!p->start || !seen) {
    free(seen);
    return ort_out_of_memory(p->op);
  }
  for (int64_t i = 0; i < nb_max; i++) seen[i] = -1;
  OrtStatus* st = NULL;
  int64_t total = 0;
  for (int64_t pair = 0; pair < p->pairs && !st; pair++) {
    int64_t q = pair / p->n2, count = 0;
    p->start[pair] = total;
    if (!reads(p, q)) continue;
    const int32_t* row = indices + pair * K;
    st = check_row(p, q, pair % p->n2, row, seen, pair);
    if (!st) count = selected(p, q, row, NULL);
    total += count;
    if (count > p->max_selected) p->max_selected = count;
  }
  free(seen);
  if (st) return st;
  p->start[p->pairs] = p->entries = total;
  p->entry_key = (int64_t*)geir_scratch((size_t)(total > 0 ? total : 1) * sizeof(int64_t), 0);
  if (!p->entry_key) return ort_out_of_memory(p->op);
  const int32_t* table = p->has_table ? (const int32_t*)p->table.data : NULL;
  int64_t* positions = (int64_t*)geir_scratch((size_t)(p->max_selected > 0 ? p->max_selected : 1) * sizeof(int64_t), 0);
  if (!positions) return ort_out_of_memory(p->op);
  for (int64_t pair = 0; pair < p->pairs && !st; pair++) {
    int64_t q = pair / p->n2, head = pair % p->n2, e = p->start[pair];
    if (!reads(p, q)) continue;
    int64_t n = selected(p, q, indices + pair * K, positions), b = p->batch[q];
    for (int64_t i = 0; i < n && !st; i++) {
      int64_t j = positions[i], key_row = p->kv_start[q] + j;
      if (table) { /* PA-D1: the page a selected key is read through */
        int64_t column = j / p->page, page_id = table[b * p->max_blocks + column];
        if (page_id < 0 || page_id >= p->block_num) {
          char subject[96];
          row_subject(p, q, head, subject, sizeof subject);
          st = ort_errorf(p->op, "[PA-D1] block_table entry (b=%lld, column=%lld), read by %s: expected a page id in "
                          "[0, %lld) (block_num), got %lld", (long long)b, (long long)column, subject,
                          (long long)p->block_num, (long long)page_id);
        }
        key_row = page_id * p->page + j % p->page;
      }
      p->entry_key[e++] = key_row * p->n2 + head;
    }
  }
  free(positions);
  return st;
}

OrtStatus* sfa_plan_inputs(OrtKernelContext* ctx, const SfaKernel* k, SfaPlan* p) {
  memset(p, 0, sizeof *p);
  p->k = k;
  p->op = k->grad ? GRAD_NAME : FORWARD_NAME;
  return read_inputs(ctx, p);
}

OrtStatus* sfa_plan(OrtKernelContext* ctx, SfaPlan* p, const Tensor* d_out) {
  OrtStatus* st = check_shapes(p, d_out);
  if (!st) st = check_lengths(p);
  if (!st) st = describe_rows(p);
  if (!st) st = select_keys(p);
  if (!st) st = sfa_widen_keys(ctx, p);
  if (st) sfa_plan_free(p);
  return st;
}

int64_t sfa_cpu_count(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? n : 1;
}
