"""Staged, transactional apply of deltas: round trips, idempotence, rollback, every refusal."""

from __future__ import annotations

import numpy as np
import pytest

from deltarl.codec import (
    BF16,
    apply_delta,
    delta_stats,
    encode_delta,
    iter_encode_delta,
    stage_delta,
    state_digest,
)
from deltarl.codec.stager import Stager
from deltarl.codec.tensors import check_compatible, tensor_table
from deltarl.errors import BaseMismatch, FormatError, StagingError, TensorMismatch


def _pair(seed: int = 0, n: int = 50_000, frac: float = 0.02) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    old = {
        "a.weight": rng.standard_normal((n // 100, 100)).astype(np.float32),
        "b.bias": rng.standard_normal(n // 10).astype(np.float16),
        "c": BF16(rng.integers(0, 1 << 16, n, dtype=np.uint16)),
    }
    new = {}
    for name, v in old.items():
        bits = (v.bits if isinstance(v, BF16) else v).copy()
        flat = bits.reshape(-1).view(np.uint16 if bits.dtype.itemsize == 2 else np.uint32)
        idx = rng.choice(flat.size, int(frac * flat.size), replace=False)
        flat[idx] += rng.integers(1, 5, idx.size).astype(flat.dtype)
        new[name] = BF16(bits) if isinstance(v, BF16) else bits
    return old, new


def _copy(state: dict) -> dict:
    return {k: BF16(v.bits.copy()) if isinstance(v, BF16) else v.copy() for k, v in state.items()}


@pytest.mark.parametrize("codec", ["auto", "aurora", "rice", "dense", "ctx", "sparse"])
def test_apply_round_trip_small_segments(codec: str) -> None:
    old, new = _pair()
    segs = encode_delta(old, new, base="v1", segment_bytes=512, codec=codec)
    assert len(segs) > 1
    state = _copy(old)
    apply_delta(state, reversed(segs), base="v1")
    assert state_digest(state) == state_digest(new)
    stats = delta_stats(segs)
    assert stats.total_elements == sum(s.numel for s in tensor_table(old))
    assert stats.encoded_bytes == sum(map(len, segs))


def test_commit_twice_and_rollback() -> None:
    old, new = _pair(1)
    state = _copy(old)
    upd = stage_delta(state, encode_delta(old, new, base="b"), base="b")
    assert state_digest(state) == state_digest(old)  # staging writes nothing
    upd.commit()
    upd.commit()
    assert state_digest(state) == state_digest(new)
    upd.rollback()
    assert state_digest(state) == state_digest(old)
    assert upd.base == "b"
    assert upd.tensors == ("a.weight", "b.bias", "c")


def test_commit_refuses_a_state_that_moved_on() -> None:
    old, new = _pair(2)
    state = _copy(old)
    upd = stage_delta(state, encode_delta(old, new, base="b"), base="b")
    before = state_digest(state)
    w = state["b.bias"].view(np.uint16)
    pos = np.flatnonzero(old["b.bias"].view(np.uint16) != new["b.bias"].view(np.uint16))[0]
    w[pos] ^= 0x8000
    before = state_digest(state)
    with pytest.raises(StagingError, match="changed since"):
        upd.commit()
    assert state_digest(state) == before  # nothing half-applied


def test_wrong_base_and_mismatches() -> None:
    old, new = _pair(3)
    segs = encode_delta(old, new, base="v7")
    state = _copy(old)
    with pytest.raises(BaseMismatch):
        apply_delta(state, segs, base="v8")
    bad = _copy(old)
    bad["b.bias"] = bad["b.bias"].astype(np.float32)
    with pytest.raises(TensorMismatch, match=r"b\.bias"):
        apply_delta(bad, segs, base="v7")
    bad = _copy(old)
    bad["a.weight"] = bad["a.weight"].reshape(100, -1)
    with pytest.raises(TensorMismatch, match=r"a\.weight"):
        apply_delta(bad, segs, base="v7")
    bad = _copy(old)
    del bad["c"]
    with pytest.raises(TensorMismatch, match="'c'"):
        apply_delta(bad, segs, base="v7")
    assert state_digest(state) == state_digest(old)


def test_a_batch_of_segments_is_staged_all_or_nothing() -> None:
    old, new = _pair(4)
    segs = encode_delta(old, new, base="b", segment_bytes=512)
    assert len(segs) >= 3
    state = _copy(old)
    st = Stager(state, base="b")
    with pytest.raises(FormatError, match="already staged"):
        st.add_segments([segs[0], segs[1], segs[0]])  # a duplicate within one batch
    with pytest.raises(FormatError):
        st.add_segments([segs[0], segs[1][:-1]])  # a truncated one: the good one is not kept either
    st.add_segments(segs)  # the failed batches left nothing behind
    st.finish().commit()
    assert state_digest(state) == state_digest(new)


def test_stager_rejects_duplicates_missing_and_reuse() -> None:
    old, new = _pair(4)
    segs = encode_delta(old, new, base="b", segment_bytes=512)
    state = _copy(old)
    st = Stager(state, base="b")
    st.add_segment(segs[0])
    with pytest.raises(FormatError, match="already staged"):
        st.add_segment(segs[0])
    with pytest.raises(FormatError):
        st.add_segment(segs[1][:-1])
    for s in segs[1:-1]:
        st.add_segment(s)
    with pytest.raises(StagingError, match="incomplete"):
        st.finish()
    st.add_segment(segs[-1])  # the failed calls left the stager usable
    upd = st.finish()
    with pytest.raises(StagingError):
        st.add_segment(segs[0])
    with pytest.raises(StagingError):
        st.finish()
    upd.commit()
    assert state_digest(state) == state_digest(new)


def test_iter_encode_yields_incrementally() -> None:
    old, new = _pair(5)
    it = iter_encode_delta(old, new, base="b", segment_bytes=512)
    first = next(it)
    assert first[:4] == b"DRLS"
    assert len(list(it)) >= 1


def test_uint16_numpy_is_not_guessed_as_bf16() -> None:
    with pytest.raises(TensorMismatch, match="BF16"):
        tensor_table({"x": np.zeros(3, dtype=np.uint16)})


def test_import_is_light() -> None:
    import subprocess
    import sys

    code = "import sys, deltarl.pipeline; assert 'torch' not in sys.modules and 'numba' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_numpy_states_stage_and_commit_without_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from deltarl.codec import BF16, encode_delta, stage_delta\n"
        "old = {'w': BF16(np.arange(10000, dtype=np.uint16))}\n"
        "new = {'w': BF16(old['w'].bits.copy())}\n"
        "new['w'].bits[::7] += 1\n"
        "st = {'w': BF16(old['w'].bits.copy())}\n"
        "stage_delta(st, encode_delta(old, new, base='b'), base='b').commit()\n"
        "assert np.array_equal(st['w'].bits, new['w'].bits)\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_check_compatible_and_tensor_table() -> None:
    old, _ = _pair(6)
    table = tensor_table(old)
    assert [(t.name, t.dtype, t.shape) for t in table] == [
        ("a.weight", "float32", (500, 100)),
        ("b.bias", "float16", (5000,)),
        ("c", "bfloat16", (50000,)),
    ]
    check_compatible(old, table)
    with pytest.raises(TensorMismatch, match="missing"):
        check_compatible({"a.weight": old["a.weight"]}, table)
    with pytest.raises(TensorMismatch, match="float32"):
        check_compatible({**old, "a.weight": old["a.weight"].astype(np.float16)}, table)


def test_non_contiguous_and_read_only_states_are_refused() -> None:
    old, new = _pair(7)
    segs = encode_delta(old, new, base="b")
    state = _copy(old)
    state["a.weight"] = np.asfortranarray(state["a.weight"])
    with pytest.raises(TensorMismatch, match="contiguous"):
        stage_delta(state, segs, base="b")
    state = _copy(old)
    upd = stage_delta(state, segs, base="b")
    state["b.bias"].flags.writeable = False
    with pytest.raises(TensorMismatch, match="read-only"):
        upd.commit()
    assert state_digest(state) == state_digest(old)  # nothing half-applied
    state["b.bias"] = state["b.bias"][:-1].copy()
    with pytest.raises(TensorMismatch, match="replaced or reshaped"):
        upd.commit()
    assert state_digest({k: v for k, v in state.items() if k != "b.bias"}) == state_digest(
        {k: v for k, v in old.items() if k != "b.bias"}
    )


def test_empty_state_and_zero_size_tensors() -> None:
    assert len(encode_delta({}, {}, base="e")) == 1
    apply_delta({}, encode_delta({}, {}, base="e"), base="e")
    z = {"z": np.zeros((0, 4), dtype=np.float32)}
    segs = encode_delta(z, z, base="e")
    assert delta_stats(segs).total_elements == 0
    apply_delta({"z": np.zeros((0, 4), dtype=np.float32)}, segs, base="e")


@pytest.mark.parametrize("threads", ["1", "2", "3", "8"])
def test_thread_count_does_not_change_bytes(monkeypatch: pytest.MonkeyPatch, threads: str) -> None:
    old, new = _pair(8)
    monkeypatch.setenv("DELTARL_THREADS", "1")
    want = encode_delta(old, new, base="b", segment_bytes=2048)
    want_changes = stage_delta(_copy(old), want, base="b").changes()
    monkeypatch.setenv("DELTARL_THREADS", threads)
    assert encode_delta(old, new, base="b", segment_bytes=2048) == want
    state = _copy(old)
    upd = stage_delta(state, want, base="b")
    for name, arrays in upd.changes().items():
        for got, exp in zip(arrays, want_changes[name], strict=True):
            assert np.array_equal(got, exp)
    upd.commit()
    assert state_digest(state) == state_digest(new)


def test_segments_end_by_changed_elements_as_well_as_bytes() -> None:
    old = {"w": np.zeros(1 << 16, dtype=np.float32)}
    new = {"w": old["w"].copy()}
    new["w"][::50] = 1.0  # 1311 changes in 16 chunks of 4096 elements (segment_bytes // 4)
    by_bytes = encode_delta(old, new, base="b", segment_bytes=1 << 14)
    assert len(by_bytes) == 1
    by_changes = encode_delta(old, new, base="b", segment_bytes=1 << 14, segment_changes=160)
    assert len(by_changes) == 8  # two chunks (164 changes) per segment
    counts = [delta_stats([s]).changed_elements for s in by_changes]
    assert sum(counts) == 1311
    assert all(160 <= c <= 165 for c in counts)
    state = _copy(old)
    apply_delta(state, by_changes, base="b")
    assert state_digest(state) == state_digest(new)
    with pytest.raises(ValueError, match="segment_changes"):
        encode_delta(old, new, base="b", segment_changes=0)


def test_a_one_percent_delta_of_a_1_7b_model_is_at_least_eight_segments() -> None:
    from deltarl.codec.encode import SEGMENT_CHANGES, chunk_elements

    changes = int(0.01 * 1.72e9)
    per_chunk = int(0.01 * chunk_elements(16 << 20))  # a segment ends at a chunk boundary
    assert changes // (SEGMENT_CHANGES + per_chunk) >= 8
