/* SparseFlashAttention and SparseFlashAttentionGrad (spec 4.6, 4.7) on the plan of sfa_plan.c.
 *
 * Every (query row, KV head) pair multiplies its G query heads with its selected keys through
 * geir_gemm, reading the widened key rows in place: S^T = K Q^T (keys x heads), softmax over keys per
 * head, then O = P V (forward); the grad adds dP^T = V dO^T, dS = P (dP - rowsum(dO O)), dQ = scale dS K,
 * and the key-side products dK += scale dS^T Q, dV += round(P)^T dO.
 *
 * Roundings as the spec states: P rounded to the input dtype before P V (forward) and before its dV
 * product (grad), dS rounded before its products, the scale applied in float32, one rounding per output.
 *
 * Determinism: every output element is summed in an order fixed by the data alone. The forward and dQ
 * write rows owned by one pair. dK and dV are accumulated by tasks that each own a range of key rows and
 * add the pairs' contributions to a row in ascending pair order, so the bits do not depend on the number
 * of threads or on how the keys are split among them (no atomics, no scatter with repeated targets). */
#include <math.h>

#include "family.h"
#include "sfa.h"
#include "vecmath.h"

typedef struct {
  SfaPlan* p;
  int failed; /* a task could not allocate its scratch: the kernel returns an error */
} Shared;

static void fail(Shared* s) { __atomic_store_n(&s->failed, 1, __ATOMIC_SEQ_CST); }

/* The query side of a pair: its G head rows [query | query_rope] widened (g x dkp), and transposed (dk x gp). */
static void load_queries(const SfaPlan* p, int64_t pair, float* rows, float* transposed) {
  int64_t q = pair / p->n2, head0 = (pair % p->n2) * p->g;
  size_t es = elem_size(p->type);
  for (int64_t h = 0; h < p->g; h++) {
    float* r = rows + h * p->dkp;
    load_f32((const char*)p->query.data + (size_t)((q * p->n1 + head0 + h) * p->d) * es, p->type, r, (size_t)p->d);
    if (p->has_rope)
      load_f32((const char*)p->query_rope.data + (size_t)((q * p->n1 + head0 + h) * p->dr) * es, p->type, r + p->d,
               (size_t)p->dr);
    memset(r + p->dk, 0, (size_t)(p->dkp - p->dk) * sizeof(float));
  }
  if (!transposed) return;
  for (int64_t c = 0; c < p->dk; c++) {
    float* t = transposed + c * p->gp;
    for (int64_t h = 0; h < p->g; h++) t[h] = rows[h * p->dkp + c];
    for (int64_t h = p->g; h < p->gp; h++) t[h] = 0.0f;
  }
}

/* Offset of the (pair, head 0) statistics in softmax_max / softmax_sum: (B, N2, S1, G) or (N2, T1, G). */
static int64_t stats_offset(const SfaPlan* p, int64_t pair) {
  int64_t q = pair / p->n2, head = pair % p->n2;
  if (p->k->tnd) return (head * p->rows + q) * p->g;
  return ((p->batch[q] * p->n2 + head) * p->seq_q + p->s1[q]) * p->g;
}

static void point_rows(const float** rows, const float* base, int64_t n, int64_t stride) {
  for (int64_t i = 0; i < n; i++) rows[i] = base + i * stride;
}

/* ---- forward ----------------------------------------------------------------------------------------- */

/* Scores (n > 0 keys, rows of gp heads) -> P rounded to the input dtype, in place; m and total get each head's
 * max (with its sink) and sum of exponentials (with the sink's), in IEEE arithmetic as the spec's formula: an
 * infinite or NaN maximum gives NaN probabilities, as it does there. Rows are whole vectors: the padded heads
 * compute harmless values that no product reads. Every buffer is the caller's heap scratch (none on the stack), so
 * a head group of any size fits. */
static void softmax_rows(const SfaPlan* p, float* st, int64_t n, const float* sinks, float* m, float* total) {
  int64_t g = p->g, gp = p->gp;
  vf scale = vf_splat(p->k->scale);
  for (int64_t h = 0; h < gp; h++) m[h] = -INFINITY;
  for (int64_t i = 0; i < n; i++)
    for (int64_t h = 0; h < gp; h += GEIR_VEC) {
      vf x = vf_load(st + i * gp + h) * scale, best = vf_load(m + h);
      vf_store(st + i * gp + h, x);
      vf_store(m + h, vf_select((x > best) | (x != x), x, best)); /* NaN propagates, as NumPy's max */
    }
  for (int64_t h = 0; h < gp; h++) { /* a real head's maximum is used as it is, infinite or NaN (IEEE, as the spec) */
    if (h < g && sinks && (sinks[h] > m[h] || sinks[h] != sinks[h])) m[h] = sinks[h];
    if (h >= g) m[h] = 0.0f;
    total[h] = 0.0f;
  }
  for (int64_t i = 0; i < n; i++)
    for (int64_t h = 0; h < gp; h += GEIR_VEC) {
      vf e = vf_exp(vf_load(st + i * gp + h) - vf_load(m + h));
      vf_store(st + i * gp + h, e);
      vf_store(total + h, vf_load(total + h) + e);
    }
  for (int64_t h = 0; h < gp; h++) { /* total is the divisor: n > 0 keys, so >= 1 unless the maximum is not finite */
    if (h < g && sinks) total[h] += vf_exp(vf_splat(sinks[h] - m[h]))[0];
    if (h >= g) total[h] = 1.0f; /* a padded head divides by 1 */
  }
  for (int64_t i = 0; i < n; i++) /* P, rounded to the input dtype before P V */
    for (int64_t h = 0; h < gp; h += GEIR_VEC)
      vf_store(st + i * gp + h, vf_round(p->type, vf_load(st + i * gp + h) / vf_load(total + h)));
}

