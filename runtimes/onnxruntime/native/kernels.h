/* The kernels' entry points, called by register.c. */
#ifndef GEIR_KERNELS_H
#define GEIR_KERNELS_H
#include "abi.h"

/* rotary.c: attributes read once when ONNX Runtime creates the kernel */
typedef struct {
  int64_t mode, start, end, has_slice;
  int grad;
} RotaryKernel;

GEIR_INTERNAL OrtStatus* rotary_compute(void* kernel, OrtKernelContext* ctx);
/* exported for the test that compares the tables with geir.schemas.rotary.rotation */
int geir_rotary_tables(int64_t mode, int64_t L, int* partner, float* sign);
/* moe.c */
GEIR_INTERNAL OrtStatus* moe_forward_compute(void* kernel, OrtKernelContext* ctx);
GEIR_INTERNAL OrtStatus* moe_grad_compute(void* kernel, OrtKernelContext* ctx);

#endif
