/* Registration: one OrtCustomOp per (op, dtype combination) of every family's table (family.h), laid out at
 * version 17. Nothing here names a family or an op: the families are the tables _native.py lists at build time. */
#include "family.h"

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

typedef struct {
  OrtCustomOp op; /* first member: ONNX Runtime passes &op back to us */
  const GeirOpDesc* desc;
  const unsigned char* types; /* the row of desc->combos: input types, then output types */
} GeirOp;

/* What ONNX Runtime holds per kernel: the descriptor and the family's own state. */
typedef struct {
  const GeirOpDesc* desc;
  void* state;
} Instance;

static const GeirOpDesc* desc_of(const OrtCustomOp* op) { return ((const GeirOp*)op)->desc; }
static const char* op_name(const OrtCustomOp* op) { return desc_of(op)->name; }
static const char* provider(const OrtCustomOp* op) { return "CPUExecutionProvider"; }
static int in_type(const OrtCustomOp* op, size_t i) { return ((const GeirOp*)op)->types[i]; }
static size_t in_count(const OrtCustomOp* op) { return (size_t)desc_of(op)->n_in; }
static int out_type(const OrtCustomOp* op, size_t i) { return ((const GeirOp*)op)->types[desc_of(op)->n_in + i]; }
static size_t out_count(const OrtCustomOp* op) { return (size_t)desc_of(op)->n_out; }
static int in_characteristic(const OrtCustomOp* op, size_t i) {
  return (desc_of(op)->optional_in >> i) & 1 ? IO_OPTIONAL : IO_REQUIRED;
}
static int out_characteristic(const OrtCustomOp* op, size_t i) {
  return (desc_of(op)->optional_out >> i) & 1 ? IO_OPTIONAL : IO_REQUIRED;
}
static int memory_type(const OrtCustomOp* op, size_t i) { return 0; }
static int one(const OrtCustomOp* op) { return 1; }
static int last_version(const OrtCustomOp* op) { return 2147483647; }

