/* An op family's declaration of its ops: what register.c walks, knowing no family.
 *
 * Each family's C file (rotary.c, moe.c, sfa.c, ...) ends with a table of GeirOpDesc and one line
 *     GEIR_FAMILY(<file stem>, <table>);
 * _native.py finds the files that say so and generates, at build time, the translation unit that lists them
 * (geir_families, geir_family_count), so a new family is one new C file: nothing else names it.
 *
 * A descriptor gives the op's name, its input and output counts, which of them are optional (bit i: input or
 * output i), the attributes its kernel honours (compared with the schema by a test), the legal dtype
 * combinations as rows of ONNX TensorProto codes (inputs, then outputs; ONNX Runtime is offered one kernel per
 * row, in row order, so where an absent optional input leaves two rows matching, the first one wins), and the
 * kernel's create / compute / destroy. create reads the op's attributes into the family's own kernel state;
 * compute gets that state back; destroy (may be NULL) frees it. register.c checks every table when it first
 * reads them and reports, never overflows, a table it cannot hold. */
#ifndef GEIR_FAMILY_H
#define GEIR_FAMILY_H
#include "abi.h"

#define GEIR_MAX_IO 32 /* inputs or outputs of one op: the optional masks have one bit each */

/* Short names for the element types in the dtype tables. */
enum { F32 = T_FLOAT, F16 = T_FLOAT16, BF16 = T_BFLOAT16, I32 = T_INT32 };

typedef struct GeirOpDesc {
  const char* name;
  int n_in, n_out;
  uint32_t optional_in, optional_out;
  const char* attributes; /* comma-separated */
  const unsigned char* combos; /* n_combos rows of row_width codes: use GEIR_COMBOS(table) */
  int n_combos, row_width;
  int variant; /* the family's own number for the op, for a create shared by several ops */
  OrtStatus* (*create)(const struct GeirOpDesc* op, const OrtKernelInfo* info, void** state);
  OrtStatus* (*compute)(void* state, OrtKernelContext* ctx);
  void (*destroy)(void* state);
} GeirOpDesc;

typedef struct {
  const char* name;
  int n_ops;
  const GeirOpDesc* ops;
} GeirFamily;

/* The dtype table of a descriptor: a 2-D array of unsigned char, one row per combination. */
#define GEIR_COMBOS(table)                                                                            \
  .combos = &(table)[0][0], .n_combos = (int)(sizeof(table) / sizeof((table)[0])), \
  .row_width = (int)sizeof((table)[0])

/* The family's one public symbol, geir_family_<stem>; <stem> is its file's name without ".c". */
#define GEIR_FAMILY(stem, ops) \
  GEIR_INTERNAL const GeirFamily geir_family_##stem = {#stem, (int)(sizeof(ops) / sizeof((ops)[0])), ops}

/* Written by _native.py at build time: every family found. */
GEIR_INTERNAL extern const GeirFamily* const geir_families[];
GEIR_INTERNAL extern const int geir_family_count;

#endif