typedef struct {
  Shared s;
  Tensor out, mx, sm;
  int64_t per_task;
} ForwardJob;

static void forward_task(void* user, size_t task) {
  ForwardJob* job = (ForwardJob*)user;
  SfaPlan* p = job->s.p;
  int64_t g = p->g, gp = p->gp, L = p->max_selected > 0 ? p->max_selected : 1;
  int64_t pointers = L + p->dk + g;
  int64_t scores_work = geir_gemm_work_floats(gp, p->dk), out_work = geir_gemm_work_floats(p->d2p, L);
  int64_t work_floats = scores_work > out_work ? scores_work : out_work; /* S^T = K Q^T, then O = P V */
  size_t floats = (size_t)(L * gp + p->dk * gp + g * p->dkp + g * p->d2p + 2 * gp + work_floats);
  float* scratch = (float*)geir_scratch(floats * sizeof(float) + (size_t)pointers * 3 * sizeof(void*), 0);
  if (!scratch) {
    fail(&job->s);
    return;
  }
  float *st = scratch, *qt = st + L * gp, *qrows = qt + p->dk * gp, *o = qrows + g * p->dkp, *m = o + g * p->d2p,
        *total = m + gp, *work = total + gp;
  const float** a_rows = (const float**)(work + work_floats);
  const float** b_rows = a_rows + pointers;
  float** c_rows = (float**)(b_rows + pointers);
  const float* sinks = p->has_sinks ? (const float*)p->sinks.data : NULL;
  size_t es = elem_size(p->type);
  int64_t first = (int64_t)task * job->per_task, last = first + job->per_task;
  if (last > p->pairs) last = p->pairs;
  for (int64_t pair = first; pair < last; pair++) {
    int64_t q = pair / p->n2, head0 = (pair % p->n2) * g, e0 = p->start[pair], n = p->start[pair + 1] - e0;
    char* out = (char*)job->out.data + (size_t)((q * p->n1 + head0) * p->d2) * es;
    float* mx = p->k->lse ? (float*)job->mx.data + stats_offset(p, pair) : NULL;
    float* sm = p->k->lse ? (float*)job->sm.data + stats_offset(p, pair) : NULL;
    int computed = p->active[q] && (p->threshold[q] > 0 || p->k->mode == 0);
    if (n == 0) { /* no key: output 0; statistics 0, or the sink's (max = sink, sum = 1) */
      memset(out, 0, (size_t)(g * p->d2) * es);
      for (int64_t h = 0; mx && h < g; h++) {
        mx[h] = computed && sinks ? sinks[head0 + h] : 0.0f;
        sm[h] = computed && sinks ? 1.0f : 0.0f;
      }
      continue;
    }
    load_queries(p, pair, qrows, qt);
    for (int64_t i = 0; i < n; i++) a_rows[i] = p->kw + (int64_t)p->entry_key[e0 + i] * p->dkp;
    point_rows(b_rows, qt, p->dk, gp);
    point_rows((const float**)c_rows, st, n, gp);
    geir_gemm(n, gp, p->dk, a_rows, 1, b_rows, c_rows, 0, work); /* S^T: keys x heads */
    softmax_rows(p, st, n, sinks ? sinks + head0 : NULL, m, total);
    for (int64_t h = 0; mx && h < g; h++) {
      mx[h] = m[h];
      sm[h] = total[h];
    }
    for (int64_t h = 0; h < g; h++) a_rows[h] = st + h;
    for (int64_t i = 0; i < n; i++) b_rows[i] = p->vw + (int64_t)p->entry_key[e0 + i] * p->vw_ld;
    point_rows((const float**)c_rows, o, g, p->d2p);
    geir_gemm(g, p->d2p, n, a_rows, gp, b_rows, c_rows, 0, work); /* O = P V */
    for (int64_t h = 0; h < g; h++) store_f32(o + h * p->d2p, p->type, out + (size_t)(h * p->d2) * es, (size_t)p->d2);
  }
  free(scratch);
}

