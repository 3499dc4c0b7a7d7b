/* geir native library: the OrtApi table, tensor access, errors, scratch allocation, test hooks. */
#include <stdarg.h>

#include "abi.h"

const OrtApi* g_api GEIR_INTERNAL;
volatile long g_calls;
long geir_native_calls(void) { return g_calls; }

/* Every kernel allocation goes through geir_scratch(), so the tests can make the n-th next one fail
 * (geir_fail_allocation(n)) and prove that the failure reaches the caller as an error. */
static long g_fail_in = -1;
void geir_fail_allocation(long n) { __atomic_store_n(&g_fail_in, n, __ATOMIC_SEQ_CST); }
void* geir_scratch(size_t bytes, int zeroed) {
  if (__atomic_load_n(&g_fail_in, __ATOMIC_SEQ_CST) >= 0 && __atomic_fetch_sub(&g_fail_in, 1, __ATOMIC_SEQ_CST) == 0)
    return NULL;
  return zeroed ? calloc(bytes, 1) : malloc(bytes);
}

OrtStatus* ort_errorf(const char* op, const char* fmt, ...) {
  char detail[480], msg[600];
  va_list args;
  va_start(args, fmt);
  vsnprintf(detail, sizeof detail, fmt, args);
  va_end(args);
  snprintf(msg, sizeof msg, "%s (geir native kernel): %s", op, detail);
  return FN(CreateStatusFn, SLOT_CreateStatus)(ORT_INVALID_ARGUMENT, msg);
}

OrtStatus* ort_error(const char* op, const char* fmt, long a, long b, long c) { return ort_errorf(op, fmt, a, b, c); }

OrtStatus* ort_out_of_memory(const char* op) {
  char msg[200];
  snprintf(msg, sizeof msg, "%s (geir native kernel): out of memory for a scratch buffer", op);
  return FN(CreateStatusFn, SLOT_CreateStatus)(ORT_FAIL, msg);
}

static OrtStatus* ort_describe(const OrtValue* value, Tensor* t) {
  OrtTensorTypeAndShapeInfo* info;
  OrtStatus* st = FN(GetTensorTypeAndShapeFn, SLOT_GetTensorTypeAndShape)(value, &info);
  if (st) return st;
  size_t rank = 0;
  if (!st) st = FN(GetTensorElementTypeFn, SLOT_GetTensorElementType)(info, &t->type);
  if (!st) st = FN(GetDimensionsCountFn, SLOT_GetDimensionsCount)(info, &rank);
  if (!st && rank > 8) st = FN(CreateStatusFn, SLOT_CreateStatus)(ORT_INVALID_ARGUMENT, "rank above 8");
  if (!st) st = FN(GetDimensionsFn, SLOT_GetDimensions)(info, t->dims, rank);
  FN(ReleaseTensorTypeAndShapeInfoFn, SLOT_ReleaseTensorTypeAndShapeInfo)(info);
  if (st) return st;
  t->rank = rank;
  t->size = 1;
  for (size_t k = 0; k < rank; k++) t->size *= t->dims[k];
  t->value = value;
  return FN(GetTensorMutableDataFn, SLOT_GetTensorMutableData)((OrtValue*)value, &t->data);
}

OrtStatus* ort_input(OrtKernelContext* ctx, size_t index, Tensor* t, int* present) {
  size_t count = 0;
  OrtStatus* st = FN(KernelContextGetInputCountFn, SLOT_KernelContext_GetInputCount)(ctx, &count);
  if (st) return st;
  const OrtValue* value = NULL;
  if (index < count) st = FN(KernelContextGetInputFn, SLOT_KernelContext_GetInput)(ctx, index, &value);
  if (st) return st;
  *present = value != NULL;
  return value ? ort_describe(value, t) : NULL;
}

OrtStatus* ort_output(OrtKernelContext* ctx, size_t index, const int64_t* dims, size_t rank, Tensor* t) {
  OrtValue* value = NULL;
  OrtStatus* st = FN(KernelContextGetOutputFn, SLOT_KernelContext_GetOutput)(ctx, index, dims, rank, &value);
  if (!st && !value) st = FN(CreateStatusFn, SLOT_CreateStatus)(ORT_INVALID_ARGUMENT, "an output the kernel writes is absent");
  return st ? st : ort_describe(value, t);
}

OrtStatus* ort_parallel(OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t tasks, void* user) {
  if (tasks == 1) fn(user, 0);
  if (tasks <= 1) return NULL;
  return FN(KernelContextParallelForFn, SLOT_KernelContext_ParallelFor)(ctx, fn, tasks, 0, user);
}

/* ABI probe for the tests: entries whose effect can be observed without a session. */
int geir_probe_abi(char* out, size_t size) {
  const OrtApi* api = g_api;
  if (!api) return -1;
  OrtStatus* st = FN(CreateStatusFn, SLOT_CreateStatus)(ORT_INVALID_ARGUMENT, "geir probe");
  const char* message = FN(GetErrorMessageFn, SLOT_GetErrorMessage)(st);
  int same = strcmp(message, "geir probe") == 0;
  FN(ReleaseStatusFn, SLOT_ReleaseStatus)(st);
  snprintf(out, size, "%s", FN(GetBuildInfoStringFn, SLOT_GetBuildInfoString)());
  return same;
}
