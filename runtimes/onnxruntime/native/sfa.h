/* SparseFlashAttention and its gradient (spec 4.5-4.11): what the plan (sfa_plan.c) hands the compute
 * (sfa.c). The plan checks shapes and data (SA-D1, SF-D2, SA-D3, PA-D1), lists the keys every
 * (query row, KV head) pair selects, and widens each key row that any pair selects to float32 once. Its memory
 * and work follow the keys selected, not the size of the key tensor (a paged cache may be far larger). */
#ifndef GEIR_SFA_H
#define GEIR_SFA_H
#include "gemm.h"
#include "half.h"

/* Attributes, read once when ONNX Runtime creates the kernel. */
typedef struct {
  int grad, tnd, paged, lse;
  float scale;
  int64_t block_size, mode;
} SfaKernel;

typedef struct {
  const char* op;
  const SfaKernel* k;
  int type; /* T_FLOAT16 or T_BFLOAT16 */
  Tensor query, key, value, indices, table, lengths_q, lengths_kv, query_rope, key_rope, sinks;
  int has_value, has_table, has_lq, has_lkv, has_rope, has_sinks;
  int64_t rows, n1, n2, g, d, dr, dk, d2, k_entries; /* rows: flattened query rows (B*S1 or T1); dk = d + dr */
  int64_t batches, seq_q, seq_kv, key_rows;  /* BSND S1, S2 (paged: max_blocks * page); key tensor rows */
  int64_t page, max_blocks, block_num;
  /* per query row */
  int64_t *batch, *s1, *s1_len, *s2_len, *kv_start, *threshold;
  unsigned char* active;
  /* selected keys: entries [start[p], start[p + 1]) of pair p = row * n2 + head, as compact key indices */
  int64_t pairs, entries, max_selected;
  int64_t* start;
  int64_t* entry_key;
  /* the selected key rows (row * n2 + head of the key tensor), widened: kw rows [key | key_rope | 0]
   * of width dkp, vw rows [value | 0] of width d2p (vw == kw when value is absent: KV merge) */
  int64_t distinct, dkp, d2p, gp;
  int64_t* flat_of_compact; /* distinct entries, ascending: the key tensor row (row * n2 + head) of each compact row */
  float *kw, *vw;
  int64_t vw_ld;
} SfaPlan;

GEIR_INTERNAL OrtStatus* sfa_read_attributes(const OrtKernelInfo* info, int grad, SfaKernel* k);
/* The inputs at their ONNX indices (the grad's order when k->grad); then sfa_plan checks the shapes (d_out
 * gives D2 under KV merge) and the data, selects the keys and widens them; on error it frees the plan. */
GEIR_INTERNAL OrtStatus* sfa_plan_inputs(OrtKernelContext* ctx, const SfaKernel* k, SfaPlan* plan);
GEIR_INTERNAL OrtStatus* sfa_plan(OrtKernelContext* ctx, SfaPlan* plan, const Tensor* d_out);
/* sfa_keys.c: number the distinct keys of the entries (in ascending key tensor row) and widen them. */
GEIR_INTERNAL OrtStatus* sfa_widen_keys(OrtKernelContext* ctx, SfaPlan* plan);
GEIR_INTERNAL int64_t sfa_cpu_count(void);
GEIR_INTERNAL void sfa_plan_free(SfaPlan* plan);

#endif
