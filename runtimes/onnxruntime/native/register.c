/* Registration: one OrtCustomOp per (op, dtype combination), laid out at version 17. */
#include "kernels.h"
#include "sfa.h"

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

enum { K_ROPE, K_ROPE_GRAD, K_MOE, K_MOE_GRAD, K_SFA, K_SFA_GRAD };

typedef struct {
  OrtCustomOp op; /* first member: ONNX Runtime passes &op back to us */
  int kind, n_in, n_out, in_types[12], out_types[5], optional_in, optional_out;
} GeirOp;

static const char* op_name(const OrtCustomOp* op) {
  static const char* names[] = {"InplacePartialRotaryMul", "InplacePartialRotaryMulGrad", "MoeTokenUnpermute",
                                "MoeTokenUnpermuteGrad", "SparseFlashAttention", "SparseFlashAttentionGrad"};
  return names[((const GeirOp*)op)->kind];
}
/* The attributes each kind's kernel honours, compared with the schemas' by a test, so an attribute added
 * to a schema and forgotten here fails that test instead of being ignored silently. MoE's padded_mode is
 * honoured by refusal: the rules reject True before any session exists, so only False reaches a kernel;
 * restore_shape is ignored by the contract (spec 3, MU-S3). The attention kernels read scale_value,
 * sparse_block_size, the layouts, sparse_mode and return_softmax_lse; pre_tokens, next_tokens,
 * attention_mode and deterministic do not change the contract's semantics (spec 4.3; the kernels are
 * always deterministic). */
static const char* const kind_attributes[] = {
    "rotary_mode,partial_slice", "rotary_mode,partial_slice", "padded_mode,restore_shape", "padded_mode,restore_shape",
    "scale_value,sparse_block_size,layout_query,layout_kv,sparse_mode,pre_tokens,next_tokens,attention_mode,"
    "return_softmax_lse",
    "scale_value,sparse_block_size,layout,sparse_mode,pre_tokens,next_tokens,deterministic"};

static const char* provider(const OrtCustomOp* op) { return "CPUExecutionProvider"; }
static int in_type(const OrtCustomOp* op, size_t i) { return ((const GeirOp*)op)->in_types[i]; }
static size_t in_count(const OrtCustomOp* op) { return (size_t)((const GeirOp*)op)->n_in; }
static int out_type(const OrtCustomOp* op, size_t i) { return ((const GeirOp*)op)->out_types[i]; }
static size_t out_count(const OrtCustomOp* op) { return (size_t)((const GeirOp*)op)->n_out; }
static int in_characteristic(const OrtCustomOp* op, size_t i) {
  return (((const GeirOp*)op)->optional_in >> i) & 1 ? IO_OPTIONAL : IO_REQUIRED;
}
static int out_characteristic(const OrtCustomOp* op, size_t i) {
  return (((const GeirOp*)op)->optional_out >> i) & 1 ? IO_OPTIONAL : IO_REQUIRED;
}
static int memory_type(const OrtCustomOp* op, size_t i) { return 0; }
static int one(const OrtCustomOp* op) { return 1; }
static int last_version(const OrtCustomOp* op) { return 2147483647; }

typedef struct {
  int kind;
  RotaryKernel rotary;
  SfaKernel attention;
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
    if (n != 0 && n != 2) { free(k); return ort_error(op_name(op), "partial_slice has %ld elements", (long)n, 0, 0); }
    k->rotary.has_slice = n == 2;
    k->rotary.start = slice[0];
    k->rotary.end = slice[1];
    k->rotary.grad = k->kind == K_ROPE_GRAD;
  }
  if (k->kind == K_SFA || k->kind == K_SFA_GRAD) {
    OrtStatus* st = sfa_read_attributes(info, k->kind == K_SFA_GRAD, &k->attention);
    if (st) {
      free(k);
      return st;
    }
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
  switch (k->kind) {
    case K_ROPE:
    case K_ROPE_GRAD:
      return rotary_compute(&k->rotary, ctx);
    case K_MOE:
      return moe_forward_compute(k, ctx);
    case K_MOE_GRAD:
      return moe_grad_compute(k, ctx);
    case K_SFA:
      return sfa_forward_compute(&k->attention, ctx);
    default:
      return sfa_grad_compute(&k->attention, ctx);
  }
}

