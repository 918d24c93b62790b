"""numba kernel of the finite check: count elements whose exponent bits are all ones (NaN or Inf)."""
# mypy: ignore-errors

from __future__ import annotations

from numba import njit


@njit(cache=True, nogil=True)
def count_nonfinite(bits, mask):
    """Elements of ``bits`` (the raw integer view of a float array) with ``bits & mask == mask``."""
    n = 0
    for i in range(bits.size):
        n += (bits[i] & mask) == mask
    return n
