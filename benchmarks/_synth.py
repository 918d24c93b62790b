"""Synthetic full-size BF16 states for the pause and GPU benchmarks: realistic weight magnitudes,
and next versions with ~1% of elements moved by +-1-2 ulp (built in place, no FP32 master)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

QWEN3_1_7B_ELEMENTS = 1_720_574_976  # Qwen3-1.7B with tied embeddings: 1.72e9 BF16 elements
_BLOCK = 1 << 24


def shapes_for(elements: int, tensors: int) -> dict[str, tuple[int, int]]:
    """``tensors`` 2-D tensors of 2048 columns holding ~``elements`` in all (Qwen3-1.7B's hidden size)."""
    cols = 2048
    rows = max(1, elements // (tensors * cols))
    return {f"model.layers.{i}.weight": (rows, cols) for i in range(tensors)}


def weights(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """BF16 bit patterns of weights with |w| in [2^-7, 2^-3) and random signs (uint16)."""
    rng = np.random.default_rng(seed)
    out = np.empty(int(np.prod(shape)), dtype=np.uint16)
    for a in range(0, out.size, _BLOCK):
        raw = rng.integers(0, 1 << 16, size=min(_BLOCK, out.size - a), dtype=np.uint16)
        exp = (np.uint16(120) + ((raw >> np.uint16(7)) & np.uint16(3))) << np.uint16(7)
        out[a : a + raw.size] = (raw & np.uint16(0x807F)) | exp
    return out.reshape(shape)


def step_in_place(bits: np.ndarray, fraction: float, seed: int) -> int:
    """Move ~``fraction`` of the elements by +-1 or +-2 ulp, in place; return how many moved."""
    rng = np.random.default_rng(seed)
    flat = bits.reshape(-1)
    k = int(rng.binomial(flat.size, fraction))
    pos = np.unique(rng.integers(0, flat.size, size=k, dtype=np.int64))
    step = rng.choice(np.array([-2, -1, 1, 2], dtype=np.int16), size=pos.size)
    flat[pos] = (flat[pos].view(np.int16) + step).view(np.uint16)
    return int(pos.size)


def vm_hwm() -> int:
    """Peak resident set of this process in bytes (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs 5); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def load() -> list[float]:
    """The 1/5/15-minute load averages (the machine is shared: every number carries them)."""
    return [round(x, 2) for x in os.getloadavg()]


def best(fn: Any, repeat: int) -> tuple[float, list[float], float]:
    """Best and all wall times of ``fn()``, and the least process CPU time (all threads) of a run."""
    import time

    times, cpu = [], []
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return min(times), times, min(cpu)
