"""What every chunk codec is and shares: the :class:`Codec` record, the :class:`Changes` it encodes,
the :class:`Decoded` it returns, and the payload's stream helpers.

A chunk codec maps ``(old bits, new bits, changed positions)`` of one chunk (a tensor's element
range) to a payload, and a payload plus the old bits back to ``(positions, new bits)``. Positions
are relative to the chunk start, sorted, unique. Differences are taken on the unsigned bit
patterns modulo 2**bits, so they are exact for every value (NaN payloads, -0.0, inf, subnormals,
sign flips). Each codec is one module (``aurora``, ``rice``, ``dense``, ``ctx``, ``sparse``);
``registry`` holds the table of them. Codec ids and payload layouts are in docs/FORMAT.md.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from deltarl.codec.classes import ClassCode
from deltarl.errors import FormatError

ZSTD_LEVEL = 3


@dataclass(frozen=True)
class Decoded:
    """The changed elements of one chunk: positions relative to the chunk start, and new bit patterns."""

    positions: np.ndarray  # int64, sorted, unique; a fresh array the caller may modify
    values: np.ndarray  # uint16 / uint32
    old_values: np.ndarray | None = None  # old bits at ``positions``, when the decoder read them anyway


@dataclass(frozen=True)
class Changes:
    """The changed elements of one chunk, as an encoder takes them.

    ``pos``: their positions relative to the chunk start, sorted; or, when ``classes`` is set (the
    base's exponent classes ranked in the same pass, for a codec that ``needs_classes``), in that
    code's class-major order. :meth:`positions` is always sorted.
    """

    pos: np.ndarray
    classes: ClassCode | None = None

    @property
    def count(self) -> int:
        return int(self.pos.size)

    def positions(self) -> np.ndarray:
        """The changed positions, sorted."""
        return self.pos if self.classes is None else np.sort(self.pos)


#: Reads the old bits at sorted, in-range positions (relative to the chunk start).
OldReader = Callable[[np.ndarray], np.ndarray]
#: ``(old bits, new bits, dtype name, changes) -> payload`` (a ``shared`` codec: then the class record).
Encoder = Callable[..., bytes]
#: ``(old bits of the chunk, payload, changed count) -> Decoded`` (a ``shared`` codec: then the
#: tensor's class record).
Decoder = Callable[..., Decoded]
#: ``(read_old, element count, payload, changed count, bit dtype) -> Decoded``.
GatherDecoder = Callable[[OldReader, int, memoryview, int, np.dtype], Decoded]
#: Two :data:`Decoder` calls at once: ``((old, payload, changed[, record]), (old, payload, changed[, record]))``.
PairDecoder = Callable[[tuple[Any, ...], tuple[Any, ...]], tuple[Decoded, Decoded]]


@dataclass(frozen=True)
class Codec:
    """One chunk codec: what the chunk table's codec byte means, and how to code it.

    Attributes:
        id: the byte in a segment's chunk table (1..255; 0 is a chunk without changes).
        name: how configs, ``encode_delta(codec=...)`` and :class:`ChunkInfo` name it.
        encode: the payload of a chunk's changes.
        decode: the changes back from a payload and the chunk's old bits.
        decode_gather: a decoder that reads the base only at the changed positions (through a
            host or device gather), so its cost follows the changes; the stager then never hands
            it the chunk's base range. None: the decoder reads the whole chunk.
        decode_pair: decodes two chunks at once (same result as two ``decode`` calls, faster).
        needs_classes: ``encode`` wants :attr:`Changes.classes` (ranked during change detection).
        auto: ``(low, high)``: ``auto`` tries this codec on a chunk with ``low * n <= changed <
            high * n`` of its ``n`` elements changed; None: only when asked for by name.
        shared: ``encode`` and ``decode`` (and each ``decode_pair`` tuple) take one more argument,
            the chunk's tensor's class record from the segment header (``ctxs``).
    """

    id: int
    name: str
    encode: Encoder
    decode: Decoder
    decode_gather: GatherDecoder | None = None
    decode_pair: PairDecoder | None = None
    needs_classes: bool = False
    auto: tuple[float, float] | None = None
    shared: bool = False

    @property
    def reads_changes_only(self) -> bool:
        """Decoding reads the base only at the changed positions."""
        return self.decode_gather is not None

    def auto_tries(self, changed: float, count: int) -> bool:
        """``auto`` tries this codec on a chunk of ``count`` elements with ``changed`` changes."""
        return self.auto is not None and self.auto[0] * count <= changed < self.auto[1] * count


def zigzag(diff: np.ndarray) -> np.ndarray:
    """Map wrapped unsigned differences to zigzag codes of the same width (small |d| -> small code)."""
    top = diff.dtype.itemsize * 8 - 1
    neg = (diff >> top) * diff.dtype.type(np.iinfo(diff.dtype).max)
    return (diff << 1) ^ neg


def unzigzag(code: np.ndarray) -> np.ndarray:
    """Inverse of :func:`zigzag`."""
    neg = (code & 1) * code.dtype.type(np.iinfo(code.dtype).max)
    return (code >> 1) ^ neg


def varint(n: int) -> bytes:
    """``n`` as an LEB128 varint (7 bits a byte, low first, high bit: more follow)."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def pack_streams(params: bytes, streams: list[bytes]) -> bytes:
    """Codec params, then one LEB128 varint length per stream, then the streams."""
    return params + b"".join(varint(len(s)) for s in streams) + b"".join(streams)


def unpack_streams(
    payload: memoryview, params_fmt: str, nstreams: int
) -> tuple[tuple[int, ...], list[memoryview]]:
    """Inverse of :func:`pack_streams`: ``(params, streams)``, checking every length."""
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


def zstd(data: bytes) -> bytes:
    """One zstd frame that declares its content size."""
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(data)


def unzstd(data: memoryview, size: int) -> bytes:
    """A zstd frame's content, which must be exactly ``size`` bytes."""
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


def raw_values(data: memoryview, count: int, udt: np.dtype) -> np.ndarray:
    """``count`` little-endian values of ``udt``, exactly filling ``data``."""
    if len(data) != count * udt.itemsize:
        raise FormatError(f"raw value stream has {len(data)} bytes, expected {count * udt.itemsize}")
    return np.frombuffer(data, dtype=udt.newbyteorder("<")).astype(udt)


def check_positions(pos: np.ndarray, count: int) -> np.ndarray:
    """Increasing positions as int64, refused if the last lies outside a chunk of ``count``."""
    if pos.size and (int(pos[-1]) >= count):
        raise FormatError(f"changed position {int(pos[-1])} outside a chunk of {count} elements")
    return pos.astype(np.int64)
