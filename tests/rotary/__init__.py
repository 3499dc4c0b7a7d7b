"""The rotary family's tests (InplacePartialRotaryMul and its grad): schema rules, targets, the pairs' one
statement, NumPy and native kernels, fusion patterns, VJPs; ``helpers`` holds what they share."""