static void compute(void* kernel, OrtKernelContext* ctx) {
  OrtStatus* st = compute_v2(kernel, ctx);
  if (st) FN(ReleaseStatusFn, SLOT_ReleaseStatus)(st);
}

static void destroy(void* kernel) { free(kernel); }

#define MAX_OPS 40
static GeirOp g_ops[MAX_OPS];
static int g_op_count;

static void add_op(int kind, int n_in, const int* in, int n_out, const int* out, int optional_in, int optional_out) {
  GeirOp* g = &g_ops[g_op_count++];
  memset(g, 0, sizeof *g);
  g->kind = kind;
  g->n_in = n_in;
  g->n_out = n_out;
  memcpy(g->in_types, in, (size_t)n_in * sizeof(int));
  memcpy(g->out_types, out, (size_t)n_out * sizeof(int));
  g->optional_in = optional_in;
  g->optional_out = optional_out;
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
      add_op(K_ROPE_GRAD, 3, grad_in, 1, out1, 0, 0);
      if (c == x || c == T_FLOAT) add_op(K_ROPE, 3, grad_in, 1, out1, 0, 0);
    }
    /* within one token dtype, probs dtype == token dtype first: the variant matched when probs is absent */
    for (int b = -1; b < 3; b++) {
      int p = b < 0 ? x : floats[b];
      if (b >= 0 && p == x) continue;
      int fwd_in[3] = {x, T_INT32, p}, fwd_out[1] = {x};
      add_op(K_MOE, 3, fwd_in, 1, fwd_out, 1 << 2, 0);
      int grad_in[4] = {x, x, T_INT32, p}, grad_out[2] = {x, p};
      add_op(K_MOE_GRAD, 4, grad_in, 2, grad_out, (1 << 0) | (1 << 3), 0);
    }
  }
  for (int a = 1; a < 3; a++) { /* attention: all floating tensors float16, or all bfloat16 */
    int h = floats[a], i32 = T_INT32, f = T_FLOAT;
    int fwd_in[10] = {h, h, h, i32, i32, i32, i32, h, h, f}, fwd_out[3] = {h, f, f};
    add_op(K_SFA, 10, fwd_in, 3, fwd_out, 0x3f0, 0);
    int grad_in[12] = {h, h, i32, h, h, f, f, h, i32, i32, h, h}, grad_out[5] = {h, h, h, h, h};
    add_op(K_SFA_GRAD, 12, grad_in, 5, grad_out, 0xf80, 0x1c);
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

/* The registered table, for the test that compares it with the schemas' dtype combinations:
 * entry i's op name, input and output element types (ONNX TensorProto codes) and optional-input mask, and
 * (geir_op_attributes) the comma-separated attributes its kernel honours. */
int geir_op_count(void) {
  declare_ops();
  return g_op_count;
}

const char* geir_op_attributes(int i) {
  declare_ops();
  return i < 0 || i >= g_op_count ? NULL : kind_attributes[g_ops[i].kind];
}

int geir_op_entry(int i, const char** name, int* in_types, int* n_in, int* out_types, int* n_out, int* optional) {
  declare_ops();
  if (i < 0 || i >= g_op_count) return 0;
  const GeirOp* g = &g_ops[i];
  *name = op_name(&g->op);
  *n_in = g->n_in;
  *n_out = g->n_out;
  *optional = g->optional_in;
  memcpy(in_types, g->in_types, (size_t)g->n_in * sizeof(int));
  memcpy(out_types, g->out_types, (size_t)g->n_out * sizeof(int));
  return 1;
}