static int64_t pairs_per_task(const SfaPlan* p) {
  /* about 4 MFLOP per task, and at least 4 tasks per CPU when there are that many pairs */
  int64_t per_pair = 2 * p->g * (p->entries / (p->pairs > 0 ? p->pairs : 1) + 1) * (p->dk + p->d2) + 1;
  int64_t by_work = (4 << 20) / per_pair + 1, by_spread = p->pairs / (4 * sfa_cpu_count()) + 1;
  return by_work < by_spread ? by_work : by_spread;
}

static OrtStatus* sfa_forward_compute(void* state, OrtKernelContext* ctx) {
  const SfaKernel* k = (const SfaKernel*)state;
  ForwardJob job;
  memset(&job, 0, sizeof job);
  SfaPlan plan;
  OrtStatus* st = sfa_plan_inputs(ctx, k, &plan);
  if (!st) st = sfa_plan(ctx, &plan, NULL);
  if (st) return st;
  g_calls++;
  SfaPlan* p = job.s.p = &plan;
  int64_t dims[4];
  size_t rank = p->query.rank;
  memcpy(dims, p->query.dims, rank * sizeof(int64_t));
  dims[rank - 1] = p->d2;
  st = ort_output(ctx, 0, dims, rank, &job.out);
  int64_t stats[4] = {p->batches, p->n2, p->seq_q, p->g}, none[1] = {0};
  if (k->tnd) {
    stats[0] = p->n2;
    stats[1] = p->rows;
    stats[2] = p->g;
  }
  if (!st) st = ort_output(ctx, 1, k->lse ? stats : none, k->lse ? (k->tnd ? 3 : 4) : 1, &job.mx);
  if (!st) st = ort_output(ctx, 2, k->lse ? stats : none, k->lse ? (k->tnd ? 3 : 4) : 1, &job.sm);
  if (!st) {
    job.per_task = pairs_per_task(p);
    st = ort_parallel(ctx, forward_task, (size_t)((p->pairs + job.per_task - 1) / job.per_task), &job);
  }
  if (!st && job.s.failed) st = ort_out_of_memory(p->op);
  sfa_plan_free(p);
  return st;
}

/* ---- grad -------------------------------------------------------------------------------------------- */

#define GRAD_CHUNK_BYTES ((int64_t)256 << 20) /* query-side data and dS of the pairs processed together */

typedef struct {
  Shared s;
  Tensor d_out, out, smax, ssum;
  Tensor dq, dk, dv, dqr, dkr;
  int64_t p0, p1, e0;     /* the chunk: pairs [p0, p1), their entries from e0 */
  int64_t side_floats;    /* per pair: query rows, Q^T, dO rows, dO^T, max, sum, rowsum(dO O) */
  float* side;
  float* ds;              /* rounded dS of the chunk's entries, gp floats each */
  float *acck, *accv;     /* per compact key: dK (dkp) and dV (d2p) in float32 */
  int64_t tasks;          /* key-owning tasks */
  int32_t* owner;         /* per compact key */
  int64_t* task_start;    /* tasks + 1: the chunk's entries of task t are task_entries[task_start[t] ..] */
  int64_t* task_entries;
  int64_t per_task;
} GradJob;

static float* side_of(const GradJob* job, int64_t pair) { return job->side + (pair - job->p0) * job->side_floats; }

static void side_task(void* user, size_t task) {
  GradJob* job = (GradJob*)user;
  SfaPlan* p = job->s.p;
  int64_t g = p->g, gp = p->gp;
  float* o = (float*)geir_scratch((size_t)p->d2 * sizeof(float), 0);
  if (!o) {
    fail(&job->s);
    return;
  }
  size_t es = elem_size(p->type);
  int64_t first = job->p0 + (int64_t)task * job->per_task, last = first + job->per_task;
  if (last > job->p1) last = job->p1;
  for (int64_t pair = first; pair < last; pair++) {
    if (p->start[pair + 1] == p->start[pair]) continue;
    float *qrows = side_of(job, pair), *qt = qrows + g * p->dkp, *dorows = qt + p->dk * gp, *dot = dorows + g * p->d2p;
    float *m = dot + p->d2 * gp, *l = m + gp, *rowsum = l + gp;
    load_queries(p, pair, qrows, qt);
    int64_t q = pair / p->n2, head0 = (pair % p->n2) * g, so = stats_offset(p, pair);
    for (int64_t h = 0; h < gp; h++) { /* padded heads: values no product reads, and no division by 0 */
      m[h] = rowsum[h] = 0.0f;
      l[h] = 1.0f;
    }
    for (int64_t h = 0; h < g; h++) {
      size_t at = (size_t)((q * p->n1 + head0 + h) * p->d2) * es;
      float* d = dorows + h * p->d2p;
      load_f32((const char*)job->d_out.data + at, p->type, d, (size_t)p->d2);
      memset(d + p->d2, 0, (size_t)(p->d2p - p->d2) * sizeof(float));
      load_f32((const char*)job->out.data + at, p->type, o, (size_t)p->d2);
      float sum = 0.0f;
      for (int64_t c = 0; c < p->d2; c++) sum += d[c] * o[c];
      rowsum[h] = sum;
      m[h] = ((const float*)job->smax.data)[so + h];
      l[h] = ((const float*)job->ssum.data)[so + h];
    }
    for (int64_t c = 0; c < p->d2; c++) {
      float* t = dot + c * gp;
      for (int64_t h = 0; h < g; h++) t[h] = dorows[h * p->d2p + c];
      for (int64_t h = g; h < gp; h++) t[h] = 0.0f;
    }
  }
  free(o);
}

