"""The sparse attention family's tests (SparseFlashAttention and its grad): schema rules, selection, paging,
NumPy and native kernels, CANN's UT cases, fusion patterns, VJPs; ``helpers`` holds what they share."""
