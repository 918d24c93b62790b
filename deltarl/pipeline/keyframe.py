"""Keyframes: the full state as safetensors parts, written and read in one streamed, hashed pass.

A part is a standard safetensors file (docs/RUN_NAMESPACE.md, "Keyframe part file"): 8-byte
little-endian header length, a JSON header (canonical here, padded with spaces so the data starts
at a multiple of 64 KiB), then each range's raw bytes in the order of the part's ``tensors`` list.
An entry holding a whole tensor has its real shape, a partial range is 1-D ``[count]``;
``__metadata__`` names the format and repeats the ranges.

A single writer cuts the state's byte stream (every tensor's bytes, sorted by name, back to back)
into parts at multiples of 64 KiB, so each part's data is whole 64 KiB blocks of that stream: the
block hashes its pieces are made of are the state digest's leaves, and the keyframe's digest is
composed from them (:func:`keyframe_digest`) without hashing the state again.

Writing streams the header and then zero-copy views of the state's own memory, hashing each
buffer as it goes; nothing holds a serialized copy. Reading reads each range straight into the
destination tensor's memory and checks every piece right after it lands, so the only copy is the
one into the destination.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from deltarl.codec.hashing import BLOCK, HASH_BYTES, state_root
from deltarl.codec.tensors import (
    DIGEST_ALGO,
    DTYPES,
    TensorSpec,
    flat_bits,
    state_digest,
    stream_offsets,
    table_bytes,
)
from deltarl.errors import FormatError, IntegrityError, ObjectExists, StoreError, WriterConflict
from deltarl.pipeline.canonical import canonical_json
from deltarl.pipeline.manifest import KeyframePart, StateDigest, TensorRange
from deltarl.pipeline.pieces import DEFAULT_PIECE_SIZE, PieceHasher
from deltarl.storage.store import ObjectStore

PART_FORMAT = "keyframe-part/3"
#: Single writers cut the state's byte stream into parts of about this many bytes (at 64 KiB multiples).
DEFAULT_PART_BYTES = 512 << 20
MAX_HEADER_BYTES = 64 << 20
#: Bytes per streamed buffer (write) and per read request (read).
STREAM_BYTES = 8 << 20

SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3",
                      "float8_e5m2": "F8_E5M2"}


def itemsize(dtype: str) -> int:
    return DTYPES[dtype][1] // 8


def plan_parts(specs: Sequence[TensorSpec], part_bytes: int = DEFAULT_PART_BYTES) -> list[tuple[TensorRange, ...]]:
    """Cut the byte stream of ``specs`` (run.json order) into parts of about ``part_bytes`` (at least
    64 KiB) at multiples of 64 KiB that fall on an element boundary, so every part's data is whole
    blocks of the stream (the last part ends where the stream does). A tensor cut by a part
    boundary is held as 1-D ranges; a tensor with no elements goes with the part where it sits."""
    if part_bytes < 1:
        raise ValueError("part_bytes must be >= 1")
    step = max(BLOCK, part_bytes // BLOCK * BLOCK)
    offsets = stream_offsets(list(specs))
    total = sum(s.numel * itemsize(s.dtype) for s in specs)
    cuts = [0]
    t = 0
    x = step
    while x < total:
        while offsets[specs[t].name] + specs[t].numel * itemsize(specs[t].dtype) <= x:
            t += 1
        if (x - offsets[specs[t].name]) % itemsize(specs[t].dtype) == 0:
            cuts.append(x)
            x += step
        else:  # mid-element (mixed widths): the next block boundary
            x += BLOCK
    cuts.append(max(total, 1))
    parts: list[list[TensorRange]] = [[] for _ in range(len(cuts) - 1)]
    k = 0
    for spec in specs:
        size = itemsize(spec.dtype)
        lo, hi = offsets[spec.name], offsets[spec.name] + spec.numel * size
        while k + 1 < len(parts) and cuts[k + 1] <= lo and (hi > lo or cuts[k + 1] < total):
            k += 1
        if hi == lo:
            parts[k].append((spec.name, 0, 0))
            continue
        j = k
        while j < len(parts) and cuts[j] < hi:
            a, b = max(lo, cuts[j]), min(hi, cuts[j + 1])
            parts[j].append((spec.name, (a - lo) // size, (b - a) // size))
            j += 1
    return [tuple(p) for p in parts]


def part_header(ranges: Sequence[TensorRange], specs: Mapping[str, TensorSpec]) -> bytes:
    """The header of a part holding ``ranges``: u64 LE length, then canonical JSON padded with spaces so
    that the header ends (and the data starts) at a multiple of 64 KiB."""
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
    body += b" " * (-(8 + len(body)) % BLOCK)
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
    ``put_stream_if_absent``, hashed in the same pass, and return its ref. Where the header fills
    whole 64 KiB blocks (a single writer pads it so), the part keeps the hashes of its data's
    blocks (``block_hashes``) for :func:`keyframe_digest`. ``ObjectExists`` (only a retry of this
    writer's own write can meet its epoch's key) is a WriterConflict."""
    hasher = PieceHasher(piece_size)
    header = [0]

    def hashed() -> Iterator[memoryview]:
        for i, buf in enumerate(buffers):
            if i == 0:
                header[0] = len(buf)
            hasher.update(buf)
            yield buf

    try:
        store.put_stream_if_absent(key, hashed())
    except ObjectExists as err:
        raise WriterConflict(f"{key} already exists: another writer with this epoch is publishing this run") from err
    root, size, pieces = hasher.finish()
    blocks = hasher.block_hashes[header[0] // BLOCK * HASH_BYTES :] if header[0] % BLOCK == 0 else None
    return KeyframePart(key=key, root=root, size=size, piece_size=piece_size, pieces=tuple(pieces), tensors=tuple(ranges),
                        block_hashes=blocks)  # fmt: skip


def keyframe_digest(specs: Sequence[TensorSpec], parts: Sequence[KeyframePart]) -> str | None:
    """The state digest composed from the block hashes ``parts`` kept while they were written (no byte
    hashed again), or ``None`` when the parts are not whole blocks of the state's stream in order
    (a sharded writer's rows, or parts read back without their block hashes)."""
    offsets = stream_offsets(list(specs))
    by_name = {s.name: s for s in specs}
    pos = 0
    for part in sorted(parts, key=lambda p: p.key):
        if part.block_hashes is None:
            return None
        for name, start, count in part.tensors:
            spec = by_name.get(name)
            if spec is None or (count and offsets[name] + start * itemsize(spec.dtype) != pos):
                return None
            pos += count * itemsize(spec.dtype)
        if pos % BLOCK and pos != sum(s.numel * itemsize(s.dtype) for s in specs):
            return None
    if pos != sum(s.numel * itemsize(s.dtype) for s in specs):
        return None
    return state_root(table_bytes(list(specs)), b"".join(p.block_hashes or b"" for p in sorted(parts, key=lambda p: p.key)))


def keyframe_state_digest(state: Mapping[str, Any], specs: Sequence[TensorSpec], parts: Sequence[KeyframePart]) -> StateDigest:
    """A keyframe's :class:`StateDigest`: composed from its parts' block hashes where they are whole
    blocks of the state's stream (a single writer's), else one pass over ``state``."""
    composed = keyframe_digest(specs, parts)
    return StateDigest(DIGEST_ALGO, composed if composed is not None else state_digest(state))


def _parse_header(part: KeyframePart, raw: bytes, specs: Mapping[str, TensorSpec], named_by: str) -> None:
    """Check a part's header holds exactly the ranges ``part`` records, contiguous, in order."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(f"{part.key}: keyframe part header is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise FormatError(f"{part.key}: keyframe part header is not a JSON object")
    meta = header.pop("__metadata__", None)
    ranges = part.tensors
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
    """Read one part straight into ``dest`` (name -> writable CPU tensor of run.json's shape),
    checking each piece as it lands; IntegrityError / FormatError name the part on any mismatch.

    The pieces that hold the header are read and checked before the header is parsed (its length
    only says how much to read first); the rest streams into the tensors, piece by piece."""
    verifier = part.verifier(named_by)
    try:
        if part.size < 8:
            raise IntegrityError(f"{part.key}: truncated: {part.size} bytes cannot hold a safetensors header")
        head = store.get_range(part.key, 0, min(part.piece_size, part.size))
        if len(head) < 8:
            raise IntegrityError(f"{part.key}: truncated: {len(head)} bytes, {named_by} records {part.size}")
        (hlen,) = struct.unpack("<Q", head[:8])
        if hlen > MAX_HEADER_BYTES or 8 + hlen > part.size:
            raise FormatError(f"{part.key}: header length {hlen} is beyond the part ({part.size} bytes)")
        head_end = min(part.size, -(-(8 + hlen) // part.piece_size) * part.piece_size)
        if head_end > len(head):
            head += store.get_range(part.key, len(head), head_end)
        if len(head) != head_end:
            raise IntegrityError(f"{part.key}: truncated: {len(head)} bytes, {named_by} records {part.size}")
        verifier.update(head)  # every piece holding the header is checked before it is parsed
        views = part_views(part, head, specs, dest, named_by=named_by)
        assert views is not None
        for off, view in views[1:]:
            a = 0
            if off < head_end:  # checked already, with the header's pieces
                a = min(len(view), head_end - off)
                view[:a] = head[off : off + a]
            while a < len(view):
                b = min(a + STREAM_BYTES, len(view))
                got = store.get_range_into(part.key, off + a, view[a:b])
                if got != b - a:
                    raise IntegrityError(f"{part.key}: truncated: {off + a + got} bytes, {named_by} records {part.size}")
                verifier.update(view[a:b])
                a = b
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
    for name, start, count in part.tensors:
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
    for name, start, count in part.tensors:
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
    "keyframe_digest",
    "keyframe_state_digest",
    "load_part_bytes",
    "part_header",
    "part_views",
    "plan_parts",
    "read_part_into",
    "write_part",
]


