/* The keys a sparse attention call selects (sfa.h): the plan (sfa_plan.c) lists every entry's key tensor row;
 * here the distinct rows are numbered and each is widened to float32 once. Memory and work follow the entries,
 * never the size of the key tensor (a paged cache may hold far more rows than a call reads). */
#include "sfa.h"

/* ---- the distinct selected keys -------------------------------------------------------------------- */

/* The entries name key tensor rows; compaction numbers the distinct ones 0..distinct-1 in ascending row order
 * (flat_of_compact lists them) and rewrites each entry to its compact number. Memory and work follow the entries,
 * not the key tensor: a map indexed by key row when the tensor has at most MAP_ROWS_PER_ENTRY rows per entry
 * (plus MAP_MIN_ROWS), else a radix sort of the entries by row (a paged cache, or a long sequence read sparsely). */
#define MAP_ROWS_PER_ENTRY 2
#define MAP_MIN_ROWS ((int64_t)1 << 16)
#define RADIX_BITS 16

static OrtStatus* list_distinct(SfaPlan* p) {
  p->flat_of_compact = (int64_t*)geir_scratch((size_t)(p->distinct > 0 ? p->distinct : 1) * sizeof(int64_t), 0);
  return p->flat_of_compact ? NULL : ort_out_of_memory(p->op);
}

static OrtStatus* compact_by_map(SfaPlan* p, int64_t flat_rows) {
  int64_t* compact_of_flat = (int64_t*)geir_scratch((size_t)flat_rows * sizeof(int64_t), 0);
  if (!compact_of_flat) return ort_out_of_memory(p->op);
  memset(compact_of_flat, 0xff, (size_t)flat_rows * sizeof(int64_t)); /* -1: not selected */
  for (int64_t e = 0; e < p->entries; e++) compact_of_flat[p->entry_key[e]] = 0;
  for (int64_t f = 0; f < flat_rows; f++) p->distinct += compact_of_flat[f] == 0;
  OrtStatus* st = list_distinct(p);
  for (int64_t f = 0, c = 0; !st && f < flat_rows; f++)
    if (compact_of_flat[f] == 0) {
      p->flat_of_compact[c] = f;
      compact_of_flat[f] = c++;
    }
  for (int64_t e = 0; !st && e < p->entries; e++) p->entry_key[e] = compact_of_flat[p->entry_key[e]];
  free(compact_of_flat);
  return st;
}

static OrtStatus* compact_by_sort(SfaPlan* p, int64_t flat_rows) {
  int64_t n = p->entries, buckets = (int64_t)1 << RADIX_BITS, *key = p->entry_key;
  int64_t* order = (int64_t*)geir_scratch((size_t)(2 * n + 1) * sizeof(int64_t), 0);
  int64_t* count = (int64_t*)geir_scratch((size_t)buckets * sizeof(int64_t), 0);
  if (!order || !count) {
    free(order);
    free(count);
    return ort_out_of_memory(p->op);
  }
  int64_t* spare = order + n;
  for (int64_t i = 0; i < n; i++) order[i] = i;
  for (int shift = 0; shift < 64 && (shift == 0 || (flat_rows - 1) >> shift); shift += RADIX_BITS) {
    memset(count, 0, (size_t)buckets * sizeof(int64_t)); /* one stable counting pass on this digit */
    for (int64_t i = 0; i < n; i++) count[(key[order[i]] >> shift) & (buckets - 1)]++;
    for (int64_t d = 0, at = 0; d < buckets; d++) {
      int64_t c = count[d];
      count[d] = at;
      at += c;
    }
    for (int64_t i = 0; i < n; i++) spare[count[(key[order[i]] >> shift) & (buckets - 1)]++] = order[i];
    int64_t* t = order;
    order = spare;
    spare = t;
  }
  free(count);
  for (int64_t i = 0; i < n; i++) p->distinct += i == 0 || key[order[i]] != key[order[i - 1]];
  OrtStatus* st = list_distinct(p);
  for (int64_t i = 0, c = -1, last = -1; !st && i < n; i++) {
    int64_t e = order[i];
    if (key[e] != last) {
      last = key[e];
      p->flat_of_compact[++c] = last;
    }
    key[e] = c;
  }
  free(order < spare ? order : spare); /* the one allocation, whichever half the passes ended in */
  return st;
}

/* ---- the widened keys ------------------------------------------------------------------------------ */

typedef struct {
  SfaPlan* p;
  int64_t per_task;
} WidenJob;

static void widen_task(void* user, size_t task) {
  WidenJob* w = (WidenJob*)user;
  SfaPlan* p = w->p;
  size_t es = elem_size(p->type);
  int64_t first = (int64_t)task * w->per_task, last = first + w->per_task;
  if (last > p->distinct) last = p->distinct;
  for (int64_t c = first; c < last; c++) {
    int64_t flat = p->flat_of_compact[c];
    float* k = p->kw + c * p->dkp;
    load_f32((const char*)p->key.data + (size_t)(flat * p->d) * es, p->type, k, (size_t)p->d);
    if (p->has_rope) load_f32((const char*)p->key_rope.data + (size_t)(flat * p->dr) * es, p->type, k + p->d, (size_t)p->dr);
    memset(k + p->dk, 0, (size_t)(p->dkp - p->dk) * sizeof(float));
    if (p->vw != p->kw) {
      float* v = p->vw + c * p->d2p;
      load_f32((const char*)p->value.data + (size_t)(flat * p->d2) * es, p->type, v, (size_t)p->d2);
      memset(v + p->d2, 0, (size_t)(p->d2p - p->d2) * sizeof(float));
    }
  }
}

OrtStatus* sfa_widen_keys(OrtKernelContext* ctx, SfaPlan* p) {
  int64_t flat_rows = p->key_rows * p->n2;
  OrtStatus* st = flat_rows <= MAP_ROWS_PER_ENTRY * p->entries + MAP_MIN_ROWS ? compact_by_map(p, flat_rows)
                                                                               : compact_by_sort(p, flat_rows);
  if (st) return st;
  int64_t n = p->distinct > 0 ? p->distinct : 1;
  p->kw = (float*)geir_scratch((size_t)(n * p->dkp) * sizeof(float), 0);
  p->vw = p->has_value ? (float*)geir_scratch((size_t)(n * p->d2p) * sizeof(float), 0) : p->kw;
  p->vw_ld = p->has_value ? p->d2p : p->dkp;
  if (!p->kw || !p->vw) return ort_out_of_memory(p->op);
  WidenJob job = {p, 64};
  return ort_parallel(ctx, widen_task, (size_t)((p->distinct + job.per_task - 1) / job.per_task), &job);
}
