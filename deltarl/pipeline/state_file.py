"""A whole state written as one safetensors file: the same bytes for the same version, whoever writes it.

``deltarl replay --out`` and ``deltarl follow --out`` (and :meth:`Follower.save`) write through
:func:`write_state_file`, so a version's file does not depend on the command, the process or the
run of the program: the header is canonical JSON (keys sorted, no spaces) padded with spaces to a
multiple of 8 bytes, and the tensors follow in one fixed order (wider dtypes first, then by name,
so every tensor starts aligned to its element size), each the raw little-endian bytes of its
values. The file is a standard safetensors file (any safetensors reader loads it).

The file is written beside its destination under a temporary name, fsynced, and renamed over it,
so a reader never sees half a file; it is created like any file the user writes: mode 0666 less
the process umask.
"""

from __future__ import annotations

import os
import struct
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deltarl.codec.tensors import dtype_of, flat_bits
from deltarl.pipeline.canonical import canonical_json
from deltarl.pipeline.keyframe import SAFETENSORS_DTYPES, itemsize


def state_file_header(state: Mapping[str, Any], metadata: Mapping[str, str]) -> tuple[bytes, list[str]]:
    """The header (u64 LE length, then the padded canonical JSON) and the order the tensors follow it."""
    order = sorted(state, key=lambda name: (-itemsize(dtype_of(name, state[name])), name))
    entries: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        dtype = dtype_of(name, state[name])
        shape = [int(d) for d in state[name].shape]
        nbytes = itemsize(dtype)
        for d in shape:
            nbytes *= d
        entries[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    body = canonical_json(entries)
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body, order


def write_state_file(path: str | os.PathLike[str], state: Mapping[str, Any], metadata: Mapping[str, str]) -> None:
    """Write ``state`` (CPU tensors or arrays of bfloat16, float16, float32) and ``metadata`` (string
    to string) to ``path`` as a safetensors file, atomically; see the module docstring.

    Args:
        path: the file to write (its folder must exist); an existing file is replaced.
        state: ``{name: tensor}``; a non-contiguous tensor is copied contiguous first.
        metadata: the ``__metadata__`` of the file (e.g. run, version, version id).
    """
    out = Path(path)
    header, order = state_file_header(state, metadata)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        _write_all(fd, memoryview(header))
        for name in order:
            value = state[name]
            if hasattr(value, "is_contiguous") and not value.is_contiguous():
                value = value.contiguous()
            _write_all(fd, memoryview(flat_bits(name, value)).cast("B"))  # type: ignore[arg-type]  # a buffer
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, out)
    finally:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


__all__ = ["state_file_header", "write_state_file"]
