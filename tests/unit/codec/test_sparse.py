"""The sparse codec: auto's choice at low density, and a decode that reads the base only at the changes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.codec import BF16, apply, encode_delta, read_segment_header, registry, stage_delta, state_digest
from deltarl.codec.encode import encode_chunk
from deltarl.codec.registry import SPARSE_MAX_FRACTION
from deltarl.errors import FormatError

SPECIAL = [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x807F, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x7F7F]


def _changed(n: int, every: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    new = old.copy()
    new[::every] += np.uint16(1)
    return old, new


def test_auto_uses_sparse_below_the_threshold_and_ctx_above() -> None:
    n = 1 << 16
    old, new = _changed(n, 1000)
    assert encode_chunk(old, new, "bfloat16", "auto")[0] == "sparse"
    old, new = _changed(n, 50)
    assert SPARSE_MAX_FRACTION < 1 / 50
    assert encode_chunk(old, new, "bfloat16", "auto")[0] == "ctx"
    assert encode_chunk(old, old.copy(), "bfloat16", "auto") == ("none", 0, b"")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_sparse_decode_reads_the_base_only_at_the_changes(dtype: str) -> None:
    udt = np.uint32 if dtype == "float32" else np.uint16
    rng = np.random.default_rng(1)
    old = rng.integers(0, np.iinfo(udt).max, 100_000, dtype=udt, endpoint=True)
    new = old.copy()
    where = np.sort(rng.choice(old.size, 37, replace=False))
    new[where] = rng.integers(0, np.iinfo(udt).max, where.size, dtype=udt, endpoint=True)
    where = np.flatnonzero(old != new)
    used, changed, payload = encode_chunk(old, new, dtype, "sparse")
    asked: list[np.ndarray] = []

    def read(pos: np.ndarray) -> np.ndarray:
        asked.append(pos.copy())
        return old[pos]

    dec = registry.BY_NAME["sparse"].decode_gather(read, old.size, memoryview(payload), changed, np.dtype(udt))
    assert (used, changed) == ("sparse", where.size)
    assert len(asked) == 1
    assert asked[0].tolist() == where.tolist()
    assert dec.positions.tolist() == where.tolist()
    assert np.array_equal(dec.values, new[where])
    assert np.array_equal(dec.old_values, old[where])


def test_staging_a_low_density_delta_never_reads_a_chunk_of_the_base(monkeypatch: pytest.MonkeyPatch) -> None:
    """Untouched tensors and chunks cost nothing at decode; changed chunks are gathered, not scanned."""
    rng = np.random.default_rng(2)
    old = {f"t{i}": BF16(rng.integers(0, 1 << 16, 1 << 18, dtype=np.uint16)) for i in range(6)}
    new = {k: BF16(v.bits.copy()) for k, v in old.items()}
    for name in ("t1", "t4"):  # four tensors get nothing
        new[name].bits[::5000] ^= np.uint16(1)
    segs = encode_delta(old, new, base="v", segment_bytes=1 << 16)
    chunks = [c for s in segs for c in read_segment_header(s).chunks]
    assert {c.codec for c in chunks} == {"none", "sparse"}

    def scan(*_args: object) -> np.ndarray:
        raise AssertionError("the stager read a whole chunk of the base")

    monkeypatch.setattr(apply, "_old_range", scan)
    state = {k: BF16(v.bits.copy()) for k, v in old.items()}
    upd = stage_delta(state, segs, base="v")
    assert upd.tensors == ("t1", "t4")
    upd.commit()
    assert state_digest(state) == state_digest(new)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 3000), k=st.integers(1, 40))
def test_sparse_round_trips_specials_and_every_difference(seed: int, n: int, k: int) -> None:
    """±0, NaN payloads, infinities, subnormals, sign flips and every |d| up to 2^15, bit-exact."""
    rng = np.random.default_rng(seed)
    old = rng.choice(np.array(SPECIAL, dtype=np.uint16), n)
    mixed = rng.random(n) < 0.5
    old[mixed] = rng.integers(0, 1 << 16, int(mixed.sum()), dtype=np.uint16)
    new = old.copy()
    where = rng.choice(n, min(n, k), replace=False)
    new[where] = rng.choice(np.array(SPECIAL, dtype=np.uint16), where.size)
    flip = where[: where.size // 2]
    new[flip] = old[flip] ^ np.uint16(0x8000)
    a, b = {"t": BF16(old)}, {"t": BF16(new)}
    segs = encode_delta(a, b, base="v", codec="sparse")
    state = {"t": BF16(old.copy())}
    upd = stage_delta(state, segs, base="v")
    assert upd.changed_elements == int((old != new).sum())
    upd.commit()
    assert np.array_equal(state["t"].bits, new)
    upd.rollback()
    assert np.array_equal(state["t"].bits, old)


def test_sparse_rejects_a_position_beyond_the_chunk() -> None:
    old, new = _changed(1000, 100)
    _, changed, payload = encode_chunk(old, new, "bfloat16", "sparse")
    with pytest.raises(FormatError):
        registry.BY_NAME["sparse"].decode_gather(lambda p: old[p], 900, memoryview(payload), changed, np.dtype(np.uint16))


@pytest.mark.torch
def test_device_tensors_are_gathered_at_the_changes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path (torch tensors treated as device tensors, run on CPU): a sparse chunk's old bits
    come from an index_select on the tensor's device, never a host copy of its chunk."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(3)
    old = {"a": torch.randn(300, 200, generator=g).bfloat16(), "b": torch.randn(5000, generator=g).half()}
    new = {k: v.clone() for k, v in old.items()}
    new["a"].view(-1)[::997] = new["a"].view(-1)[::997] * 1.01
    new["b"][7] = -new["b"][7]
    segs = encode_delta(old, new, base="v")
    assert {c.codec for s in segs for c in read_segment_header(s).chunks} <= {"none", "sparse"}
    monkeypatch.setattr(apply, "is_cuda", lambda v: isinstance(v, torch.Tensor))

    def scan(*_args: object) -> np.ndarray:
        raise AssertionError("the stager copied a whole chunk of the base to the host")

    monkeypatch.setattr(apply, "_old_range", scan)
    state = {k: v.clone() for k, v in old.items()}
    upd = stage_delta(state, segs, base="v")
    upd.commit()
    for k in old:
        assert torch.equal(state[k].view(torch.int16), new[k].view(torch.int16))
    upd.rollback()
    for k in old:
        assert torch.equal(state[k].view(torch.int16), old[k].view(torch.int16))


def test_the_density_guess_changes_the_work_never_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto's strided sample only picks which detection runs; the codec follows the exact count."""
    from deltarl.codec import encode as enc

    rng = np.random.default_rng(4)
    for every in (3, 200, 399, 401, 5000):
        old = rng.integers(0, 1 << 16, 1 << 16, dtype=np.uint16)
        new = old.copy()
        new[rng.choice(old.size, old.size // every, replace=False)] += np.uint16(1)
        out = {}
        for guess in (True, False):
            monkeypatch.setattr(enc, "_looks_dense", lambda _o, _n, g=guess: g)
            out[guess] = encode_chunk(old, new, "bfloat16", "auto")
        assert out[True] == out[False]
