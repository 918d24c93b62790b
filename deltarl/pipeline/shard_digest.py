"""The ``blocks64k-v2`` state digest computed shard by shard (docs/FORMAT.md).

Each tensor's raw bytes (row-major, stored dtype) are cut into 64 KiB blocks; a tensor's hash is
the sha256 of its block hashes in order, and the digest hashes the tensors in run.json order. A
rank holding a contiguous byte range of a tensor hashes the blocks wholly inside its range and
hands on the bytes of the (at most two) blocks its range cuts; :func:`combine_digest` joins every
rank's :class:`ShardHashes` into the digest an actor computes from the full state.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deltarl.codec.tensors import BLOCKS_V2, DIGEST_BLOCK, DTYPES, TensorSpec, flat_bits, is_cuda
from deltarl.errors import IntegrityError

BLOCK_BYTES = DIGEST_BLOCK
ALGO = BLOCKS_V2


@dataclass
class TensorShardHashes:
    """One tensor's share of a rank: leaves of whole blocks from ``first_block``, and cut blocks' bytes."""

    first_block: int = 0
    leaves: bytes = b""  # 32 bytes per whole block, in block order
    fragments: list[tuple[int, int, bytes]] = field(default_factory=list)  # (block, byte offset, bytes)


ShardHashes = dict[str, TensorShardHashes]


def _byte_width(spec: TensorSpec) -> int:
    return DTYPES[spec.dtype][1] // 8


def shard_hashes(
    local: Mapping[str, Any], rows: Mapping[str, tuple[TensorSpec, int]]
) -> ShardHashes:
    """This rank's hashes: ``local[name]`` holds elements ``[start, start + numel)`` of ``rows[name][0]``."""
    out: ShardHashes = {}
    for name, (spec, start) in rows.items():
        value = local[name]
        if is_cuda(value):
            value = value.cpu()
        raw = flat_bits(name, value).data.cast("B")
        width = _byte_width(spec)
        b0 = start * width
        b1 = b0 + len(raw)
        total = spec.numel * width
        part = TensorShardHashes()
        if b1 > b0:
            jlo, jhi = b0 // BLOCK_BYTES, (b1 - 1) // BLOCK_BYTES

            def whole(j: int, b0: int = b0, b1: int = b1, total: int = total) -> bool:
                return j * BLOCK_BYTES >= b0 and min((j + 1) * BLOCK_BYTES, total) <= b1

            first = jlo if whole(jlo) else jlo + 1
            last = jhi if whole(jhi) else jhi - 1
            part.first_block = first
            part.leaves = b"".join(
                hashlib.sha256(raw[j * BLOCK_BYTES - b0 : min((j + 1) * BLOCK_BYTES, total) - b0]).digest()
                for j in range(first, last + 1)
            )
            for j in sorted({jlo, jhi}):
                if not whole(j):
                    lo, hi = max(j * BLOCK_BYTES, b0), min((j + 1) * BLOCK_BYTES, total, b1)
                    part.fragments.append((j, lo, bytes(raw[lo - b0 : hi - b0])))
        out[name] = part
    return out


def combine_digest(table: Sequence[TensorSpec], shares: Iterable[ShardHashes]) -> str:
    """The ``blocks64k-v2`` digest of the whole state from every rank's :func:`shard_hashes`.

    Raises IntegrityError if the shares do not cover each block of each tensor exactly once.
    """
    leaves: dict[str, dict[int, bytes]] = {spec.name: {} for spec in table}
    frags: dict[str, dict[int, list[tuple[int, bytes]]]] = {spec.name: {} for spec in table}
    for share in shares:
        for name, part in share.items():
            if name not in leaves:
                raise IntegrityError(f"digest share names tensor {name!r}, which is not in the table")
            mine = leaves[name]
            for i in range(len(part.leaves) // 32):
                j = part.first_block + i
                if j in mine:
                    raise IntegrityError(f"tensor {name!r}: block {j} hashed by two shards")
                mine[j] = part.leaves[32 * i : 32 * i + 32]
            for j, offset, data in part.fragments:
                frags[name].setdefault(j, []).append((offset, data))
    h = hashlib.sha256()
    for spec in table:
        total = spec.numel * _byte_width(spec)
        nblocks = -(-total // BLOCK_BYTES)
        mine = leaves[spec.name]
        for j, pieces in frags[spec.name].items():
            if j in mine:
                raise IntegrityError(f"tensor {spec.name!r}: block {j} both whole and cut")
            pieces.sort()
            lo, hi = j * BLOCK_BYTES, min((j + 1) * BLOCK_BYTES, total)
            pos, buf = lo, bytearray()
            for offset, data in pieces:
                if offset != pos:
                    raise IntegrityError(f"tensor {spec.name!r}: block {j} has a gap or overlap at byte {offset}")
                buf += data
                pos += len(data)
            if pos != hi:
                raise IntegrityError(f"tensor {spec.name!r}: block {j} ends at byte {pos}, not {hi}")
            mine[j] = hashlib.sha256(buf).digest()
        if sorted(mine) != list(range(nblocks)):
            missing = sorted(set(range(nblocks)) - set(mine))[:3]
            raise IntegrityError(f"tensor {spec.name!r}: blocks {missing} not covered by any shard")
        tensor_hash = hashlib.sha256(b"".join(mine[j] for j in range(nblocks))).digest()
        raw = spec.name.encode()
        h.update(struct.pack("<I", len(raw)) + raw + tensor_hash)
    return h.hexdigest()


def full_rows(state: Mapping[str, Any], table: Sequence[TensorSpec]) -> dict[str, tuple[TensorSpec, int]]:
    """``rows`` for a process that holds whole tensors (every tensor from element 0)."""
    return {spec.name: (spec, 0) for spec in table if spec.name in state}
