"""The MoE family's tests (MoeTokenUnpermute and its grad): schema rules, index conventions, NumPy and native
kernels, CANN's UT cases, fusion patterns, VJPs; ``helpers`` holds what they share."""