typedef struct { /* a key task's scratch, sized for the largest pair */
  float *st, *dpt, *a1, *a2, *work;
  const float **a_rows, **b_rows;
  float** c_rows;
} KeyScratch;

/* The contributions of ``pair`` to the keys of entries ``ids`` (all owned by one task): S^T and dP^T for
 * those keys, P and the rounded dS, then dK += scale dS^T Q and dV += round(P)^T dO. */
static void key_run(GradJob* job, int64_t pair, const int64_t* ids, int64_t n, KeyScratch* w) {
  SfaPlan* p = job->s.p;
  int64_t g = p->g, gp = p->gp;
  const float *qrows = side_of(job, pair), *qt = qrows + g * p->dkp, *dorows = qt + p->dk * gp,
              *dot = dorows + g * p->d2p;
  const float *m = dot + p->d2 * gp, *l = m + gp, *rowsum = l + gp;
  float scale = p->k->scale;
  for (int64_t i = 0; i < n; i++) w->a_rows[i] = p->kw + (int64_t)p->entry_key[ids[i]] * p->dkp;
  point_rows(w->b_rows, qt, p->dk, gp);
  point_rows((const float**)w->c_rows, w->st, n, gp);
  geir_gemm(n, gp, p->dk, w->a_rows, 1, w->b_rows, w->c_rows, 0, w->work); /* S^T */
  for (int64_t i = 0; i < n; i++) w->a_rows[i] = p->vw + (int64_t)p->entry_key[ids[i]] * p->vw_ld;
  point_rows(w->b_rows, dot, p->d2, gp);
  point_rows((const float**)w->c_rows, w->dpt, n, gp);
  geir_gemm(n, gp, p->d2, w->a_rows, 1, w->b_rows, w->c_rows, 0, w->work); /* dP^T = V dO^T */
  vf vscale = vf_splat(scale);
  for (int64_t i = 0; i < n; i++) {
    float *s = w->st + i * gp, *dp = w->dpt + i * gp, *ds = w->a1 + i * gp, *pr = w->a2 + i * gp;
    float* kept = job->ds + (ids[i] - job->e0) * gp; /* the rounded dS, for the query side's dQ */
    for (int64_t h = 0; h < gp; h += GEIR_VEC) { /* P = exp(scale S - max) / sum; dS = P (dP - rowsum(dO O)) */
      vf prob = vf_exp(vscale * vf_load(s + h) - vf_load(m + h)) / vf_load(l + h);
      vf rounded_ds = vf_round(p->type, prob * (vf_load(dp + h) - vf_load(rowsum + h)));
      vf_store(kept + h, rounded_ds);
      vf_store(ds + h, rounded_ds * vscale);
      vf_store(pr + h, vf_round(p->type, prob));
    }
  }
  for (int64_t i = 0; i < n; i++) w->c_rows[i] = job->acck + (int64_t)p->entry_key[ids[i]] * p->dkp;
  point_rows((const float**)w->a_rows, w->a1, n, gp);
  point_rows(w->b_rows, qrows, g, p->dkp);
  geir_gemm(n, p->dkp, g, w->a_rows, 1, w->b_rows, w->c_rows, 1, w->work); /* dK += scale dS^T Q */
  for (int64_t i = 0; i < n; i++) w->c_rows[i] = job->accv + (int64_t)p->entry_key[ids[i]] * p->d2p;
  point_rows((const float**)w->a_rows, w->a2, n, gp);
  point_rows(w->b_rows, dorows, g, p->d2p);
  geir_gemm(n, p->d2p, g, w->a_rows, 1, w->b_rows, w->c_rows, 1, w->work); /* dV += round(P)^T dO */
}