static OrtStatus* create_kernel_v2(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  Instance* k = (Instance*)calloc(1, sizeof(Instance));
  if (!k) return FN(CreateStatusFn, SLOT_CreateStatus)(ORT_FAIL, "out of memory");
  k->desc = desc_of(op);
  OrtStatus* st = k->desc->create ? k->desc->create(k->desc, info, &k->state) : NULL;
  if (st) {
    free(k);
    return st;
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
  Instance* k = (Instance*)kernel;
  return k->desc->compute(k->state, ctx);
}

static void compute(void* kernel, OrtKernelContext* ctx) {
  OrtStatus* st = compute_v2(kernel, ctx);
  if (st) FN(ReleaseStatusFn, SLOT_ReleaseStatus)(st);
}

static void destroy(void* kernel) {
  Instance* k = (Instance*)kernel;
  if (k && k->desc->destroy) k->desc->destroy(k->state);
  free(k);
}

/* One entry per (op, dtype combination) of every family, allocated once for the count the tables declare (they
 * live as long as the process: ONNX Runtime keeps pointers to them). More than MAX_OPS is a table in error,
 * reported, never allocated. */
#define MAX_OPS 4096
static GeirOp* g_ops;
static int g_op_count = -1; /* -1: not read yet, or refused */
static char g_error[256];  /* why the tables cannot be registered; empty when they can */

static void add_op(const GeirOpDesc* desc, const unsigned char* types) {
  GeirOp* g = &g_ops[g_op_count++];
  memset(g, 0, sizeof *g);
  g->desc = desc;
  g->types = types;
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

/* Why descriptor d of family f cannot be registered, written into g_error; 0 if it can. */
static int invalid(const GeirFamily* f, const GeirOpDesc* d) {
  const char* name = d->name ? d->name : "(unnamed)";
  const char* why = NULL;
  if (!d->name || !d->attributes) why = "has no name or no attribute list";
  else if (d->n_in < 0 || d->n_in > GEIR_MAX_IO || d->n_out < 1 || d->n_out > GEIR_MAX_IO)
    why = "has an input or output count outside 0..32 / 1..32";
  else if ((d->n_in < 32 && d->optional_in >> d->n_in) || (d->n_out < 32 && d->optional_out >> d->n_out))
    why = "marks an input or output optional that it does not have";
  else if (!d->combos || d->n_combos < 1 || d->row_width != d->n_in + d->n_out)
    why = "has no dtype table, or rows that are not one code per input and output";
  else if (!d->compute) why = "has no compute function";
  if (!why) return 0;
  snprintf(g_error, sizeof g_error, "geir native library: op %s of family %s %s", name, f->name, why);
  return 1;
}

/* Check every family's table, then lay out one entry per dtype combination. On any error nothing is registered
 * and g_error says why (RegisterCustomOps returns it; geir_op_count is -1). */
static void read_tables(void) {
  long long total = 0; /* n_ops and n_combos are ints: no overflow */
  for (int f = 0; f < geir_family_count; f++) {
    const GeirFamily* family = geir_families[f];
    if (!family->ops || family->n_ops < 0) {
      snprintf(g_error, sizeof g_error, "geir native library: family %s has no op table", family->name);
      return;
    }
    for (int i = 0; i < family->n_ops; i++) {
      if (invalid(family, &family->ops[i])) return;
      total += family->ops[i].n_combos;
    }
  }
  if (total > MAX_OPS) {
    snprintf(g_error, sizeof g_error, "geir native library: the families declare %lld (op, dtype) kernels, more "
             "than MAX_OPS = %d in register.c", total, MAX_OPS);
    return;
  }
  g_ops = (GeirOp*)calloc(total > 0 ? (size_t)total : 1, sizeof(GeirOp));
  if (!g_ops) {
    snprintf(g_error, sizeof g_error, "geir native library: out of memory for %lld kernels", total);
    return;
  }
  g_op_count = 0;
  for (int f = 0; f < geir_family_count; f++)
    for (int i = 0; i < geir_families[f]->n_ops; i++) {
      const GeirOpDesc* d = &geir_families[f]->ops[i];
      for (int c = 0; c < d->n_combos; c++) add_op(d, d->combos + (size_t)c * (size_t)d->row_width);
    }
}

/* read_tables once, whichever thread comes first; the others wait for it (sessions may be made concurrently). */
static void declare_ops(void) {
  static int state; /* 0: not read, 1: being read, 2: read */
  int expected = 0;
  if (__atomic_load_n(&state, __ATOMIC_ACQUIRE) == 2) return;
  if (__atomic_compare_exchange_n(&state, &expected, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    read_tables();
    __atomic_store_n(&state, 2, __ATOMIC_RELEASE);
    return;
  }
  while (__atomic_load_n(&state, __ATOMIC_ACQUIRE) != 2) {
  }
}

/* The entry ONNX Runtime calls from SessionOptions.register_custom_ops_library. */
OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(GEIR_API_VERSION);
  if (!api) return NULL; /* older runtime: nothing registered, the function bodies run instead */
  g_api = api;
  declare_ops();
  if (g_op_count < 0) return FN(CreateStatusFn, SLOT_CreateStatus)(ORT_FAIL, g_error);
  OrtCustomOpDomain* domain = NULL;
  OrtStatus* st = FN(CreateCustomOpDomainFn, SLOT_CreateCustomOpDomain)("ai.cann", &domain);
  for (int i = 0; !st && i < g_op_count; i++) st = FN(CustomOpDomainAddFn, SLOT_CustomOpDomain_Add)(domain, &g_ops[i].op);
  if (!st) st = FN(AddCustomOpDomainFn, SLOT_AddCustomOpDomain)(options, domain);
  return st;
}

/* The registered table, for the tests that compare it with the schemas: the number of entries (-1 when the
 * families' tables are refused: geir_registration_error says why), entry i's op name, input and output element
 * types (ONNX TensorProto codes; in_types and out_types must hold GEIR_MAX_IO ints) and optional-input mask,
 * its optional-output mask, and the comma-separated attributes its kernel honours. */
int geir_op_count(void) {
  declare_ops();
  return g_op_count;
}

const char* geir_registration_error(void) {
  declare_ops();
  return g_error[0] ? g_error : NULL;
}

const char* geir_op_attributes(int i) {
  declare_ops();
  return i < 0 || i >= g_op_count ? NULL : g_ops[i].desc->attributes;
}

int geir_op_optional_outputs(int i) {
  declare_ops();
  return i < 0 || i >= g_op_count ? -1 : (int)g_ops[i].desc->optional_out;
}

int geir_op_entry(int i, const char** name, int* in_types, int* n_in, int* out_types, int* n_out, int* optional) {
  declare_ops();
  if (i < 0 || i >= g_op_count) return 0;
  const GeirOp* g = &g_ops[i];
  *name = g->desc->name;
  *n_in = g->desc->n_in;
  *n_out = g->desc->n_out;
  *optional = (int)g->desc->optional_in;
  for (int k = 0; k < g->desc->n_in; k++) in_types[k] = g->types[k];
  for (int k = 0; k < g->desc->n_out; k++) out_types[k] = g->types[g->desc->n_in + k];
  return 1;
}
