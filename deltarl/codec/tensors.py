"""Tensor states as bit patterns: dtype codes, zero-copy bit views, tensor tables and state digests.

A *state* is a ``Mapping[str, tensor]`` whose values are torch tensors (bfloat16, float16, float32),
numpy arrays (float16, float32) or :class:`BF16` wrappers around a numpy ``uint16`` array that holds
bfloat16 bit patterns (numpy has no bfloat16; a bare ``uint16`` array is rejected, never guessed).
Every operation works on unsigned integer views of the same memory, so NaN payloads, -0.0 and
subnormals survive bit for bit. torch is imported lazily, only when a torch tensor is seen.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltarl.errors import TensorMismatch

# dtype name -> (format code, bit width, mantissa bits)
DTYPES: dict[str, tuple[int, int, int]] = {
    "bfloat16": (1, 16, 7),
    "float16": (2, 16, 10),
    "float32": (3, 32, 23),
}
DTYPE_BY_CODE: dict[int, str] = {code: name for name, (code, _, _) in DTYPES.items()}


def uint_dtype(dtype: str) -> np.dtype[Any]:
    """The unsigned integer numpy dtype holding the bit patterns of ``dtype``."""
    return np.dtype(np.uint16) if DTYPES[dtype][1] == 16 else np.dtype(np.uint32)


@dataclass(frozen=True)
class BF16:
    """Declares that a numpy ``uint16`` array holds bfloat16 bit patterns (numpy has no bfloat16)."""

    bits: np.ndarray

    def __post_init__(self) -> None:
        if not isinstance(self.bits, np.ndarray) or self.bits.dtype != np.uint16:
            raise TensorMismatch("BF16 wraps a numpy uint16 array of bfloat16 bit patterns")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor of a state."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _is_torch(value: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def dtype_of(name: str, value: object) -> str:
    """The deltarl dtype name of one state value; raises TensorMismatch if unsupported."""
    if isinstance(value, BF16):
        return "bfloat16"
    if isinstance(value, np.ndarray):
        dt = value.dtype
        if dt == np.float16:
            return "float16"
        if dt == np.float32:
            return "float32"
        if dt.name == "bfloat16" and dt.itemsize == 2:  # ml_dtypes
            return "bfloat16"
        raise TensorMismatch(
            f"tensor {name!r}: unsupported numpy dtype {dt}; use float16/float32, or wrap bfloat16 "
            "bit patterns held in a uint16 array as deltarl.codec.BF16(array)"
        )
    if _is_torch(value):
        tname = str(value.dtype).removeprefix("torch.")  # type: ignore[attr-defined]
        if tname in DTYPES:
            return tname
        raise TensorMismatch(f"tensor {name!r}: unsupported torch dtype {value.dtype}")  # type: ignore[attr-defined]
    raise TensorMismatch(
        f"tensor {name!r}: expected a torch tensor or numpy array, got {type(value).__name__}"
    )


def spec_of(name: str, value: object) -> TensorSpec:
    """The TensorSpec of one state value."""
    dtype = dtype_of(name, value)
    shape = tuple(int(d) for d in value.shape)  # type: ignore[attr-defined]
    return TensorSpec(name=name, dtype=dtype, shape=shape)


def tensor_table(state: Mapping[str, Any]) -> list[TensorSpec]:
    """The specs of all tensors of ``state``, in sorted name order."""
    return [spec_of(name, state[name]) for name in sorted(state)]


def check_compatible(state: Mapping[str, Any], table: list[TensorSpec] | tuple[TensorSpec, ...]) -> None:
    """Raise TensorMismatch unless ``state`` has exactly the names, dtypes and shapes of ``table``."""
    want = {spec.name: spec for spec in table}
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    if missing or extra:
        raise TensorMismatch(f"tensor names differ: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, spec in want.items():
        have = spec_of(name, state[name])
        if have != spec:
            raise TensorMismatch(
                f"tensor {name!r}: expected {spec.dtype}{list(spec.shape)}, found {have.dtype}{list(have.shape)}"
            )


def is_cuda(value: object) -> bool:
    """True for a torch tensor that lives on a non-CPU device."""
    return _is_torch(value) and value.device.type != "cpu"  # type: ignore[attr-defined]


def flat_bits(name: str, value: object, *, writable: bool = False) -> np.ndarray:
    """A flat zero-copy unsigned-integer view of a CPU tensor's bits (uint16 or uint32).

    Raises TensorMismatch for non-contiguous tensors (an in-place update needs the real memory)
    and for device tensors (use the torch path).
    """
    dtype = dtype_of(name, value)
    udt = uint_dtype(dtype)
    if isinstance(value, BF16):
        arr = value.bits
    elif isinstance(value, np.ndarray):
        arr = value
    else:
        torch = sys.modules["torch"]
        if value.device.type != "cpu":  # type: ignore[attr-defined]
            raise TensorMismatch(f"tensor {name!r} is on {value.device}; no CPU bit view")  # type: ignore[attr-defined]
        if not value.is_contiguous():  # type: ignore[attr-defined]
            raise TensorMismatch(f"tensor {name!r} is not contiguous")
        signed = torch.int16 if udt.itemsize == 2 else torch.int32
        arr = value.detach().view(signed).numpy()  # type: ignore[attr-defined]
    if not arr.flags.c_contiguous:
        raise TensorMismatch(f"tensor {name!r} is not C-contiguous")
    if writable and not arr.flags.writeable:
        raise TensorMismatch(f"tensor {name!r} is read-only")
    return arr.reshape(-1).view(udt)


#: State digest algorithms: ``blocks64k-v2`` (written) and ``sha256-seq-v1`` (v1 runs, still verified).
BLOCKS_V2 = "blocks64k-v2"
SEQ_V1 = "sha256-seq-v1"
DIGEST_ALGOS = (BLOCKS_V2, SEQ_V1)
DIGEST_BLOCK = 64 << 10
_DIGEST_TASK_BYTES = 64 << 20  # a multiple of DIGEST_BLOCK: work unit of the threaded digest


def state_digest(state: Mapping[str, Any], algo: str = BLOCKS_V2, *, threads: int | None = None) -> str:
    """The state digest (hex) of ``state`` by ``algo``; identical for torch and numpy holding the same bits.

    ``blocks64k-v2`` (default, see docs/FORMAT.md) hashes 64 KiB blocks on ``threads`` threads
    (default: :func:`~deltarl.codec.kernels.worker_threads`); ``sha256-seq-v1`` is the sequential digest of format v1 runs.
    """
    if algo == BLOCKS_V2:
        return state_digest_blocks(state, threads=threads)
    if algo == SEQ_V1:
        return state_digest_seq(state)
    raise ValueError(f"unknown state digest algo {algo!r} (known: {', '.join(DIGEST_ALGOS)})")


def _le_bytes(name: str, value: Any) -> memoryview:
    """A flat byte view of a CPU copy (or the tensor itself) in little-endian order."""
    if is_cuda(value):
        value = value.cpu()
    bits = flat_bits(name, value)
    if sys.byteorder != "little":
        bits = bits.astype(bits.dtype.newbyteorder("<"))
    return memoryview(bits).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def _leaves(mv: memoryview, start: int, end: int) -> bytes:
    return b"".join(hashlib.sha256(mv[i : min(i + DIGEST_BLOCK, end)]).digest() for i in range(start, end, DIGEST_BLOCK))


def state_digest_blocks(state: Mapping[str, Any], *, threads: int | None = None) -> str:
    """``blocks64k-v2``: per tensor (sorted names), tensor_hash = sha256 of the concatenated sha256s of
    its 64 KiB blocks; digest = sha256 over (u32 LE name length, name, tensor_hash). The blocks are
    hashed on a thread pool (hashlib releases the GIL), so it scales with cores."""
    from concurrent.futures import ThreadPoolExecutor

    from deltarl.codec.kernels import worker_threads

    specs = tensor_table(state)
    views = [_le_bytes(spec.name, state[spec.name]) for spec in specs]
    tasks = [(t, a, min(a + _DIGEST_TASK_BYTES, len(mv))) for t, mv in enumerate(views) for a in range(0, len(mv), _DIGEST_TASK_BYTES)]
    workers = max(1, min(threads or worker_threads(), len(tasks)))
    if workers == 1:
        parts = [_leaves(views[t], a, b) for t, a, b in tasks]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="deltarl-digest") as pool:
            parts = list(pool.map(lambda task: _leaves(views[task[0]], task[1], task[2]), tasks))
    leaves: list[list[bytes]] = [[] for _ in specs]
    for (t, _, _), leaf in zip(tasks, parts, strict=True):
        leaves[t].append(leaf)
    h = hashlib.sha256()
    for spec, tensor_leaves in zip(specs, leaves, strict=True):
        raw = spec.name.encode()
        h.update(struct.pack("<I", len(raw)) + raw + hashlib.sha256(b"".join(tensor_leaves)).digest())
    return h.hexdigest()


def state_digest_seq(state: Mapping[str, Any]) -> str:
    """``sha256-seq-v1``: sha256 hex over the state in sorted name order (format v1 runs).

    Per tensor: u32 name length, utf-8 name, u8 dtype code, u8 ndim, ndim x u64 dims, u64 byte
    count, then the raw little-endian bit patterns (see docs/FORMAT.md).
    """
    h = hashlib.sha256()
    for spec in tensor_table(state):
        value = state[spec.name]
        if is_cuda(value):
            value = value.cpu()
        bits = flat_bits(spec.name, value)
        raw = spec.name.encode()
        h.update(struct.pack("<I", len(raw)) + raw)
        h.update(struct.pack("<BB", DTYPES[spec.dtype][0], len(spec.shape)))
        h.update(struct.pack(f"<{len(spec.shape)}Q", *spec.shape))
        h.update(struct.pack("<Q", bits.nbytes))
        h.update(np.ascontiguousarray(bits.astype(bits.dtype.newbyteorder("<"), copy=False)).data)
    return h.hexdigest()
