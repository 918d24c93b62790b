"""The ctx decoder's two-chunk form (interleaved scan) and the stager that pairs chunks with it."""

from __future__ import annotations

import contextlib
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.codec import BF16, ctx, encode_delta, stage_delta, state_digest
from deltarl.codec.encode import encode_chunk
from deltarl.codec.stager import Stager
from deltarl.errors import BaseMismatch, FormatError, TensorMismatch


@pytest.fixture(params=["numba", "numpy"])
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("DELTARL_NO_NUMBA", "1" if request.param == "numpy" else "0")
    return str(request.param)


def _chunk(
    rng: np.random.Generator, n: int, frac: float, dtype: str = "bfloat16", upto: float = 1.0
) -> tuple:
    """(old bits, payload, changed, new bits) of a weight-like chunk; changes only in the first ``upto``."""
    w = (rng.standard_normal(n) * 0.02).astype(np.float32)
    if dtype == "float32":
        old = w.view(np.uint32).copy()
    elif dtype == "float16":
        old = w.astype(np.float16).view(np.uint16).copy()
    else:
        old = (w.view(np.uint32) >> 16).astype(np.uint16)
    new = old.copy()
    where = np.flatnonzero(rng.random(int(n * upto)) < frac)
    new[where] += rng.integers(1, 4, where.size).astype(old.dtype)
    big = where[::17]
    new[big] ^= old.dtype.type(0x4000)  # some large differences and sign-like flips
    used, changed, payload = encode_chunk(old, new, dtype, "ctx")
    assert used == "ctx"
    return old, memoryview(payload), changed, new


def _expect(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pos = np.flatnonzero(old != new)
    return pos, old[pos], new[pos]


CASES = {
    "similar sizes": (("bfloat16", 40_000, 0.02, 1.0), ("bfloat16", 36_000, 0.01, 1.0)),
    "one ends early": (("bfloat16", 50_000, 0.02, 0.1), ("bfloat16", 50_000, 0.02, 1.0)),
    "other ends early": (("bfloat16", 20_000, 0.05, 1.0), ("bfloat16", 60_000, 0.01, 0.05)),
    "short and long": (("bfloat16", 9, 0.5, 1.0), ("bfloat16", 30_000, 0.02, 1.0)),
    "dense": (("bfloat16", 4_001, 0.9, 1.0), ("bfloat16", 4_003, 0.7, 1.0)),
    "fp16 and bf16": (("float16", 10_000, 0.03, 1.0), ("bfloat16", 10_000, 0.03, 1.0)),
    "fp32": (("float32", 10_000, 0.03, 1.0), ("float32", 7_000, 0.03, 1.0)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pair_decoder_equals_two_single_decodes(kernel_path: str, case: str) -> None:
    rng = np.random.default_rng(len(case))
    (da, na, fa, ua), (db, nb, fb, ub) = CASES[case]
    a = _chunk(rng, na, fa, da, ua)
    b = _chunk(rng, nb, fb, db, ub)
    got = ctx.decode_pair(a[:3], b[:3])
    for (old, payload, changed, new), dec in zip((a, b), got, strict=True):
        single = ctx.decode(old, payload, changed)
        pos, o, n = _expect(old, new)
        for d in (dec, single):
            assert np.array_equal(d.positions, pos)
            assert np.array_equal(d.values, n)
            assert d.old_values is not None
            assert np.array_equal(d.old_values, o)


def test_pair_decoder_on_unaligned_chunks(kernel_path: str) -> None:
    rng = np.random.default_rng(3)
    a = _chunk(rng, 20_001, 0.02)
    b = _chunk(rng, 20_001, 0.02)
    olds = [np.concatenate((c[0][:1], c[0]))[1:] for c in (a, b)]  # not 8-byte aligned: no word views
    assert all(o.ctypes.data % 8 for o in olds)
    got = ctx.decode_pair((olds[0], a[1], a[2]), (olds[1], b[1], b[2]))
    for c, dec in zip((a, b), got, strict=True):
        assert np.array_equal(dec.values, _expect(c[0], c[3])[2])


def test_pair_decoder_rejects_either_corrupt_chunk(kernel_path: str) -> None:
    rng = np.random.default_rng(4)
    a = _chunk(rng, 30_000, 0.02)
    b = _chunk(rng, 30_000, 0.02)
    short = a[0][:1000]  # ranks now run past the chunk's same-class elements
    with pytest.raises(FormatError):
        ctx.decode_pair((short, a[1], a[2]), b[:3])
    with pytest.raises(FormatError):
        ctx.decode_pair(a[:3], (b[0][:1000], b[1], b[2]))


def _many(seed: int, tensors: int = 24, n: int = 5_000) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for i in range(tensors):
        bits = (rng.standard_normal(n + 37 * i) * 0.02).astype(np.float32).view(np.uint32) >> 16
        o = bits.astype(np.uint16)
        nw = o.copy()
        where = np.flatnonzero(rng.random(o.size) < 0.02)
        nw[where] += rng.integers(1, 3, where.size).astype(np.uint16)
        old[f"t{i:02d}"], new[f"t{i:02d}"] = BF16(o), BF16(nw)
    return old, new


def _copy(state: dict) -> dict:
    return {k: BF16(v.bits.copy()) for k, v in state.items()}


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_stager_pairs_chunks_with_the_same_result(
    kernel_path: str, monkeypatch: pytest.MonkeyPatch, threads: str
) -> None:
    monkeypatch.setenv("DELTARL_THREADS", threads)
    old, new = _many(0)
    segs = encode_delta(old, new, base="p")
    assert len(segs) == 1
    state = _copy(old)
    upd = stage_delta(state, segs, base="p")
    for name, (pos, o, n) in upd.changes().items():  # positions sorted per tensor
        want = _expect(old[name].bits, new[name].bits)
        for got, exp in zip((pos, o, n), want, strict=True):
            assert np.array_equal(got, exp)
    upd.commit()
    assert state_digest(state) == state_digest(new)
    upd.rollback()
    assert state_digest(state) == state_digest(old)


def _refix(seg: bytes) -> bytes:
    b = bytearray(seg)
    if len(b) < 20:
        return bytes(b)
    (hlen,) = struct.unpack_from("<I", b, 8)
    if 16 + hlen <= len(b) - 4:
        struct.pack_into("<I", b, 12, zlib.crc32(b[16 : 16 + hlen]))
    struct.pack_into("<I", b, len(b) - 4, zlib.crc32(b[:-4]))
    return bytes(b)


FUZZ_OLD, FUZZ_NEW = _many(1, tensors=12, n=2_000)
(FUZZ_SEG,) = encode_delta(FUZZ_OLD, FUZZ_NEW, base="f")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_forged_corruption_of_paired_chunks_raises_only_our_errors(data: st.DataObject) -> None:
    seg = bytearray(FUZZ_SEG)
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(seg) - 5))
        seg[i] = data.draw(st.integers(0, 255))
    state = _copy(FUZZ_OLD)
    before = state_digest(state)
    with contextlib.suppress(FormatError, BaseMismatch, TensorMismatch):
        Stager(state, base="f").add_segment(_refix(bytes(seg)))
    assert state_digest(state) == before
