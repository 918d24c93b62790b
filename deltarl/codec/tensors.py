"""Tensor states as bit patterns: dtype codes, zero-copy bit views, tensor tables and state digests.

A *state* is a ``Mapping[str, tensor]`` whose values are torch tensors (bfloat16, float16, float32),
numpy arrays (float16, float32) or :class:`BF16` wrappers around a numpy ``uint16`` array that holds
bfloat16 bit patterns (numpy has no bfloat16; a bare ``uint16`` array is rejected, never guessed).
Every operation works on unsigned integer views of the same memory, so NaN payloads, -0.0 and
subnormals survive bit for bit. torch is imported lazily, only when a torch tensor is seen.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltarl.codec.hashing import BLOCK, leaves, state_root
from deltarl.errors import TensorMismatch

# dtype name -> (format code, bit width, mantissa bits)
DTYPES: dict[str, tuple[int, int, int]] = {
    "bfloat16": (1, 16, 7),
    "float16": (2, 16, 10),
    "float32": (3, 32, 23),
    "float8_e4m3fn": (4, 8, 3),  # FP8 E4M3 (no infinities; NaN is S.1111.111), as torch names it
    "float8_e5m2": (5, 8, 2),
}
DTYPE_BY_CODE: dict[int, str] = {code: name for name, (code, _, _) in DTYPES.items()}


def uint_dtype(dtype: str) -> np.dtype[Any]:
    """The unsigned integer numpy dtype holding the bit patterns of ``dtype``."""
    return UINT_BY_SIZE[DTYPES[dtype][1] // 8]


#: The unsigned integer numpy dtype of each element size in bytes.
UINT_BY_SIZE: dict[int, np.dtype[Any]] = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


def signed_torch_dtype(nbytes: int) -> Any:
    """The signed torch integer dtype of an element size in bytes (torch views bits as signed)."""
    torch = sys.modules["torch"]
    return {1: torch.int8, 2: torch.int16, 4: torch.int32}[nbytes]


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
        if dt.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):  # ml_dtypes
            return dt.name
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
        if value.device.type != "cpu":  # type: ignore[attr-defined]
            raise TensorMismatch(f"tensor {name!r} is on {value.device}; no CPU bit view")  # type: ignore[attr-defined]
        if not value.is_contiguous():  # type: ignore[attr-defined]
            raise TensorMismatch(f"tensor {name!r} is not contiguous")
        arr = value.detach().view(signed_torch_dtype(udt.itemsize)).numpy()  # type: ignore[attr-defined]
    if not arr.flags.c_contiguous:
        raise TensorMismatch(f"tensor {name!r} is not C-contiguous")
    if writable and not arr.flags.writeable:
        raise TensorMismatch(f"tensor {name!r} is read-only")
    return arr.reshape(-1).view(udt)


#: The state digest algorithm of format 3 (docs/FORMAT.md, "State digest").
DIGEST_ALGO = "blake3-stream64k"
DIGEST_ALGOS = (DIGEST_ALGO,)
DIGEST_BLOCK = BLOCK
_DIGEST_TASK_BYTES = 64 << 20  # a multiple of DIGEST_BLOCK: work unit of the threaded digest


def table_bytes(specs: list[TensorSpec] | tuple[TensorSpec, ...]) -> bytes:
    """The tensor table as the state digest hashes it: u32 count, then per tensor (sorted names)
    u32 name length, UTF-8 name, u8 dtype code, u8 ndim, ndim x u64 shape (little-endian)."""
    out = [struct.pack("<I", len(specs))]
    for spec in specs:
        raw = spec.name.encode()
        out.append(struct.pack(f"<I{len(raw)}sBB{len(spec.shape)}Q", len(raw), raw, DTYPES[spec.dtype][0], len(spec.shape), *spec.shape))
    return b"".join(out)


def stream_offsets(specs: list[TensorSpec] | tuple[TensorSpec, ...]) -> dict[str, int]:
    """Where each tensor's bytes start in the state's byte stream (tensors in ``specs`` order)."""
    out, pos = {}, 0
    for spec in specs:
        out[spec.name] = pos
        pos += spec.numel * DTYPES[spec.dtype][1] // 8
    return out


def state_digest(state: Mapping[str, Any], algo: str = DIGEST_ALGO, *, threads: int | None = None) -> str:
    """The state digest (hex) of ``state``; identical for torch and numpy holding the same bits.

    ``blake3-stream64k`` (docs/FORMAT.md): the BLAKE3 of each 64 KiB block of the state's byte
    stream (every tensor's raw little-endian bytes, sorted by name, back to back), composed with the
    tensor table. The blocks are hashed on ``threads`` threads (default:
    :func:`~deltarl.codec.kernels.worker_threads`).
    """
    if algo != DIGEST_ALGO:
        raise ValueError(f"unknown state digest algo {algo!r} (known: {', '.join(DIGEST_ALGOS)})")
    specs = tensor_table(state)
    return state_root(table_bytes(specs), stream_leaves([_le_bytes(s.name, state[s.name]) for s in specs], threads=threads))


def _le_bytes(name: str, value: Any) -> memoryview:
    """A flat byte view of a CPU copy (or the tensor itself) in little-endian order."""
    if is_cuda(value):
        value = value.cpu()
    bits = flat_bits(name, value)
    if sys.byteorder != "little":
        bits = bits.astype(bits.dtype.newbyteorder("<"))
    return memoryview(bits).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def stream_leaves(views: list[memoryview], *, threads: int | None = None) -> bytes:
    """The block hashes of the concatenation of ``views`` (64 KiB blocks across view boundaries).

    Blocks wholly inside one view are hashed in place, on a thread pool; only a block that spans
    two views is copied together first (at most 64 KiB per view boundary)."""
    from concurrent.futures import ThreadPoolExecutor

    from deltarl.codec.kernels import worker_threads

    tasks: list[Any] = []  # (view, start, end) of whole blocks, or bytes of one block spanning views
    carry = bytearray()
    for mv in views:
        pos = 0
        if carry:
            take = min(BLOCK - len(carry), len(mv))
            carry += mv[:take]
            pos = take
            if len(carry) < BLOCK:
                continue
            tasks.append(bytes(carry))
            carry = bytearray()
        whole_end = pos + (len(mv) - pos) // BLOCK * BLOCK
        tasks.extend((mv, a, min(a + _DIGEST_TASK_BYTES, whole_end)) for a in range(pos, whole_end, _DIGEST_TASK_BYTES))
        carry += mv[whole_end:]
    if carry:
        tasks.append(bytes(carry))

    def run(task: Any) -> bytes:
        return leaves(task) if isinstance(task, bytes) else leaves(task[0][task[1] : task[2]])

    workers = max(1, min(threads or worker_threads(), len(tasks)))
    if workers == 1:
        return b"".join(run(t) for t in tasks)
    with ThreadPoolExecutor(workers, thread_name_prefix="deltarl-digest") as pool:
        return b"".join(pool.map(run, tasks))
