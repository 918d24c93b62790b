"""Every content hash of format 3: BLAKE3-256, over 64 KiB blocks, composed into a tree.

One hash pass per byte: each byte is hashed once, in its 64 KiB *block* (:func:`leaves`), and every
other hash is composed from block hashes without touching the bytes again (docs/FORMAT.md,
"Hashes"):

* a **piece** (the grain a reader checks as it streams, 1 MiB by default) hashes the
  concatenated hashes of its blocks (:func:`piece_hash`);
* an **object's root** hashes its size, piece size and piece hashes (:func:`object_root`);
* the **state digest** hashes the tensor table and the hashes of the 64 KiB blocks of the state's
  byte stream (:func:`state_root`), so a keyframe whose parts hold whole blocks of that stream
  yields its digest from the block hashes its own pieces were made of;
* a **version id** is the plain BLAKE3 of the manifest's bytes (:func:`content_id`).

Interior hashes use BLAKE3's key derivation with a context string of their own, so no interior
hash can be mistaken for a block's. Every hash of deltarl goes through this module (``_blake3``
is the one constructor), so a test can count the bytes each phase hashes.
"""

from __future__ import annotations

import struct
from typing import Any

import blake3

#: Bytes per block: the unit every byte is hashed in (the last block of an object or stream is shorter).
BLOCK = 64 << 10
#: Bytes of one hash.
HASH_BYTES = 32

_PIECE_CONTEXT = "deltarl 2026 format 3 piece"
_OBJECT_CONTEXT = "deltarl 2026 format 3 object root"
_STATE_CONTEXT = "deltarl 2026 format 3 state digest"

#: The one hash constructor every function here calls (tests wrap it to count bytes per phase).
_blake3 = blake3.blake3


def _view(data: Any) -> memoryview:
    return memoryview(data).cast("B")


def block_hash(data: Any) -> bytes:
    """BLAKE3-256 of one block (at most :data:`BLOCK` bytes)."""
    return _blake3(data).digest()


def leaves(data: Any) -> bytes:
    """The concatenated hashes of the consecutive :data:`BLOCK`-byte blocks of ``data`` (the last may
    be shorter; nothing for empty ``data``). The bytes are hashed once, here."""
    mv = _view(data)
    n = len(mv)
    return b"".join([_blake3(mv[a : a + BLOCK]).digest() for a in range(0, n, BLOCK)])


def _node(context: str, data: bytes) -> bytes:
    return _blake3(data, derive_key_context=context).digest()


def piece_hash(block_hashes: bytes) -> bytes:
    """The hash of a piece from the hashes of its blocks, in order."""
    return _node(_PIECE_CONTEXT, block_hashes)


def object_root(size: int, piece_size: int, pieces: tuple[str, ...] | list[str]) -> str:
    """An object's root (hex) from its size, piece size and piece hashes (hex)."""
    return _node(_OBJECT_CONTEXT, struct.pack("<QI", size, piece_size) + b"".join(bytes.fromhex(p) for p in pieces)).hex()


def state_root(table: bytes, block_hashes: bytes) -> str:
    """The state digest (hex) from its encoded tensor table and the hashes of its stream's blocks."""
    return _node(_STATE_CONTEXT, table + block_hashes).hex()


def content_id(data: Any) -> str:
    """Plain BLAKE3-256 hex of ``data`` (a manifest's bytes: the version id)."""
    return _blake3(data).hexdigest()


__all__ = ["BLOCK", "HASH_BYTES", "block_hash", "content_id", "leaves", "object_root", "piece_hash", "state_root"]