static void key_task(void* user, size_t task) {
  GradJob* job = (GradJob*)user;
  SfaPlan* p = job->s.p;
  int64_t n = p->max_selected, gp = p->gp, width = p->dk > p->d2 ? p->dk : p->d2;
  width = width > p->g ? width : p->g;
  int64_t work_floats = geir_gemm_work_floats(gp, p->dk > p->d2 ? p->dk : p->d2); /* S^T and dP^T */
  int64_t key_side = geir_gemm_work_floats(p->dkp > p->d2p ? p->dkp : p->d2p, p->g); /* dK and dV */
  if (key_side > work_floats) work_floats = key_side;
  KeyScratch w;
  float* scratch = (float*)geir_scratch((size_t)(4 * n * gp + work_floats) * sizeof(float) +
                                            (size_t)(2 * n + width) * sizeof(void*), 0);
  if (!scratch) {
    fail(&job->s);
    return;
  }
  w.st = scratch;
  w.dpt = w.st + n * gp;
  w.a1 = w.dpt + n * gp;
  w.a2 = w.a1 + n * gp;
  w.work = w.a2 + n * gp;
  w.a_rows = (const float**)(w.work + work_floats);
  w.c_rows = (float**)(w.a_rows + n);
  w.b_rows = (const float**)(w.c_rows + n);
  const int64_t* ids = job->task_entries + job->task_start[task];
  int64_t count = job->task_start[task + 1] - job->task_start[task], pair = job->p0;
  for (int64_t i = 0; i < count;) { /* runs of one pair, in ascending pair order */
    while (p->start[pair + 1] <= ids[i]) pair++;
    int64_t run = 1;
    while (i + run < count && ids[i + run] < p->start[pair + 1]) run++;
    key_run(job, pair, ids + i, run, &w);
    i += run;
  }
  free(scratch);
}

/* dQ = scale dS K for each pair of the chunk, rounded into d_query and d_query_rope. */
static void query_task(void* user, size_t task) {
  GradJob* job = (GradJob*)user;
  SfaPlan* p = job->s.p;
  int64_t g = p->g, gp = p->gp, n_max = p->max_selected > 0 ? p->max_selected : 1;
  int64_t work_floats = geir_gemm_work_floats(p->dkp, n_max);
  float* scratch = (float*)geir_scratch((size_t)(g * p->dkp + work_floats) * sizeof(float) +
                                            (size_t)(n_max + 2 * g) * sizeof(void*), 0);
  if (!scratch) {
    fail(&job->s);
    return;
  }
  float* work = scratch + g * p->dkp;
  const float** a_rows = (const float**)(work + work_floats);
  const float** b_rows = a_rows + g;
  float** c_rows = (float**)(b_rows + n_max);
  size_t es = elem_size(p->type);
  float scale = p->k->scale;
  int64_t first = job->p0 + (int64_t)task * job->per_task, last = first + job->per_task;
  if (last > job->p1) last = job->p1;
  for (int64_t pair = first; pair < last; pair++) {
    int64_t q = pair / p->n2, head0 = (pair % p->n2) * g, e0 = p->start[pair], n = p->start[pair + 1] - e0;
    for (int64_t h = 0; h < g; h++) {
      a_rows[h] = job->ds + (e0 - job->e0) * gp + h;
      c_rows[h] = scratch + h * p->dkp;
    }
    for (int64_t i = 0; i < n; i++) b_rows[i] = p->kw + (int64_t)p->entry_key[e0 + i] * p->dkp;
    geir_gemm(g, p->dkp, n, a_rows, gp, b_rows, c_rows, 0, work);
    for (int64_t h = 0; h < g; h++) {
      float* row = scratch + h * p->dkp;
      for (int64_t c = 0; c < p->dk; c++) row[c] *= scale;
      int64_t at = q * p->n1 + head0 + h;
      store_f32(row, p->type, (char*)job->dq.data + (size_t)(at * p->d) * es, (size_t)p->d);
      if (p->has_rope) store_f32(row + p->d, p->type, (char*)job->dqr.data + (size_t)(at * p->dr) * es, (size_t)p->dr);
    }
  }
  free(scratch);
}

