"""The peers' delta formats, written here from their published descriptions, for side-by-side runs.

Each format turns ``old -> new`` (``{name: flat bits}``, uint16 BF16 or any width) into bytes and applies those bytes
to a copy of ``old`` in place; :func:`round_trip` checks that the result is ``new`` bit for bit.
Change detection uses deltarl's kernel for every sparse format (the formats are compared, not
detection code). None of this is the peers' code:

* ``aurora`` - the AuroraRL paper's reference encoding: per tensor, the change positions as LEB128
  varints of the gaps (first position, then differences), then the new values raw.
* ``verl/trl`` - verl's ``delta_sharded`` weight sync and TRL's sparse safetensors delta: per
  tensor, int32 flat positions and the raw BF16 new values (6 bytes a change).
* ``slime`` - slime's delta weight sync (``deltas_zstd``): per tensor, the XOR of old and new bits
  over the whole tensor, compressed with zstd at level 1; applied by XOR-ing it into the base.
* ``nemo-rl`` - NeMo-RL's remote sparse-delta refit codec
  (``nemo_rl/utils/weight_transfer_sparse_codec.py``, ``encode_sparse_infos`` with the
  ``overwrite`` operation, as its design doc "Remote Sparse-Delta vLLM Refit" describes it): per
  changed tensor a metadata record (name, shape, dtype, operation, index and value ranges, index
  encoding), then either ``range`` (a contiguous run: its start only) or ``deltas``: the gaps
  ``p_i - p_{i-1} - 1`` in the narrowest of u16/u32/u64 that holds the tensor's largest gap; the
  new values raw. The metadata is counted as its JSON.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zstandard

from deltarl.codec import bitio, kernels

State = dict[str, np.ndarray]  # bits (uint16 for BF16; uint8/uint32 in an FP8 state), flat


def _head(name: str, count: int) -> bytes:
    raw = name.encode()
    return struct.pack("<H", len(raw)) + raw + struct.pack("<Q", count)


def _read_head(buf: memoryview, off: int) -> tuple[str, int, int]:
    (n,) = struct.unpack_from("<H", buf, off)
    name = bytes(buf[off + 2 : off + 2 + n]).decode()
    (count,) = struct.unpack_from("<Q", buf, off + 2 + n)
    return name, count, off + 10 + n


# --- aurora -------------------------------------------------------------------------------------


def aurora_encode(old: State, new: State) -> bytes:
    out = []
    for name in sorted(old):
        pos = kernels.changed_positions(old[name], new[name])
        if pos.size:
            gaps = bitio.leb128_encode(np.diff(pos, prepend=0))
            out += [_head(name, pos.size), struct.pack("<Q", len(gaps)), gaps, new[name][pos].tobytes()]
    return b"".join(out)


def aurora_apply(state: State, blob: bytes) -> None:
    buf, off = memoryview(blob), 0
    while off < len(buf):
        name, count, off = _read_head(buf, off)
        (glen,) = struct.unpack_from("<Q", buf, off)
        off += 8
        pos = np.cumsum(bitio.leb128_decode(buf[off : off + glen], count).astype(np.int64))
        off += glen
        nbytes = count * state[name].itemsize  # any bit width: the FP8 benchmark runs them on 8-bit codes
        vals = np.frombuffer(buf[off : off + nbytes], dtype=state[name].dtype)
        off += nbytes
        kernels.scatter(state[name], pos, vals)


# --- verl / TRL: int32 positions + raw values ---------------------------------------------------


def coo_encode(old: State, new: State) -> bytes:
    out = []
    for name in sorted(old):
        pos = kernels.changed_positions(old[name], new[name])
        if pos.size:
            out += [_head(name, pos.size), pos.astype("<i4").tobytes(), new[name][pos].tobytes()]
    return b"".join(out)


def coo_apply(state: State, blob: bytes) -> None:
    buf, off = memoryview(blob), 0
    while off < len(buf):
        name, count, off = _read_head(buf, off)
        pos = np.frombuffer(buf[off : off + 4 * count], dtype="<i4").astype(np.int64)
        off += 4 * count
        nbytes = count * state[name].itemsize  # any bit width: the FP8 benchmark runs them on 8-bit codes
        vals = np.frombuffer(buf[off : off + nbytes], dtype=state[name].dtype)
        off += nbytes
        kernels.scatter(state[name], pos, vals)


# --- slime: XOR over the whole tensor + zstd level 1 --------------------------------------------


def slime_encode(old: State, new: State) -> bytes:
    cctx = zstandard.ZstdCompressor(level=1)
    out = []
    for name in sorted(old):
        frame = cctx.compress(np.bitwise_xor(old[name], new[name]).tobytes())
        out += [_head(name, len(frame)), frame]
    return b"".join(out)


def slime_apply(state: State, blob: bytes) -> None:
    dctx = zstandard.ZstdDecompressor()
    buf, off = memoryview(blob), 0
    while off < len(buf):
        name, nbytes, off = _read_head(buf, off)
        target = state[name]
        xor = np.frombuffer(dctx.decompress(buf[off : off + nbytes], max_output_size=target.nbytes), target.dtype)
        off += nbytes
        np.bitwise_xor(target, xor, out=target)


# --- NeMo-RL sparse refit -----------------------------------------------------------------------


def nemo_encode(old: State, new: State) -> bytes:
    meta, locs, vals = [], [], []
    index = value = 0
    for name in sorted(old):
        pos = kernels.changed_positions(old[name], new[name])
        if not pos.size:
            continue
        item: dict[str, object] = {"name": name, "shape": [int(old[name].size)], "dtype": "bfloat16",
                                   "operation": "overwrite", "value_group": 0}  # fmt: skip
        if pos.size == 1 or int(pos[-1] - pos[0] + 1) == pos.size:
            item |= {"index_encoding": "range", "range_start": int(pos[0]), "index_start": index, "index_end": index}
        else:
            gaps = np.diff(pos, prepend=-1) - 1
            top = int(gaps.max())
            dt = np.uint16 if top <= 0xFFFF else np.uint32 if top <= 0xFFFFFFFF else np.uint64
            raw = gaps.astype(dt).tobytes()
            locs.append(raw)
            item |= {"index_encoding": "deltas", "index_start": index, "index_end": index + len(raw)}
            index += len(raw)
        item |= {"value_start": value, "value_end": value + int(pos.size)}
        value += int(pos.size)
        vals.append(new[name][pos].tobytes())
        meta.append(item)
    header = json.dumps(meta).encode()
    return struct.pack("<QQ", len(header), index) + header + b"".join(locs) + b"".join(vals)


def nemo_apply(state: State, blob: bytes) -> None:
    hlen, ilen = struct.unpack_from("<QQ", blob, 0)
    meta = json.loads(blob[16 : 16 + hlen])
    locs = memoryview(blob)[16 + hlen : 16 + hlen + ilen]
    values, at = memoryview(blob)[16 + hlen + ilen :], 0
    for item in meta:
        count = item["value_end"] - item["value_start"]
        target = state[item["name"]]
        if item["index_encoding"] == "range":
            pos = np.arange(item["range_start"], item["range_start"] + count, dtype=np.int64)
        else:
            raw = locs[item["index_start"] : item["index_end"]]
            dt = {2: np.uint16, 4: np.uint32, 8: np.uint64}[len(raw) // count]
            pos = np.cumsum(np.frombuffer(raw, dtype=dt).astype(np.int64) + 1) - 1
        kernels.scatter(target, pos, np.frombuffer(values[at : at + count * target.itemsize], dtype=target.dtype))
        at += count * target.itemsize


@dataclass(frozen=True)
class Peer:
    name: str
    encode: Callable[[State, State], bytes]
    apply: Callable[[State, bytes], None]


PEERS = [
    Peer("aurora", aurora_encode, aurora_apply),
    Peer("verl/trl", coo_encode, coo_apply),
    Peer("slime", slime_encode, slime_apply),
    Peer("nemo-rl", nemo_encode, nemo_apply),
]


def round_trip(peer: Peer, old: State, new: State) -> bytes:
    """Encode with ``peer``, apply to a copy of ``old``, raise unless the result is ``new`` exactly."""
    blob = peer.encode(old, new)
    state = {k: v.copy() for k, v in old.items()}
    peer.apply(state, blob)
    for name in old:
        if not np.array_equal(state[name], new[name]):
            raise AssertionError(f"peer format {peer.name}: tensor {name} does not round-trip")
    return blob
