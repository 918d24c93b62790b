"""The codec table: one object per codec, unique ids and names, and an ``auto`` choice for every density."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deltarl.codec import registry
from deltarl.codec.encode import CODECS, encode_chunk
from deltarl.errors import FormatError


def test_ids_and_names_are_unique_and_none_is_reserved() -> None:
    ids = [c.id for c in registry.CODECS]
    names = [c.name for c in registry.CODECS]
    assert len(set(ids)) == len(ids)
    assert len(set(names)) == len(names)
    assert all(1 <= i <= 255 for i in ids)
    assert registry.codec_id("none") == 0
    assert registry.codec_name(0) == "none"
    for c in registry.CODECS:
        assert registry.codec_name(registry.codec_id(c.name)) == c.name
    known = {"aurora": 1, "rice": 2, "dense": 3, "ctx": 4, "sparse": 5}  # the format's ids (docs/FORMAT.md)
    assert {n: registry.codec_id(n) for n in known} == known
    assert CODECS[0] == "auto"
    with pytest.raises(FormatError, match="unknown chunk codec 9"):
        registry.codec_name(9)
    with pytest.raises(ValueError, match="unknown codec"):
        registry.by_name("zip")


def test_auto_ranges_cover_every_changed_fraction() -> None:
    edges = sorted({e for c in registry.AUTO for e in c.auto or () if e < math.inf} | {0.0})
    for lo, hi in zip(edges, [*edges[1:], math.inf], strict=True):
        probe = lo if hi == math.inf else (lo + hi) / 2
        assert any(c.auto_tries(probe * 1000, 1000) for c in registry.AUTO), (lo, hi)


def test_a_gather_decoder_reads_the_base_only_at_the_changes() -> None:
    sparse = registry.BY_NAME["sparse"]
    assert sparse.reads_changes_only
    assert not registry.BY_NAME["ctx"].reads_changes_only
    old = np.arange(10_000, dtype=np.uint16)
    new = old.copy()
    new[[5, 700, 9_999]] += np.uint16(3)
    _, changed, payload = encode_chunk(old, new, "bfloat16", "sparse")
    seen: list[np.ndarray] = []

    def read(pos: np.ndarray) -> np.ndarray:
        seen.append(pos.copy())
        return old[pos]

    assert sparse.decode_gather is not None
    dec = sparse.decode_gather(read, old.size, memoryview(payload), changed, old.dtype)
    assert dec.positions.tolist() == [5, 700, 9_999]
    assert [p.tolist() for p in seen] == [[5, 700, 9_999]]
