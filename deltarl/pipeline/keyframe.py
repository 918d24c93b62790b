"""Keyframes v2: the full state as safetensors parts, written and read in one streamed pass.

A part is a standard safetensors file (docs/RUN_NAMESPACE.md, "Keyframe part file"): 8-byte
little-endian header length, a JSON header (canonical here, padded with spaces to a multiple of 8),
then each range's raw bytes in the order of the part's ``tensors`` list. An entry holding a whole
tensor has its real shape, a partial range is 1-D ``[count]``; ``__metadata__`` names the format
and repeats the ranges.

Writing streams the header and then zero-copy views of the state's own memory, hashing each
buffer (sha256 and pieces) as it goes; nothing holds a serialized copy. Reading reads each range
straight into the destination tensor's memory and checks every piece right after it lands, so
the only copy is the one into the destination.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from deltarl.codec.tensors import DTYPES, TensorSpec, flat_bits
from deltarl.errors import FormatError, IntegrityError, ObjectExists, StoreError, WriterConflict
from deltarl.pipeline.canonical import canonical_json
from deltarl.pipeline.manifest import KeyframePart, TensorRange
from deltarl.pipeline.pieces import DEFAULT_PIECE_SIZE, PieceHasher
from deltarl.storage.store import ObjectStore

PART_FORMAT = "keyframe-part/2"
#: Single writers cut parts at tensor boundaries, at most this many bytes each (bigger tensors by rows).
DEFAULT_PART_BYTES = 512 << 20
MAX_HEADER_BYTES = 64 << 20
#: Bytes per streamed buffer (write) and per read request (read).
STREAM_BYTES = 8 << 20

SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def itemsize(dtype: str) -> int:
    return DTYPES[dtype][1] // 8


def plan_parts(specs: Sequence[TensorSpec], part_bytes: int = DEFAULT_PART_BYTES) -> list[tuple[TensorRange, ...]]:
    """Cut ``specs`` (run.json order) into parts of at most ``part_bytes`` at tensor boundaries; a
    tensor larger than that is split by rows (a row larger than that by elements)."""
    if part_bytes < 1:
        raise ValueError("part_bytes must be >= 1")
    parts: list[tuple[TensorRange, ...]] = []
    current: list[TensorRange] = []
    fill = 0
    for spec in specs:
        size = itemsize(spec.dtype)
        nbytes = spec.numel * size
        if nbytes <= part_bytes:
            if current and fill + nbytes > part_bytes:
                parts.append(tuple(current))
                current, fill = [], 0
            current.append((spec.name, 0, spec.numel))
            fill += nbytes
            continue
        if current:
            parts.append(tuple(current))
            current, fill = [], 0
        row = spec.numel // spec.shape[0] if spec.shape and spec.shape[0] else spec.numel
        step = max(row, (part_bytes // size) // row * row) if row * size <= part_bytes else max(1, part_bytes // size)
        for start in range(0, spec.numel, step):
            count = min(step, spec.numel - start)
            if start + count < spec.numel:
                parts.append(((spec.name, start, count),))
            else:
                current, fill = [(spec.name, start, count)], count * size
    if current:
        parts.append(tuple(current))
    return parts


def part_header(ranges: Sequence[TensorRange], specs: Mapping[str, TensorSpec]) -> bytes:
    """The header of a part holding ``ranges``: u64 LE length, then canonical JSON padded to 8 bytes."""
    entries: dict[str, Any] = {
        "__metadata__": {
            "deltarl.format": PART_FORMAT,
            "deltarl.ranges": canonical_json([list(r) for r in ranges]).decode(),
        }
    }
    offset = 0
    for name, start, count in ranges:
        spec = specs[name]
        nbytes = count * itemsize(spec.dtype)
        shape = list(spec.shape) if (start, count) == (0, spec.numel) else [count]
        entries[name] = {"dtype": SAFETENSORS_DTYPES[spec.dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    body = canonical_json(entries)
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body


def _byte_view(name: str, value: Any, *, writable: bool = False) -> memoryview:
    return memoryview(flat_bits(name, value, writable=writable)).cast("B")  # type: ignore[arg-type]  # a buffer


def iter_part(state: Mapping[str, Any], ranges: Sequence[TensorRange], specs: Mapping[str, TensorSpec],
              chunk: int = STREAM_BYTES) -> Iterator[memoryview]:
    """The bytes of one part: its header, then zero-copy views of the state, ``chunk`` bytes at most."""
    yield memoryview(part_header(ranges, specs))
    for name, start, count in ranges:
        size = itemsize(specs[name].dtype)
        view = _byte_view(name, state[name])
        for a in range(start * size, (start + count) * size, chunk):
            yield view[a : min(a + chunk, (start + count) * size)]


def write_part(store: ObjectStore, key: str, state: Mapping[str, Any], ranges: Sequence[TensorRange],
               specs: Mapping[str, TensorSpec], *, piece_size: int = DEFAULT_PIECE_SIZE) -> KeyframePart:
    """Stream one part of ``state`` to ``key`` (``put_stream_if_absent``), hashed in the same pass."""
    return stream_part(store, key, iter_part(state, ranges, specs), ranges, piece_size=piece_size)


def stream_part(store: ObjectStore, key: str, buffers: Iterable[memoryview], ranges: Sequence[TensorRange], *,
                piece_size: int = DEFAULT_PIECE_SIZE) -> KeyframePart:
    """Upload a part's bytes (``buffers``: its header, then its ranges' data) to ``key`` with
    ``put_stream_if_absent``, hashed in the same pass, and return its ref. ``ObjectExists`` (only a
    retry of this writer's own write can meet its epoch's key) is a WriterConflict."""
    hasher = PieceHasher(piece_size)

    def hashed() -> Iterator[memoryview]:
        for buf in buffers:
            hasher.update(buf)
            yield buf

    try:
        store.put_stream_if_absent(key, hashed())
    except ObjectExists as err:
        raise WriterConflict(f"{key} already exists: another writer with this epoch is publishing this run") from err
    sha, size, pieces = hasher.finish()
    return KeyframePart(key=key, sha256=sha, size=size, piece_size=piece_size, pieces=tuple(pieces), tensors=tuple(ranges))


def _parse_header(part: KeyframePart, raw: bytes, specs: Mapping[str, TensorSpec], named_by: str) -> None:
    """Check a part's header holds exactly the ranges ``part`` records, contiguous, in order."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(f"{part.key}: keyframe part header is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise FormatError(f"{part.key}: keyframe part header is not a JSON object")
    meta = header.pop("__metadata__", None)
    ranges = part.tensors or ()
    want_meta = {"deltarl.format": PART_FORMAT, "deltarl.ranges": canonical_json([list(r) for r in ranges]).decode()}
    if meta != want_meta:
        raise FormatError(f"{part.key}: keyframe part metadata {meta!r} does not match the ranges {named_by} records")
    if set(header) != {name for name, _, _ in ranges}:
        raise FormatError(f"{part.key}: keyframe part holds tensors {sorted(header)[:5]}…, {named_by} records others")
    offset = 0
    for name, start, count in ranges:
        spec = specs[name]
        nbytes = count * itemsize(spec.dtype)
        shape = list(spec.shape) if (start, count) == (0, spec.numel) else [count]
        want = {"dtype": SAFETENSORS_DTYPES[spec.dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        if header[name] != want:
            raise FormatError(f"{part.key}: entry {name!r} is {header[name]!r}, expected {want!r} (overlapping or misplaced range)")
        offset += nbytes


def read_part_into(store: ObjectStore, part: KeyframePart, specs: Mapping[str, TensorSpec],
                   dest: Mapping[str, Any], *, named_by: str) -> None:
    """Read one v2 part straight into ``dest`` (name -> writable CPU tensor of run.json's shape),
    checking each piece as it lands; IntegrityError / FormatError name the part on any mismatch."""
    verifier = part.verifier(named_by)
    try:
        if part.size < 8:
            raise IntegrityError(f"{part.key}: truncated: {part.size} bytes cannot hold a safetensors header")
        prefix = store.get_range(part.key, 0, 8)
        verifier.update(prefix)
        (hlen,) = struct.unpack("<Q", prefix)
        if hlen > MAX_HEADER_BYTES or 8 + hlen > part.size:
            raise FormatError(f"{part.key}: header length {hlen} is beyond the part ({part.size} bytes)")
        raw = store.get_range(part.key, 8, 8 + hlen)
        verifier.update(raw)
        _parse_header(part, raw, specs, named_by)
        for name, start, count in part.tensors or ():
            size = itemsize(specs[name].dtype)
            view = _byte_view(name, dest[name], writable=True)
            for a in range(start * size, (start + count) * size, STREAM_BYTES):
                b = min(a + STREAM_BYTES, (start + count) * size)
                got = store.get_range_into(part.key, verifier.offset, view[a:b])
                if got != b - a:
                    raise IntegrityError(f"{part.key}: truncated: {verifier.offset + got} bytes, {named_by} records {part.size}")
                verifier.update(view[a:b])
        verifier.finish()
    except StoreError:
        raise
    except (IntegrityError, FormatError):
        raise
    except (ValueError, struct.error) as err:
        raise FormatError(f"{part.key}: unreadable keyframe part: {err}") from err


def part_views(part: KeyframePart, head: bytes, specs: Mapping[str, TensorSpec], dest: Mapping[str, Any],
               *, named_by: str) -> list[tuple[int, memoryview]] | None:
    """Where each byte of a part goes, for a fetch straight into ``dest``: ``(part offset, view)``
    pairs covering the part in order (a buffer for the header, then the tensor slices its ranges
    fill). ``head`` is the part's first bytes; ``None`` if they do not hold the whole header.
    The header is checked against the ranges ``part`` records (FormatError naming it)."""
    if len(head) < 8:
        raise FormatError(f"{part.key}: {len(head)} bytes cannot hold a safetensors header")
    (hlen,) = struct.unpack("<Q", head[:8])
    if hlen > MAX_HEADER_BYTES or 8 + hlen > part.size:
        raise FormatError(f"{part.key}: header length {hlen} is beyond the part ({part.size} bytes)")
    if len(head) < 8 + hlen:
        return None
    _parse_header(part, bytes(head[8 : 8 + hlen]), specs, named_by)
    views: list[tuple[int, memoryview]] = [(0, memoryview(bytearray(8 + hlen)))]
    pos = 8 + hlen
    for name, start, count in part.tensors or ():
        size = itemsize(specs[name].dtype)
        views.append((pos, _byte_view(name, dest[name], writable=True)[start * size : (start + count) * size]))
        pos += count * size
    if pos != part.size:
        raise FormatError(f"{part.key}: its ranges end at byte {pos}, {named_by} records {part.size} bytes")
    return views


def load_part_bytes(part: KeyframePart, data: Any, specs: Mapping[str, TensorSpec], dest: Mapping[str, Any],
                    *, named_by: str) -> None:
    """Copy the ranges of one part whose bytes ``data`` were already checked against ``part`` into ``dest``."""
    mv = memoryview(data).cast("B")
    if len(mv) < 8:
        raise FormatError(f"{part.key}: {len(mv)} bytes cannot hold a safetensors header")
    (hlen,) = struct.unpack("<Q", mv[:8])
    if hlen > MAX_HEADER_BYTES or 8 + hlen > len(mv):
        raise FormatError(f"{part.key}: header length {hlen} is beyond the part ({len(mv)} bytes)")
    _parse_header(part, bytes(mv[8 : 8 + hlen]), specs, named_by)
    pos = 8 + hlen
    for name, start, count in part.tensors or ():
        size = itemsize(specs[name].dtype)
        n = count * size
        _byte_view(name, dest[name], writable=True)[start * size : start * size + n] = mv[pos : pos + n]
        pos += n
    if pos != len(mv):
        raise FormatError(f"{part.key}: {len(mv) - pos} bytes past the last range")


def empty_state(specs: Sequence[TensorSpec]) -> dict[str, Any]:
    """Uninitialized CPU torch tensors of run.json's names, dtypes and shapes (to read a keyframe into)."""
    import torch

    return {s.name: torch.empty(s.shape, dtype=getattr(torch, s.dtype)) for s in specs}


__all__ = [
    "DEFAULT_PART_BYTES",
    "PART_FORMAT",
    "empty_state",
    "iter_part",
    "load_part_bytes",
    "part_header",
    "part_views",
    "plan_parts",
    "read_part_into",
    "write_part",
]


