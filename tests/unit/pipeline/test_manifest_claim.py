"""The WRITER claim record and lease: acquire, renew, release, conflicts, fencing."""

from __future__ import annotations

import pytest

from deltarl.errors import FormatError, UnsupportedFormatVersion, WriterConflict
from deltarl.pipeline import RunLayout
from deltarl.pipeline.claim import WriterClaim, WriterLease, fence_claim, read_claim
from deltarl.pipeline.manifest import canonical_json
from deltarl.storage import MemoryStore

KEY = RunLayout("r").writer


def test_claim_record_roundtrip_and_strictness():
    claim = WriterClaim("w", 1, 2, "host", 3)
    assert WriterClaim.from_bytes(claim.to_bytes()) == claim
    with pytest.raises(UnsupportedFormatVersion):
        WriterClaim.from_bytes(canonical_json({"format_version": 2}))
    with pytest.raises(FormatError):
        WriterClaim.from_bytes(b'{"format_version":3,"writer_id":"w"}')


def test_lease_lifecycle():
    store = MemoryStore()
    a = WriterLease(store, "r", "a", lease_s=60)
    a.acquire()
    assert a.held
    claim, _ = read_claim(store, KEY)
    assert claim.writer_id == "a"
    with pytest.raises(WriterConflict, match="writer 'a'"):
        WriterLease(store, "r", "b").acquire()
    a.renew()
    WriterLease(store, "r", "a").acquire()  # same writer id: a restart resumes at once
    with pytest.raises(WriterConflict, match="lost the writer claim"):
        a.renew()  # the restarted "a" replaced this lease's ETag


def test_release_and_fence():
    store = MemoryStore()
    assert fence_claim(store, "r", "gc") is None
    a = WriterLease(store, "r", "a", lease_s=60)
    a.acquire()
    with pytest.raises(WriterConflict, match="live publisher"):
        fence_claim(store, "r", "gc")
    assert fence_claim(store, "r", "gc", force=True).writer_id == "a"
    with pytest.raises(WriterConflict):
        a.renew()
    b = WriterLease(store, "r", "b")
    b.acquire()  # the fence expires at once
    b.release()
    c = WriterLease(store, "r", "c")
    c.acquire()
    assert read_claim(store, KEY)[0].writer_id == "c"


def test_unreadable_claim_is_a_conflict():
    store = MemoryStore()
    store.put(KEY, b"garbage")
    with pytest.raises(WriterConflict, match="unreadable"):
        WriterLease(store, "r", "a").acquire()


def test_epoch_increments_on_every_acquire_and_fences():
    store = MemoryStore()
    a = WriterLease(store, "r", "a", lease_s=60)
    a.acquire()
    assert a.epoch == 1
    assert read_claim(store, KEY)[0].epoch == 1
    a.renew()
    assert read_claim(store, KEY)[0].epoch == 1  # a renew keeps the epoch
    b = WriterLease(store, "r", "a", lease_s=60)  # a restart with the same writer id
    b.acquire()
    assert b.epoch == 2
    c = WriterLease(store, "r", "c", lease_s=60, takeover=True)
    c.acquire()
    assert c.epoch == 3
    with pytest.raises(WriterConflict, match="fenced by epoch 3"):
        b.renew()
    assert fence_claim(store, "r", "gc", force=True).epoch == 3
    assert read_claim(store, KEY)[0].epoch == 4  # gc's fencing is an acquire too
