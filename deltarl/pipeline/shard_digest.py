"""The ``blake3-stream64k`` state digest computed shard by shard (docs/FORMAT.md, "State digest").

The state's byte stream (every tensor's raw bytes, in run.json order, back to back) is cut into
64 KiB blocks; the digest composes the tensor table with the blocks' hashes. A rank holding a
contiguous element range of a tensor holds a contiguous byte range of the stream: it hashes the
blocks wholly inside that range and hands on the bytes of the (at most two) blocks the range cuts;
:func:`combine_digest` joins every rank's :class:`ShardHashes` into the digest an actor computes
from the full state. Only the cut blocks' bytes travel and are hashed at the combining rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deltarl.codec.hashing import BLOCK, HASH_BYTES, block_hash, leaves, state_root
from deltarl.codec.tensors import (
    DIGEST_ALGO,
    DTYPES,
    TensorSpec,
    flat_bits,
    is_cuda,
    stream_offsets,
    table_bytes,
)
from deltarl.errors import IntegrityError

BLOCK_BYTES = BLOCK
ALGO = DIGEST_ALGO


@dataclass
class TensorShardHashes:
    """One tensor's share of a rank: hashes of whole stream blocks from ``first_block``, and cut blocks' bytes."""

    first_block: int = 0
    leaves: bytes = b""  # 32 bytes per whole block, in block order
    fragments: list[tuple[int, int, bytes]] = field(default_factory=list)  # (block, stream offset, bytes)


ShardHashes = dict[str, TensorShardHashes]


def _byte_width(spec: TensorSpec) -> int:
    return DTYPES[spec.dtype][1] // 8


def shard_hashes(local: Mapping[str, Any], rows: Mapping[str, tuple[TensorSpec, int]]) -> ShardHashes:
    """This rank's hashes: ``local[name]`` holds elements ``[start, start + numel)`` of ``rows[name][0]``;
    ``rows`` names every tensor of the table (the stream's layout)."""
    offsets = stream_offsets(sorted((spec for spec, _ in rows.values()), key=lambda s: s.name))
    out: ShardHashes = {}
    for name, (spec, start) in rows.items():
        value = local[name]
        if is_cuda(value):
            value = value.cpu()
        raw = flat_bits(name, value).data.cast("B")
        b0 = offsets[name] + start * _byte_width(spec)
        b1 = b0 + len(raw)
        part = TensorShardHashes()
        if b1 > b0:
            first = -(-b0 // BLOCK)  # the first block that starts inside the range
            last = b1 // BLOCK  # blocks [first, last) end inside it (the stream's last block may be short)
            total = sum(s.numel * _byte_width(s) for s, _ in rows.values())
            if b1 == total and last * BLOCK < total:
                last += 1
            if first < last:
                part.first_block = first
                part.leaves = leaves(raw[first * BLOCK - b0 : min(last * BLOCK, total) - b0])
                cuts = [(b0, first * BLOCK), (last * BLOCK, b1)]
            else:
                cuts = [(b0, b1)]
            for lo, hi in cuts:
                pos = lo
                while pos < hi:  # a range within one block, or (no whole block) across at most two
                    end = min(hi, (pos // BLOCK + 1) * BLOCK)
                    part.fragments.append((pos // BLOCK, pos, bytes(raw[pos - b0 : end - b0])))
                    pos = end
        out[name] = part
    return out


def combine_digest(table: Sequence[TensorSpec], shares: Iterable[ShardHashes]) -> str:
    """The ``blake3-stream64k`` digest of the whole state from every rank's :func:`shard_hashes`.

    Raises IntegrityError if the shares do not cover each block of the stream exactly once.
    """
    names = {spec.name for spec in table}
    total = sum(spec.numel * _byte_width(spec) for spec in table)
    nblocks = -(-total // BLOCK)
    hashes: dict[int, bytes] = {}
    frags: dict[int, list[tuple[int, bytes]]] = {}
    for share in shares:
        for name, part in share.items():
            if name not in names:
                raise IntegrityError(f"digest share names tensor {name!r}, which is not in the table")
            for i in range(len(part.leaves) // HASH_BYTES):
                j = part.first_block + i
                if j in hashes:
                    raise IntegrityError(f"stream block {j} ({name!r}) hashed by two shards")
                hashes[j] = part.leaves[HASH_BYTES * i : HASH_BYTES * (i + 1)]
            for j, offset, data in part.fragments:
                frags.setdefault(j, []).append((offset, data))
    for j, pieces in frags.items():
        if j in hashes:
            raise IntegrityError(f"stream block {j} both whole and cut")
        pieces.sort()
        lo, hi = j * BLOCK, min((j + 1) * BLOCK, total)
        pos, buf = lo, bytearray()
        for offset, data in pieces:
            if offset > pos:
                raise IntegrityError(f"stream bytes {pos}..{offset} (block {j}) not covered by any shard")
            if offset < pos:
                raise IntegrityError(f"stream block {j} has a gap or overlap at byte {offset}")
            buf += data
            pos += len(data)
        if pos != hi:
            raise IntegrityError(f"stream block {j} ends at byte {pos}, not {hi}")
        hashes[j] = block_hash(buf)
    if len(hashes) != nblocks or (nblocks and max(hashes) != nblocks - 1):
        missing = sorted(set(range(nblocks)) - set(hashes))[:3]
        raise IntegrityError(f"stream blocks {missing} not covered by any shard")
    return state_root(table_bytes(list(table)), b"".join(hashes[j] for j in range(nblocks)))
