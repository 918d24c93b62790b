"""Commit and rollback of large updates (checked and written in one pass, on one or two threads)."""

from __future__ import annotations

import numpy as np
import pytest

from deltarl.codec import BF16, encode_delta, stage_delta, state_digest
from deltarl.errors import StagingError, TensorMismatch


@pytest.fixture(params=["numba-1t", "numba-2t", "numpy-2t"])
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    path, threads = str(request.param).split("-")
    monkeypatch.setenv("DELTARL_NO_NUMBA", "1" if path == "numpy" else "0")
    monkeypatch.setenv("DELTARL_THREADS", threads[0])
    return path


def _big() -> tuple[dict, dict]:
    """Enough changed elements (~700k) that commits run in many slices on two threads."""
    rng = np.random.default_rng(0)
    old, new = {}, {}
    for name, n in (("a", 1 << 21), ("b", 3 << 19), ("c", 1 << 20)):
        o = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        nw = o.copy()
        where = np.flatnonzero(rng.random(n) < 0.2)
        nw[where] ^= rng.integers(1, 1 << 16, where.size, dtype=np.uint16)
        old[name], new[name] = BF16(o), BF16(nw)
    return old, new


BIG_OLD, BIG_NEW = _big()
BIG_SEGS = encode_delta(BIG_OLD, BIG_NEW, base="b")


def _copy(state: dict) -> dict:
    return {k: BF16(v.bits.copy()) for k, v in state.items()}


def _changed(name: str, i: int) -> int:
    return int(np.flatnonzero(BIG_OLD[name].bits != BIG_NEW[name].bits)[i])


def _neither(name: str, p: int) -> int:
    """Bits that are neither the old nor the new value at position ``p`` of tensor ``name``."""
    return next(
        v for v in (0x0101, 0x0202, 0x0404) if v not in (BIG_OLD[name].bits[p], BIG_NEW[name].bits[p])
    )


def test_large_commit_and_rollback(kernel_path: str) -> None:
    state = _copy(BIG_OLD)
    upd = stage_delta(state, BIG_SEGS, base="b")
    assert upd.changed_elements > 500_000
    upd.commit()
    assert state_digest(state) == state_digest(BIG_NEW)
    upd.commit()
    assert state_digest(state) == state_digest(BIG_NEW)
    upd.rollback()
    assert state_digest(state) == state_digest(BIG_OLD)


@pytest.mark.parametrize("where", [0, 150_000, -1])
def test_a_stale_position_anywhere_leaves_the_state_untouched(kernel_path: str, where: int) -> None:
    state = _copy(BIG_OLD)
    upd = stage_delta(state, BIG_SEGS, base="b")
    p = _changed("c", where)
    state["c"].bits[p] = _neither("c", p)
    before = state_digest(state)
    with pytest.raises(StagingError, match="'c' changed since"):
        upd.commit()
    assert state_digest(state) == before  # every write undone
    state["c"].bits[p] = BIG_OLD["c"].bits[p]
    upd.commit()
    assert state_digest(state) == state_digest(BIG_NEW)
    p = _changed("a", 7)
    state["a"].bits[p] = _neither("a", p)
    before = state_digest(state)
    with pytest.raises(StagingError, match="'a' changed since"):
        upd.rollback()
    assert state_digest(state) == before


def test_the_first_refusal_in_tensor_order_wins(kernel_path: str) -> None:
    state = _copy(BIG_OLD)
    upd = stage_delta(state, BIG_SEGS, base="b")
    for name in ("b", "c"):
        p = _changed(name, 5)
        state[name].bits[p] = _neither(name, p)
    with pytest.raises(StagingError, match="'b' changed since"):  # both stale: 'b' comes first
        upd.commit()
    a = state["a"]
    state["a"] = BF16(np.zeros(5, dtype=np.uint16))  # replaced, and before the stale 'b'
    with pytest.raises(TensorMismatch, match="'a' was replaced"):
        upd.commit()
    state["a"] = a
    state["c"] = BF16(np.zeros(5, dtype=np.uint16))  # replaced, but after the stale 'b'
    with pytest.raises(StagingError, match="'b' changed since"):
        upd.commit()
    assert state_digest({"a": state["a"]}) == state_digest({"a": BIG_OLD["a"]})  # nothing written


def test_read_only_tensor_is_refused_before_any_write(kernel_path: str) -> None:
    state = _copy(BIG_OLD)
    upd = stage_delta(state, BIG_SEGS, base="b")
    state["c"].bits.flags.writeable = False
    before = state_digest(state)
    with pytest.raises(TensorMismatch, match="read-only"):
        upd.commit()
    assert state_digest(state) == before


def test_a_state_already_partly_written_is_finished_or_refused_whole(kernel_path: str) -> None:
    """The one-pass kernel writes only over the bits it replaces; a state where some positions
    already hold the bits being written (a commit over a half-new state, a rollback over a
    half-old one) takes the general path: finished, or refused with nothing written."""
    state = _copy(BIG_OLD)
    upd = stage_delta(state, BIG_SEGS, base="b")
    half = {name: np.flatnonzero(BIG_OLD[name].bits != BIG_NEW[name].bits)[::2] for name in ("b", "c")}
    for name, pos in half.items():
        state[name].bits[pos] = BIG_NEW[name].bits[pos]
    upd.commit()
    assert state_digest(state) == state_digest(BIG_NEW)
    for name, pos in half.items():
        state[name].bits[pos] = BIG_OLD[name].bits[pos]
    upd.rollback()
    assert state_digest(state) == state_digest(BIG_OLD)
    for name, pos in half.items():  # half new again, and one position of 'c' moved on
        state[name].bits[pos] = BIG_NEW[name].bits[pos]
    p = _changed("c", -1)
    state["c"].bits[p] = _neither("c", p)
    before = state_digest(state)
    with pytest.raises(StagingError, match="'c' changed since"):
        upd.commit()
    assert state_digest(state) == before