/* The first compact key whose key tensor row is >= f (flat_of_compact ascends), or distinct. */
static int64_t first_compact_from(const SfaPlan* p, int64_t f) {
  int64_t lo = 0, hi = p->distinct;
  while (lo < hi) {
    int64_t mid = lo + (hi - lo) / 2;
    if (p->flat_of_compact[mid] < f)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* d_key, d_key_rope, d_value of every key tensor row: the float32 sums rounded once; unselected rows 0. */
static void key_output_task(void* user, size_t task) {
  GradJob* job = (GradJob*)user;
  SfaPlan* p = job->s.p;
  float* merged = (float*)geir_scratch((size_t)p->dkp * sizeof(float), 0);
  if (!merged) {
    fail(&job->s);
    return;
  }
  size_t es = elem_size(p->type);
  int64_t flat_rows = p->key_rows * p->n2, first = (int64_t)task * job->per_task, last = first + job->per_task;
  if (last > flat_rows) last = flat_rows;
  int64_t next = first_compact_from(p, first); /* the selected rows of the range, walked in step */
  for (int64_t f = first; f < last; f++) {
    int64_t c = next < p->distinct && p->flat_of_compact[next] == f ? next++ : -1;
    char* dk = (char*)job->dk.data + (size_t)(f * p->d) * es;
    char* dkr = p->has_rope ? (char*)job->dkr.data + (size_t)(f * p->dr) * es : NULL;
    char* dv = p->has_value ? (char*)job->dv.data + (size_t)(f * p->d2) * es : NULL;
    if (c < 0) {
      memset(dk, 0, (size_t)p->d * es);
      if (dkr) memset(dkr, 0, (size_t)p->dr * es);
      if (dv) memset(dv, 0, (size_t)p->d2 * es);
      continue;
    }
    const float *k = job->acck + c * p->dkp, *v = job->accv + c * p->d2p;
    if (!p->has_value) { /* KV merge: d_key[..., :D2] += d_value before rounding */
      memcpy(merged, k, (size_t)p->dk * sizeof(float));
      for (int64_t i = 0; i < p->d2; i++) merged[i] += v[i];
      k = merged;
    }
    store_f32(k, p->type, dk, (size_t)p->d);
    if (dkr) store_f32(k + p->d, p->type, dkr, (size_t)p->dr);
    if (dv) store_f32(v, p->type, dv, (size_t)p->d2);
  }
  free(merged);
}

/* Key tasks per grad call when above 0: a test hook (geir_sfa_key_tasks) proving that the split of the keys
 * among tasks does not change a bit. */
static long g_key_tasks;
void geir_sfa_key_tasks(long tasks) { __atomic_store_n(&g_key_tasks, tasks, __ATOMIC_SEQ_CST); }
/* Pairs per chunk when above 0 (default: what GRAD_CHUNK_BYTES holds): the test hook for chunk boundaries. */
static long g_chunk_pairs;
void geir_sfa_chunk_pairs(long pairs) { __atomic_store_n(&g_chunk_pairs, pairs, __ATOMIC_SEQ_CST); }

/* Split the compact keys among one task per CPU, of about equal entry counts (every split gives the same bits;
 * more tasks than threads only shrink the matrix products: measured 50 ms with 2 tasks, 54 with 4, 65 with 8 at
 * the bench shape on 2 CPUs). */
static OrtStatus* own_keys(GradJob* job) {
  SfaPlan* p = job->s.p;
  long forced = __atomic_load_n(&g_key_tasks, __ATOMIC_SEQ_CST);
  int64_t n = p->distinct > 0 ? p->distinct : 1, tasks = forced > 0 ? forced : sfa_cpu_count();
  if (tasks > n) tasks = n;
  int64_t* count = (int64_t*)geir_scratch((size_t)n * sizeof(int64_t), 1);
  job->owner = (int32_t*)geir_scratch((size_t)n * sizeof(int32_t), 0);
  job->task_start = (int64_t*)geir_scratch((size_t)(tasks + 1) * sizeof(int64_t), 0);
  job->task_entries = (int64_t*)geir_scratch((size_t)(p->entries > 0 ? p->entries : 1) * sizeof(int64_t), 0);
  if (!count || !job->owner || !job->task_start || !job->task_entries) {
    free(count);
    return ort_out_of_memory(p->op);
  }
  for (int64_t e = 0; e < p->entries; e++) count[p->entry_key[e]]++;
  int64_t seen = 0, t = 0;
  for (int64_t c = 0; c < p->distinct; c++) {
    job->owner[c] = (int32_t)t;
    seen += count[c];
    if (t + 1 < tasks && seen * tasks >= (t + 1) * p->entries) t++;
  }
  job->tasks = tasks;
  free(count);
  return NULL;
}

/* The chunk's entries bucketed by owning task, each bucket in ascending entry (so pair) order. */
static void bucket_entries(GradJob* job) {
  SfaPlan* p = job->s.p;
  int64_t e1 = p->start[job->p1];
  memset(job->task_start, 0, (size_t)(job->tasks + 1) * sizeof(int64_t));
  for (int64_t e = job->e0; e < e1; e++) job->task_start[job->owner[p->entry_key[e]] + 1]++;
  for (int64_t t = 0; t < job->tasks; t++) job->task_start[t + 1] += job->task_start[t];
  int64_t* fill = job->task_start; /* advanced while filling, then restored */
  for (int64_t e = job->e0; e < e1; e++) job->task_entries[fill[job->owner[p->entry_key[e]]]++] = e;
  for (int64_t t = job->tasks; t > 0; t--) job->task_start[t] = job->task_start[t - 1];
  job->task_start[0] = 0;
}

static OrtStatus* grad_inputs(OrtKernelContext* ctx, GradJob* job) {
  SfaPlan* p = job->s.p;
  int one;
  OrtStatus* st = ort_input(ctx, 3, &job->d_out, &one);
  if (!st) st = ort_input(ctx, 4, &job->out, &one);
  if (!st) st = ort_input(ctx, 5, &job->smax, &one);
  if (!st) st = ort_input(ctx, 6, &job->ssum, &one);
  if (st) return st;
  size_t rank = p->query.rank;
  if (job->d_out.rank != rank || job->out.rank != rank || job->d_out.type != p->query.type ||
      job->out.type != p->query.type)
    return ort_errorf(p->op, "d_out and out: expected the rank and dtype of query");
  for (size_t i = 0; i < rank; i++)
    if (job->d_out.dims[i] != job->out.dims[i] || (i + 1 < rank && job->d_out.dims[i] != p->query.dims[i]))
      return ort_errorf(p->op, "d_out and out: expected the query's leading dims and one D2");
  return NULL;
}

static OrtStatus* check_stats(GradJob* job) {
  SfaPlan* p = job->s.p;
  int64_t want[4] = {p->batches, p->n2, p->seq_q, p->g};
  if (p->k->tnd) {
    want[0] = p->n2;
    want[1] = p->rows;
    want[2] = p->g;
  }
  size_t rank = p->k->tnd ? 3 : 4;
  const Tensor* t[2] = {&job->smax, &job->ssum};
  for (int i = 0; i < 2; i++) {
    int ok = t[i]->type == T_FLOAT && t[i]->rank == rank;
    for (size_t d = 0; ok && d < rank; d++) ok = t[i]->dims[d] == want[d];
    if (!ok) return ort_errorf(p->op, "%s: expected float32 %s", i ? "softmax_sum" : "softmax_max",
                               p->k->tnd ? "(N2, T1, G)" : "(B, N2, S1, G)");
  }
  return NULL;
}

static OrtStatus* grad_outputs(OrtKernelContext* ctx, GradJob* job) {
  SfaPlan* p = job->s.p;
  OrtStatus* st = ort_output(ctx, 0, p->query.dims, p->query.rank, &job->dq);
  if (!st) st = ort_output(ctx, 1, p->key.dims, p->key.rank, &job->dk);
  if (!st && p->has_value) st = ort_output(ctx, 2, p->value.dims, p->value.rank, &job->dv);
  if (!st && p->has_rope) st = ort_output(ctx, 3, p->query_rope.dims, p->query_rope.rank, &job->dqr);
  if (!st && p->has_rope) st = ort_output(ctx, 4, p->key_rope.dims, p->key_rope.rank, &job->dkr);
  return st;
}

static OrtStatus* grad_chunks(OrtKernelContext* ctx, GradJob* job) {
  SfaPlan* p = job->s.p;
  int64_t g = p->g, gp = p->gp;
  job->side_floats = g * p->dkp + p->dk * gp + g * p->d2p + p->d2 * gp + 3 * gp;
  int64_t budget = GRAD_CHUNK_BYTES / (int64_t)sizeof(float), per_pair_max = job->side_floats + p->max_selected * gp;
  int64_t pairs_max = budget / per_pair_max > 1 ? budget / per_pair_max : 1;
  long forced = __atomic_load_n(&g_chunk_pairs, __ATOMIC_SEQ_CST);
  if (forced > 0) pairs_max = forced;
  if (pairs_max > p->pairs) pairs_max = p->pairs > 0 ? p->pairs : 1;
  job->side = (float*)geir_scratch((size_t)(pairs_max * job->side_floats) * sizeof(float), 0);
  job->ds = (float*)geir_scratch((size_t)((pairs_max * p->max_selected + 1) * gp) * sizeof(float), 0);
  if (!job->side || !job->ds) return ort_out_of_memory(p->op);
  OrtStatus* st = NULL;
  for (job->p0 = 0; job->p0 < p->pairs && !st && !job->s.failed; job->p0 = job->p1) {
    job->p1 = job->p0 + pairs_max < p->pairs ? job->p0 + pairs_max : p->pairs;
    job->e0 = p->start[job->p0];
    job->per_task = pairs_per_task(p);
    size_t pair_tasks = (size_t)((job->p1 - job->p0 + job->per_task - 1) / job->per_task);
    st = ort_parallel(ctx, side_task, pair_tasks, job);
    if (!st && !job->s.failed) {
      bucket_entries(job);
      st = ort_parallel(ctx, key_task, (size_t)job->tasks, job);
    }
    if (!st && !job->s.failed) st = ort_parallel(ctx, query_task, pair_tasks, job);
  }
  if (!st && !job->s.failed) {
    int64_t flat_rows = p->key_rows * p->n2;
    job->per_task = 256;
    st = ort_parallel(ctx, key_output_task, (size_t)((flat_rows + job->per_task - 1) / job->per_task), job);
  }
  return st;
}

static OrtStatus* sfa_grad_compute(void* state, OrtKernelContext* ctx) {
  const SfaKernel* k = (const SfaKernel*)state;
  GradJob job;
  memset(&job, 0, sizeof job);
  SfaPlan plan;
  OrtStatus* st = sfa_plan_inputs(ctx, k, &plan);
  job.s.p = &plan;
  if (!st) st = grad_inputs(ctx, &job);
  if (st) {
    sfa_plan_free(&plan);
    return st;
  }
  st = sfa_plan(ctx, &plan, &job.d_out);
  if (st) return st;
  g_calls++;
  SfaPlan* p = &plan;
  st = check_stats(&job);
  if (!st && p->has_value && p->value.dims[p->value.rank - 1] != job.d_out.dims[job.d_out.rank - 1])
    st = ort_errorf(p->op, "value head dim %lld differs from d_out's %lld", (long long)p->value.dims[p->value.rank - 1],
                    (long long)job.d_out.dims[job.d_out.rank - 1]);
  if (!st) st = grad_outputs(ctx, &job);
  if (!st) {
    int64_t n = p->distinct > 0 ? p->distinct : 1;
    job.acck = (float*)geir_scratch((size_t)(n * p->dkp) * sizeof(float), 1);
    job.accv = (float*)geir_scratch((size_t)(n * p->d2p) * sizeof(float), 1);
    if (!job.acck || !job.accv) st = ort_out_of_memory(p->op);
  }
  if (!st) st = own_keys(&job);
  if (!st) st = grad_chunks(ctx, &job);
  if (!st && job.s.failed) st = ort_out_of_memory(p->op);
  free(job.side);
  free(job.ds);
  free(job.acck);
  free(job.accv);
  free(job.owner);
  free(job.task_start);
  free(job.task_entries);
  sfa_plan_free(p);
  return st;
}

/* ---- the family's ops ------------------------------------------------------------------------------ */

enum { FORWARD, GRAD };

static OrtStatus* sfa_create(const GeirOpDesc* op, const OrtKernelInfo* info, void** state) {
  SfaKernel* k = (SfaKernel*)calloc(1, sizeof(SfaKernel));
  if (!k) return FN(CreateStatusFn, SLOT_CreateStatus)(ORT_FAIL, "out of memory");
  OrtStatus* st = sfa_read_attributes(info, op->variant == GRAD, k);
  if (st) {
    free(k);
    return st;
  }
  *state = k;
  return NULL;
}

/* All floating tensors float16, or all bfloat16; indices, block table and lengths int32; sinks and the softmax
 * statistics float32. Forward: (query, key, value, sparse_indices, block_table, actual_seq_lengths_query,
 * actual_seq_lengths_kv, query_rope, key_rope, sinks) -> (attention_out, softmax_max, softmax_sum). Grad: (query,
 * key, sparse_indices, d_out, out, softmax_max, softmax_sum, value, actual_seq_lengths_query,
 * actual_seq_lengths_kv, query_rope, key_rope) -> (d_query, d_key, d_value, d_query_rope, d_key_rope). */
static const unsigned char FORWARD_TYPES[][13] = {
    {F16, F16, F16, I32, I32, I32, I32, F16, F16, F32, /* -> */ F16, F32, F32},
    {BF16, BF16, BF16, I32, I32, I32, I32, BF16, BF16, F32, /* -> */ BF16, F32, F32}};
static const unsigned char GRAD_TYPES[][17] = {
    {F16, F16, I32, F16, F16, F32, F32, F16, I32, I32, F16, F16, /* -> */ F16, F16, F16, F16, F16},
    {BF16, BF16, I32, BF16, BF16, F32, F32, BF16, I32, I32, BF16, BF16, /* -> */ BF16, BF16, BF16, BF16, BF16}};

/* The kernels read scale_value, sparse_block_size, the layouts, sparse_mode and return_softmax_lse; pre_tokens,
 * next_tokens, attention_mode and deterministic do not change the contract's semantics (spec 4.3; the kernels
 * are always deterministic). */
static const GeirOpDesc OPS[] = {
    {.name = "SparseFlashAttention", .n_in = 10, .n_out = 3, .optional_in = 0x3f0,
     .attributes = "scale_value,sparse_block_size,layout_query,layout_kv,sparse_mode,pre_tokens,next_tokens,"
                   "attention_mode,return_softmax_lse",
     GEIR_COMBOS(FORWARD_TYPES), .variant = FORWARD, .create = sfa_create, .compute = sfa_forward_compute,
     .destroy = free},
    {.name = "SparseFlashAttentionGrad", .n_in = 12, .n_out = 5, .optional_in = 0xf80, .optional_out = 0x1c,
     .attributes = "scale_value,sparse_block_size,layout,sparse_mode,pre_tokens,next_tokens,deterministic",
     GEIR_COMBOS(GRAD_TYPES), .variant = GRAD, .create = sfa_create, .compute = sfa_grad_compute, .destroy = free},
};
GEIR_FAMILY(sfa, OPS);
