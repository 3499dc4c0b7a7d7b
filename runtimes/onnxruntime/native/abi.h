/* geir native custom-op kernels for ONNX Runtime: the ABI it uses, declared here (no headers).
 *
 * ONNX Runtime's C headers are not on any registry we can reach, so this file declares the few
 * ABI entries the kernels use. The C API is an append-only table of function pointers (OrtApi);
 * each entry below is used by its slot number in that table, and the OrtCustomOp struct
 * (register.c) is laid out as ONNX Runtime reads it at version 17. The oldest runtime supported
 * is ONNX Runtime 1.17 (API version 17, which added KernelContext_ParallelFor); tests prove the
 * entries on the installed runtime and on 1.17.
 *
 * The library is one shared object built from every .c file here (abi, rotary, moe, the attention plan and
 * kernels, the matrix multiply, registration); internal
 * symbols are hidden, only RegisterCustomOps and the test hooks (geir_*) are exported.
 */
#ifndef GEIR_ABI_H
#define GEIR_ABI_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;

typedef struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
} OrtApiBase;

enum { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { T_UNDEFINED = 0, T_FLOAT = 1, T_INT32 = 6, T_INT64 = 7, T_FLOAT16 = 10, T_BFLOAT16 = 16 };
enum { IO_REQUIRED = 0, IO_OPTIONAL = 1 };

#define GEIR_API_VERSION 17
/* Slot numbers in OrtApi (0-based), append-only across releases. */
enum {
  SLOT_CreateStatus = 0,
  SLOT_GetErrorMessage = 2,
  SLOT_CreateCustomOpDomain = 26,
  SLOT_CustomOpDomain_Add = 27,
  SLOT_AddCustomOpDomain = 28,
  SLOT_GetTensorMutableData = 51,
  SLOT_GetTensorElementType = 60,
  SLOT_GetDimensionsCount = 61,
  SLOT_GetDimensions = 62,
  SLOT_GetTensorTypeAndShape = 65,
  SLOT_KernelInfoGetAttribute_float = 85,
  SLOT_KernelInfoGetAttribute_int64 = 86,
  SLOT_KernelInfoGetAttribute_string = 87,
  SLOT_KernelContext_GetInputCount = 88,
  SLOT_KernelContext_GetInput = 90,
  SLOT_KernelContext_GetOutput = 91,
  SLOT_ReleaseStatus = 93,
  SLOT_ReleaseTensorTypeAndShapeInfo = 99,
  SLOT_KernelInfoGetAttributeArray_int64 = 163,
  SLOT_GetBuildInfoString = 254,
  SLOT_KernelContext_ParallelFor = 274,
};

extern const OrtApi* g_api;
#define FN(type, slot) ((type)(((void* const*)g_api)[slot]))

typedef OrtStatus* (*CreateStatusFn)(int, const char*);
typedef const char* (*GetErrorMessageFn)(const OrtStatus*);
typedef void (*ReleaseStatusFn)(OrtStatus*);
typedef OrtStatus* (*CreateCustomOpDomainFn)(const char*, OrtCustomOpDomain**);
typedef OrtStatus* (*CustomOpDomainAddFn)(OrtCustomOpDomain*, const void*);
typedef OrtStatus* (*AddCustomOpDomainFn)(OrtSessionOptions*, OrtCustomOpDomain*);
typedef OrtStatus* (*GetTensorMutableDataFn)(OrtValue*, void**);
typedef OrtStatus* (*GetTensorElementTypeFn)(const OrtTensorTypeAndShapeInfo*, int*);
typedef OrtStatus* (*GetDimensionsCountFn)(const OrtTensorTypeAndShapeInfo*, size_t*);
typedef OrtStatus* (*GetDimensionsFn)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t);
typedef OrtStatus* (*GetTensorTypeAndShapeFn)(const OrtValue*, OrtTensorTypeAndShapeInfo**);
typedef void (*ReleaseTensorTypeAndShapeInfoFn)(OrtTensorTypeAndShapeInfo*);
typedef OrtStatus* (*KernelInfoGetAttributeFloatFn)(const OrtKernelInfo*, const char*, float*);
typedef OrtStatus* (*KernelInfoGetAttributeStringFn)(const OrtKernelInfo*, const char*, char*, size_t*);
typedef OrtStatus* (*KernelInfoGetAttributeInt64Fn)(const OrtKernelInfo*, const char*, int64_t*);
typedef OrtStatus* (*KernelInfoGetAttributeArrayInt64Fn)(const OrtKernelInfo*, const char*, int64_t*, size_t*);
typedef OrtStatus* (*KernelContextGetInputCountFn)(const OrtKernelContext*, size_t*);
typedef OrtStatus* (*KernelContextGetInputFn)(const OrtKernelContext*, size_t, const OrtValue**);
typedef OrtStatus* (*KernelContextGetOutputFn)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**);
typedef OrtStatus* (*KernelContextParallelForFn)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*);
typedef const char* (*GetBuildInfoStringFn)(void);

#define GEIR_INTERNAL __attribute__((visibility("hidden")))

/* Kernel invocations, for the start-up self-test that proves a native kernel (not a fallback) ran. */
GEIR_INTERNAL extern volatile long g_calls;

typedef struct {
  const OrtValue* value;
  int type;
  size_t rank;
  int64_t dims[8];
  int64_t size;
  void* data;
} Tensor;

/* Every kernel allocation goes through geir_scratch() (abi.c), so the tests can make one fail. */
GEIR_INTERNAL void* geir_scratch(size_t bytes, int zeroed);
/* An ORT_INVALID_ARGUMENT status "<op> (geir native kernel): <fmt with a, b, c>" (ort_errorf: any arguments). */
GEIR_INTERNAL OrtStatus* ort_error(const char* op, const char* fmt, long a, long b, long c);
GEIR_INTERNAL OrtStatus* ort_errorf(const char* op, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
GEIR_INTERNAL OrtStatus* ort_out_of_memory(const char* op);
/* Input ``index`` described into ``t`` (``present`` 0 for an absent optional input); outputs likewise. */
GEIR_INTERNAL OrtStatus* ort_input(OrtKernelContext* ctx, size_t index, Tensor* t, int* present);
/* Run fn(user, i) for i < tasks on ONNX Runtime's thread pool (inline for one task). */
GEIR_INTERNAL OrtStatus* ort_parallel(OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t tasks, void* user);
GEIR_INTERNAL OrtStatus* ort_output(OrtKernelContext* ctx, size_t index, const int64_t* dims, size_t rank, Tensor* t);

#endif
