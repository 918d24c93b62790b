"""Chunk codecs: how the changed elements of one (tensor, element range) become bytes and back.

Every codec maps ``(old bits, new bits, changed positions)`` of one chunk to a payload, and a
payload plus the old bits back to ``(positions, new bits)``. Positions are relative to the chunk
start, sorted, unique. Differences are taken on the unsigned bit patterns modulo 2**bits, zigzag
mapped, so they are exact for every value (NaN payloads, -0.0, inf, subnormals, sign flips).

Codec ids (the byte in the chunk table) and payload layouts are specified in docs/FORMAT.md.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import zstandard

from deltarl.codec import bitio
from deltarl.errors import FormatError

ESCAPE_BYTE = 255
ZSTD_LEVEL = 3


@dataclass(frozen=True)
class Decoded:
    """The changed elements of one chunk: positions relative to the chunk start, and new bit patterns."""

    positions: np.ndarray  # int64, sorted, unique; a fresh array the caller may modify
    values: np.ndarray  # uint16 / uint32
    old_values: np.ndarray | None = None  # old bits at ``positions``, when the decoder read them anyway


def zigzag(diff: np.ndarray) -> np.ndarray:
    """Map wrapped unsigned differences to zigzag codes of the same width (small |d| -> small code)."""
    top = diff.dtype.itemsize * 8 - 1
    neg = (diff >> top) * diff.dtype.type(np.iinfo(diff.dtype).max)
    return (diff << 1) ^ neg


def unzigzag(code: np.ndarray) -> np.ndarray:
    """Inverse of :func:`zigzag`."""
    neg = (code & 1) * code.dtype.type(np.iinfo(code.dtype).max)
    return (code >> 1) ^ neg


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def pack_streams(params: bytes, streams: list[bytes]) -> bytes:
    """Codec params, then one LEB128 varint length per stream, then the streams."""
    return params + b"".join(_varint(len(s)) for s in streams) + b"".join(streams)


def unpack_streams(
    payload: memoryview, params_fmt: str, nstreams: int
) -> tuple[tuple[int, ...], list[memoryview]]:
    fixed = struct.calcsize(params_fmt)
    if len(payload) < fixed + nstreams:
        raise FormatError(f"chunk payload of {len(payload)} bytes is shorter than its header")
    params = struct.unpack_from(params_fmt, payload, 0)
    lengths, off = [], fixed
    for _ in range(nstreams):
        n = shift = 0
        while True:
            if off >= len(payload) or shift > 56:
                raise FormatError("chunk stream lengths are truncated or too long")
            byte = payload[off]
            off += 1
            n |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        lengths.append(n)
    if off + sum(lengths) != len(payload):
        raise FormatError("chunk stream lengths do not add up to the payload length")
    streams = []
    for n in lengths:
        streams.append(payload[off : off + n])
        off += n
    return params, streams


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(data)


def _unzstd(data: memoryview, size: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(data)
        if declared != size:
            raise FormatError(f"zstd frame declares {declared} bytes, expected {size}")
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    except zstandard.ZstdError as err:
        raise FormatError(f"corrupt zstd stream: {err}") from err
    if len(out) != size:
        raise FormatError(f"zstd stream decoded to {len(out)} bytes, expected {size}")
    return out


def _raw_values(data: memoryview, count: int, udt: np.dtype) -> np.ndarray:
    if len(data) != count * udt.itemsize:
        raise FormatError(f"raw value stream has {len(data)} bytes, expected {count * udt.itemsize}")
    return np.frombuffer(data, dtype=udt.newbyteorder("<")).astype(udt)


def _check_positions(pos: np.ndarray, count: int) -> np.ndarray:
    if pos.size and (int(pos[-1]) >= count):
        raise FormatError(f"changed position {int(pos[-1])} outside a chunk of {count} elements")
    return pos.astype(np.int64)


# --- aurora: LEB128 gaps + raw values -----------------------------------------------------------


def encode_aurora(old: np.ndarray, new: np.ndarray, pos: np.ndarray) -> bytes:
    """AuroraRL reference: gaps (first position, then differences) as LEB128, new values raw LE."""
    gaps = np.diff(pos, prepend=0)
    return pack_streams(
        b"", [bitio.leb128_encode(gaps), new[pos].astype(new.dtype.newbyteorder("<")).tobytes()]
    )


def decode_aurora(old: np.ndarray, payload: memoryview, changed: int) -> Decoded:
    _, (gaps_b, vals_b) = unpack_streams(payload, "<", 2)
    gaps = bitio.leb128_decode(gaps_b, changed)
    if changed > 1 and int(gaps[1:].min()) == 0:
        raise FormatError("aurora gaps must be positive after the first")
    if gaps.size and int(gaps.max()) >= old.size:
        raise FormatError("aurora gap outside the chunk")
    pos = _check_positions(np.cumsum(gaps.astype(np.int64)), old.size)
    vals = _raw_values(vals_b, changed, old.dtype)
    o = old[pos]
    if bool((vals == o).any()):
        raise FormatError("a changed element decodes to its old value")
    return Decoded(pos, vals, o)


# --- rice: Rice-coded gaps + zstd'd zigzag difference bytes with escapes -------------------------


def encode_rice(old: np.ndarray, new: np.ndarray, pos: np.ndarray) -> bytes:
    """Rice gaps (p_i - p_{i-1} - 1) + zigzag(new - old) bytes (255 = escape to raw new value), zstd."""
    gaps = np.diff(pos, prepend=-1) - 1
    k = bitio.rice_param(gaps)
    unary, rem, pos_esc = bitio.rice_encode(gaps, k)
    o, n = old[pos], new[pos]
    z = zigzag(n - o)
    esc = z >= ESCAPE_BYTE
    small = np.where(esc, ESCAPE_BYTE, z).astype(np.uint8)
    streams = [
        unary,
        rem,
        pos_esc.astype("<u8").tobytes(),
        _zstd(small.tobytes()),
        n[esc].astype(n.dtype.newbyteorder("<")).tobytes(),
    ]
    return pack_streams(struct.pack("<B", k), streams)


def decode_rice(old: np.ndarray, payload: memoryview, changed: int) -> Decoded:
    (k,), (unary, rem, pos_esc_b, vals_z, esc_b) = unpack_streams(payload, "<B", 5)
    if k > 32:
        raise FormatError(f"rice parameter {k} > 32")
    if len(pos_esc_b) % 8:
        raise FormatError("position escape stream is not a whole number of u64")
    pos_esc = np.frombuffer(pos_esc_b, dtype="<u8")
    gaps = bitio.rice_decode(unary, rem, pos_esc, k, changed)
    if gaps.size and int(gaps.max()) >= old.size:
        raise FormatError("rice gap outside the chunk")
    pos = np.cumsum(gaps.astype(np.int64) + 1) - 1
    pos = _check_positions(pos, old.size)
    small = np.frombuffer(_unzstd(vals_z, changed), dtype=np.uint8)
    esc = small == ESCAPE_BYTE
    esc_vals = _raw_values(esc_b, int(esc.sum()), old.dtype)
    o = old[pos]
    vals = o + unzigzag(small.astype(old.dtype))
    vals[esc] = esc_vals
    if bool((vals == o).any()):
        raise FormatError("a changed element decodes to its old value")
    return Decoded(pos, vals, o)


# --- dense: every element's zigzag difference, byte planes, zstd ---------------------------------


def encode_dense(old: np.ndarray, new: np.ndarray, pos: np.ndarray) -> bytes:
    """Zigzag(new - old) of every element of the chunk, split into byte planes (low first), zstd."""
    z = zigzag(new - old).astype(old.dtype.newbyteorder("<"))
    planes = z.view(np.uint8).reshape(-1, old.dtype.itemsize).T.tobytes()
    return pack_streams(b"", [_zstd(planes)])


def decode_dense(old: np.ndarray, payload: memoryview, changed: int) -> Decoded:
    _, (planes_z,) = unpack_streams(payload, "<", 1)
    isz = old.dtype.itemsize
    planes = np.frombuffer(_unzstd(planes_z, old.size * isz), dtype=np.uint8)
    z = np.ascontiguousarray(planes.reshape(isz, -1).T).view(old.dtype.newbyteorder("<")).reshape(-1)
    z = z.astype(old.dtype)
    pos = np.flatnonzero(z)
    if pos.size != changed:
        raise FormatError(f"dense chunk changes {pos.size} elements, header says {changed}")
    o = old[pos]
    return Decoded(pos.astype(np.int64), o + unzigzag(z[pos]), o)
