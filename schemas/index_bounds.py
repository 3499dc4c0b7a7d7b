"""The range check the data rules run first on index arrays (MU-D1 family, MP-D1, SA-D3): one array operation.

A call on small shapes pays for each NumPy operation, not for the data, so "every value in [0, n)" is asked as
"the largest value read as unsigned is below n": a negative value wraps to a huge unsigned one, so one maximum
covers both bounds. The ufunc is called directly (an ndarray method adds a Python frame, as much as the work on a
few values).
"""

from __future__ import annotations

import numpy as np

__all__ = ["largest_unsigned"]


def largest_unsigned(values: np.ndarray) -> int:
    """The largest of integer ``values`` read as unsigned of the same width (a negative one counts as huge); 0 for
    an empty array."""
    return int(np.maximum.reduce(values.view(f"u{values.dtype.itemsize}"), axis=None, initial=0))
