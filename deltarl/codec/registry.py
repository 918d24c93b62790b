"""The table of chunk codecs: one :class:`~deltarl.codec.chunk.Codec` per codec, by name and by id.

A codec's id is the byte in a segment's chunk table (docs/FORMAT.md); id 0 (:data:`NONE`) is a
chunk without changes and has no codec. ``auto`` (see :func:`deltarl.codec.encode.encode_chunk`)
tries, on each chunk, every codec whose ``auto`` range holds the chunk's changed fraction and keeps
the smallest payload; on a tie, the one listed first here.
"""

from __future__ import annotations

import math

import numpy as np

from deltarl.codec import aurora, ctx, ctxs, dense, kernels, rice, sparse
from deltarl.codec.chunk import Changes, Codec
from deltarl.codec.classes import rank_classes
from deltarl.errors import FormatError

# Below this changed fraction auto uses ``sparse`` (decode reads the base only at the changes);
# above it ``ctx``, whose exponent-class ranks save bytes but whose decode scans the whole chunk.
SPARSE_MAX_FRACTION = 1 / 400
DENSE_MIN_FRACTION = 1 / 2  # auto tries the dense codec only above this changed fraction

CODECS: tuple[Codec, ...] = (
    Codec(5, "sparse", sparse.encode, sparse.decode, decode_gather=sparse.decode_gather,
          auto=(0.0, SPARSE_MAX_FRACTION)),
    Codec(4, "ctx", ctx.encode, ctx.decode, decode_pair=ctx.decode_pair, needs_classes=True,
          auto=(SPARSE_MAX_FRACTION, math.inf)),
    # a grid cell's ctx with its tensor's class record (auto: in cells, where ctx's range holds the chunk)
    Codec(6, "ctxs", ctxs.encode, ctxs.decode, decode_pair=ctxs.decode_pair, needs_classes=True, shared=True),
    Codec(3, "dense", dense.encode, dense.decode, auto=(DENSE_MIN_FRACTION, math.inf)),
    Codec(2, "rice", rice.encode, rice.decode),
    Codec(1, "aurora", aurora.encode, aurora.decode),
)

NONE = "none"  # the name of codec id 0: a chunk without changes, no payload
BY_NAME: dict[str, Codec] = {c.name: c for c in CODECS}
BY_ID: dict[int, Codec] = {c.id: c for c in CODECS}
AUTO: tuple[Codec, ...] = tuple(c for c in CODECS if c.auto is not None)


def by_name(name: str) -> Codec:
    """The codec called ``name``; ValueError if there is none."""
    codec = BY_NAME.get(name)
    if codec is None:
        raise ValueError(f"unknown codec {name!r}; choose one of {sorted(BY_NAME)}")
    return codec


def codec_id(name: str) -> int:
    """The chunk-table byte of a chunk coded ``name`` (``"none"``: 0)."""
    return 0 if name == NONE else by_name(name).id


def codec_name(byte: int) -> str:
    """The name of chunk-table codec byte ``byte``; FormatError for an unknown one."""
    if byte == 0:
        return NONE
    codec = BY_ID.get(byte)
    if codec is None:
        raise FormatError(f"unknown chunk codec {byte}")
    return codec.name


def detect(old: np.ndarray, new: np.ndarray, dtype: str, with_classes: bool) -> Changes:
    """A chunk's changes, with their exponent classes ranked in the same pass when ``with_classes``
    (a codec that ``needs_classes`` will encode them)."""
    if with_classes:
        code = rank_classes(old, new, dtype)
        return Changes(code.pos, code)
    return Changes(kernels.changed_positions(old, new))
