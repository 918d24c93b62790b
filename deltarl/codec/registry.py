"""Codec ids (the byte in a segment's chunk table) and the encode/decode dispatch for each."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np

from deltarl.codec import chunk_codecs as codecs
from deltarl.codec import exponent_classes as ctx
from deltarl.codec import kernels
from deltarl.codec import sparse as sparse_codec
from deltarl.codec.chunk_codecs import Decoded

CODEC_IDS: dict[str, int] = {"none": 0, "aurora": 1, "rice": 2, "dense": 3, "ctx": 4, "sparse": 5}
CODEC_NAMES: dict[int, str] = {v: k for k, v in CODEC_IDS.items()}
ENCODABLE = ("aurora", "rice", "dense", "ctx", "sparse")

Encoder = Callable[[np.ndarray, np.ndarray, str, SimpleNamespace], bytes]


def _ctx(old: np.ndarray, new: np.ndarray, dtype: str, ch: SimpleNamespace) -> bytes:
    return ctx.encode_ctx(old, new, dtype, ch if hasattr(ch, "k_pos") else None)


ENCODERS: dict[str, Encoder] = {
    "aurora": lambda o, n, _d, ch: codecs.encode_aurora(o, n, ch.pos),
    "rice": lambda o, n, _d, ch: codecs.encode_rice(o, n, ch.pos),
    "dense": lambda o, n, _d, ch: codecs.encode_dense(o, n, ch.pos),
    "ctx": _ctx,
    "sparse": lambda o, n, _d, ch: sparse_codec.encode_sparse(o, n, ch.pos),
}
DECODERS: dict[str, Callable[[np.ndarray, memoryview, int], Decoded]] = {
    "aurora": codecs.decode_aurora,
    "rice": codecs.decode_rice,
    "dense": codecs.decode_dense,
    "ctx": ctx.decode_ctx,
    "sparse": lambda old, payload, changed: sparse_codec.decode_sparse(
        lambda pos: kernels.gather(old, pos), old.size, payload, changed, old.dtype
    ),
}

# Decoders that read the base only at the changed positions: ``(read_old, count, payload, changed,
# bit dtype)``, where ``read_old(positions)`` returns the old bits there (host or device gather).
# The stager never hands them the chunk's base range, so their cost follows the changes.
GATHER_DECODERS: dict[str, Callable[[sparse_codec.OldReader, int, memoryview, int, np.dtype], Decoded]] = {
    "sparse": sparse_codec.decode_sparse,
}


# Decoders of two chunks at once (same result as two DECODERS calls, faster).
PAIR_DECODERS: dict[
    str,
    Callable[
        [tuple[np.ndarray, memoryview, int], tuple[np.ndarray, memoryview, int]], tuple[Decoded, Decoded]
    ],
] = {"ctx": ctx.decode_ctx_pair}


def detect(old: np.ndarray, new: np.ndarray, dtype: str, with_classes: bool) -> SimpleNamespace:
    """Changed positions of a chunk, plus per-class ranks when a ctx encode will need them."""
    if with_classes:
        return ctx.prepare(old, new, dtype)
    return SimpleNamespace(pos=kernels.changed_positions(old, new))
