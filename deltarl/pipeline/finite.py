"""The finite-values check every publish runs: one NaN or Inf in a published state poisons every actor.

A float is NaN or Inf exactly when its exponent bits are all ones, so the check reads each floating
tensor once as raw integers (a numba loop, no temporaries) and counts those elements. Without numba
(``DELTARL_NO_NUMBA=1``), or for a dtype it does not map, one float32/float64 sum decides (a NaN or
Inf anywhere makes the sum non-finite) and only a non-finite sum pays for an exact count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from deltarl.errors import NonFiniteTensor
from deltarl.pipeline.kernels import numba_enabled

# raw-bits dtype and exponent mask of each float dtype (by itemsize and numpy kind)
_MASKS = {"bfloat16": (np.uint16, 0x7F80), "float16": (np.uint16, 0x7C00),
          "float32": (np.uint32, 0x7F800000), "float64": (np.uint64, 0x7FF0000000000000)}


def _count_bits(bits: np.ndarray, mask: int) -> int:
    from deltarl.pipeline._numba_finite import count_nonfinite

    return int(count_nonfinite(bits.reshape(-1), bits.dtype.type(mask)))


def _torch_nonfinite(t: Any) -> int:
    import torch

    if not t.is_floating_point() or t.numel() == 0:
        return 0
    spec = _MASKS.get(str(t.dtype).removeprefix("torch."))
    if spec is not None and numba_enabled() and t.device.type == "cpu" and t.is_contiguous():
        int_dtype = {np.uint16: torch.int16, np.uint32: torch.int32, np.uint64: torch.int64}[spec[0]]
        return _count_bits(t.view(int_dtype).numpy().view(spec[0]), spec[1])
    if bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return 0
    return int((~torch.isfinite(t)).sum())


def _numpy_nonfinite(a: np.ndarray) -> int:
    if a.dtype.kind != "f" or a.size == 0:
        return 0
    spec = _MASKS.get(a.dtype.name)
    if spec is not None and numba_enabled():
        return _count_bits(np.ascontiguousarray(a).view(spec[0]), spec[1])
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(a.sum(dtype=np.float64)):
            return 0
    return int(a.size - np.count_nonzero(np.isfinite(a)))


def check_finite(state_dict: Mapping[str, Any]) -> None:
    """Raise :class:`~deltarl.errors.NonFiniteTensor` naming the first floating tensor that holds NaN
    or Inf (torch tensors and numpy arrays; other values are not checked)."""
    for name, value in state_dict.items():
        if isinstance(value, np.ndarray):
            bad = _numpy_nonfinite(value)
        elif hasattr(value, "is_floating_point") and hasattr(value, "numel"):
            bad = _torch_nonfinite(value)
        else:
            continue
        if bad:
            raise NonFiniteTensor(f"tensor {name!r} holds {bad} NaN/Inf values of {_numel(value)}; "
                                  "refusing to publish it (pass allow_nonfinite=True to publish anyway)")


def _numel(value: Any) -> int:
    return int(value.size) if isinstance(value, np.ndarray) else int(value.numel())
