"""Publisher: the commit protocol, keyframes, digests, resume, one writer per run, pipelined uploads."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from deltarl.errors import ObjectNotFound, RunError, StoreError, WriterConflict
from deltarl.pipeline import RunLayout
from deltarl.pipeline.manifest import HeadRecord
from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.reader import RunReader
from deltarl.pipeline.replay import replay
from deltarl.storage import MemoryStore
from tests.fixtures.runs import TinyTrainer, publish_run, states_equal

pytestmark = pytest.mark.torch


def test_versions_keyframes_digests_and_chain(memory_store):
    exports = publish_run(memory_store, "r", 12, keyframe_interval=5, digest_interval=3, segment_bytes=4096)
    reader = RunReader(memory_store, "r")
    head = reader.head()
    assert head.version == 11
    chain = reader.chain(11, from_version=0)
    assert [m.version for m, _ in chain] == list(range(12))
    assert chain[-1][1] == head.version_id
    for (_, vid), (child, _) in itertools.pairwise(chain):
        assert child.parent == vid
    kinds = {m.version for m, _ in chain if m.kind == "keyframe"}
    assert kinds == {0, 5, 10}
    digests = {m.version for m, _ in chain if m.state_digest is not None}
    assert digests == {0, 3, 5, 6, 9, 10}
    assert chain[0][0].segments == ()
    assert all(m.segments for m, _ in chain[1:])
    m5 = chain[5][0]
    assert m5.keyframe is not None
    assert m5.keyframe.keys == (RunLayout("r").keyframe_part(5, 0, epoch=1),)
    assert 0 < m5.stats.changed_elements < m5.stats.total_elements // 10
    assert states_equal(replay(memory_store, "r", 11), exports[11])


def test_version_info(memory_store):
    trainer = TinyTrainer(1)
    with Publisher(memory_store, "r", keyframe_interval=50) as pub:
        v0 = pub.publish(trainer.export(), step=7)
        trainer.step()
        v1 = pub.publish(trainer.export(), step=8)
    assert (v0.version, v0.kind, v0.step, v0.segment_keys) == (0, "keyframe", 7, ())
    assert v0.keyframe_keys == (RunLayout("r").keyframe_part(0, 0, epoch=1),)
    assert v0.state_digest is not None
    assert (v1.version, v1.kind) == (1, "delta")
    assert v1.segment_keys == (RunLayout("r").segment(1, 0, epoch=1),)
    assert v1.manifest_key == RunLayout("r").manifest(1)
    assert v1.wall_s >= v1.encode_s > 0
    _, vid = RunReader(memory_store, "r").manifest(1)
    assert vid == v1.version_id


def test_many_segments_are_pipelined(memory_store):
    shapes = {"w": ((512, 1024), "bfloat16")}
    trainer = TinyTrainer(0, lr=0.05, shapes=shapes)
    with Publisher(memory_store, "r", segment_bytes=4096, upload_workers=3) as pub:
        pub.publish(trainer.export(), step=0)
        trainer.step()
        info = pub.publish(trainer.export(), step=1)
        assert len(info.segment_keys) > 8
        assert all(memory_store.exists(k) for k in info.segment_keys)
        assert info.upload_s > 0
    assert states_equal(replay(memory_store, "r"), trainer.export())


def test_owned_states_are_adopted_not_copied(memory_store):
    trainer = TinyTrainer(0)
    exports = []
    with Publisher(memory_store, "r") as pub:
        for step in range(5):
            if step:
                trainer.step()
            exports.append(trainer.export())
            kept = {n: t.clone() for n, t in exports[-1].items()}
            pub.publish(exports[-1], step=step, owned=step < 3)  # handed over, then copied
            assert states_equal(exports[-1], kept)  # never written, in either mode
            assert all(a is b for a, b in zip(pub._prev.values(), exports[-1].values(), strict=True)) == (step < 3)
    for v in range(5):
        assert states_equal(replay(memory_store, "r", v), exports[v])


def test_second_writer_conflicts(memory_store):
    trainer = TinyTrainer(0)
    first = Publisher(memory_store, "r", writer_id="a")
    first.publish(trainer.export(), step=0)
    with pytest.raises(WriterConflict, match="already has a publisher"):
        Publisher(memory_store, "r", writer_id="b")
    first.close()
    second = Publisher(memory_store, "r", writer_id="b")  # released claim: b may take over
    trainer.step()
    assert second.publish(trainer.export(), step=1).version == 1
    second.close()


def test_takeover_fences_the_old_writer(memory_store):
    trainer = TinyTrainer(0)
    old = Publisher(memory_store, "r", writer_id="old")
    old.publish(trainer.export(), step=0)
    new = Publisher(memory_store, "r", writer_id="new", takeover=True)
    trainer.step()
    new.publish(trainer.export(), step=1)
    with pytest.raises(WriterConflict, match="lost the writer claim"):
        old.publish(trainer.export(), step=1)
    assert RunReader(memory_store, "r").head().version == 1
    new.close()
    old.close()


def test_expired_lease_allows_takeover(memory_store):
    trainer = TinyTrainer(0)
    old = Publisher(memory_store, "r", writer_id="old", lease_s=0.2)
    old.publish(trainer.export(), step=0)
    time.sleep(0.3)
    new = Publisher(memory_store, "r", writer_id="new")
    with pytest.raises(WriterConflict):
        old.publish(trainer.export(), step=1)
    new.close()


def test_head_moved_underneath_is_a_conflict(memory_store):
    trainer = TinyTrainer(0)
    pub = Publisher(memory_store, "r")
    info = pub.publish(trainer.export(), step=0)
    memory_store.put(RunLayout("r").head, HeadRecord(0, info.version_id, "intruder").to_bytes())
    trainer.step()
    with pytest.raises(WriterConflict, match="moved underneath"):
        pub.publish(trainer.export(), step=1)
    pub.close()


def test_resume_replays_or_takes_previous_state(memory_store):
    trainer = TinyTrainer(0)
    with Publisher(memory_store, "r", writer_id="w", keyframe_interval=4, digest_interval=100) as pub:
        for step in range(6):
            if step:
                trainer.step()
            pub.publish(trainer.export(), step=step)
    prev = trainer.export()
    with Publisher(memory_store, "r", writer_id="w2") as pub:  # resumes by replaying HEAD
        assert pub.next_version == 6
        trainer.step()
        info = pub.publish(trainer.export(), step=6)
        assert info.state_digest is None  # not asked: no whole-state pass on the first version after a resume
        assert info.segment_keys[0] == RunLayout("r").segment(6, 0, epoch=2)  # a new acquire, a new epoch
    with Publisher(memory_store, "r", previous_state=trainer.export(), digest_on_resume=True) as pub:
        trainer.step()
        assert pub.publish(trainer.export(), step=7).state_digest is not None  # asked for
    assert states_equal(replay(memory_store, "r", 7), trainer.export())
    with pytest.raises(RunError, match="digest"):
        Publisher(memory_store, "r", previous_state=prev)  # version 7 records a digest; prev is version 5


def test_resume_keeps_run_json_intervals(memory_store):
    publish_run(memory_store, "r", 2, keyframe_interval=3)
    with Publisher(memory_store, "r", keyframe_interval=50) as pub:
        assert pub.keyframe_interval == 3


def test_incompatible_state_rejected(memory_store):
    from deltarl.errors import TensorMismatch

    publish_run(memory_store, "r", 1)
    with Publisher(memory_store, "r") as pub, pytest.raises(TensorMismatch):
        pub.publish(TinyTrainer(0, shapes={"x": ((3,), "float32")}).export(), step=1)


class FailingStore(MemoryStore):
    """A memory store whose n-th segment put fails (after retries, as a backend would report)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.segment_puts = 0
        self.lock = threading.Lock()

    def put_if_absent(self, key: str, data: bytes) -> str:
        if key.endswith(".bin"):
            with self.lock:
                self.segment_puts += 1
                if self.segment_puts == self.fail_at:
                    raise StoreError(f"injected failure writing {key}")
        return super().put_if_absent(key, data)


def test_failed_upload_commits_nothing_and_retry_works():
    store = FailingStore(fail_at=3)
    shapes = {"w": ((256, 512), "bfloat16")}
    trainer = TinyTrainer(0, lr=0.05, shapes=shapes)
    with Publisher(store, "r", segment_bytes=4096) as pub:
        pub.publish(trainer.export(), step=0)
        trainer.step()
        with pytest.raises(StoreError, match="injected"):
            pub.publish(trainer.export(), step=1)
        lay = RunLayout("r")
        assert not store.exists(lay.manifest(1))
        assert RunReader(store, "r").head().version == 0
        assert list(store.list(lay.version_prefix(1))) == []  # the attempt's segments were removed
        info = pub.publish(trainer.export(), step=1)
        assert info.version == 1
    assert states_equal(replay(store, "r"), trainer.export())


def test_numpy_state(memory_store):
    state = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, dtype=np.float16)}
    with Publisher(memory_store, "r") as pub:
        pub.publish(state, step=0)
        state["a"][1, 2] = 100.0
        pub.publish(state, step=1)
    out = replay(memory_store, "r")
    assert np.array_equal(out["a"].numpy(), state["a"])
    assert np.array_equal(out["b"].numpy(), state["b"])
    with pytest.raises(ObjectNotFound):
        replay(memory_store, "r", 2)


class FlakyHeadStore(MemoryStore):
    """HEAD's next compare-and-swap fails once, either before writing or after (an ambiguous failure)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_next: str | None = None

    def cas(self, key: str, data: bytes, expected_etag: str | None) -> str:
        mode, self.fail_next = (self.fail_next, None) if key.endswith("/HEAD") else (None, self.fail_next)
        if mode == "after":
            super().cas(key, data, expected_etag)
        if mode is not None:
            raise StoreError(f"injected HEAD failure ({mode})")
        return super().cas(key, data, expected_etag)


@pytest.mark.parametrize("mode", ["before", "after"])
def test_head_cas_failure_is_repaired_on_next_publish(mode, caplog):
    """The manifest is the commit: a HEAD swap that fails after it does not fail the publish (a
    caller retrying it would publish the same step twice); HEAD lags, and the next publish repairs it."""
    store = FlakyHeadStore()
    trainer = TinyTrainer(0)
    exports = []
    with Publisher(store, "r") as pub:
        for step in range(4):
            if step:
                trainer.step()
            exports.append(trainer.export())
            if step == 2:
                store.fail_next = mode
                with caplog.at_level("WARNING"):
                    assert pub.publish(exports[-1], step=step).version == 2
                assert "version 2 is committed, but moving HEAD failed (injected HEAD failure" in caplog.text
                assert store.exists(RunLayout("r").manifest(2))
                assert RunReader(store, "r").head().version == (2 if mode == "after" else 1)  # HEAD may lag
            else:
                pub.publish(exports[-1], step=step)
    assert RunReader(store, "r").head().version == 3
    for v in range(4):
        assert states_equal(replay(store, "r", v), exports[v])


@pytest.mark.s3
def test_racing_writers_on_seaweedfs_never_fork(seaweed_store):
    """Writers with short leases keep taking the run from each other on a real S3 server; the history
    stays one linear, replayable chain."""
    errors: list[BaseException] = []
    conflicts = [0]

    def writer(i: int) -> None:
        trainer = TinyTrainer(i)
        published = 0
        deadline = time.monotonic() + 20
        while published < 3 and time.monotonic() < deadline:
            try:
                with Publisher(seaweed_store, "r", writer_id=f"w{i}", lease_s=0.5) as pub:
                    for _ in range(2):
                        trainer.step()
                        pub.publish(trainer.export(), step=i)
                        published += 1
            except WriterConflict:
                conflicts[0] += 1
                time.sleep(0.05 * (i + 1))
            except BaseException as err:
                errors.append(err)
                return

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    reader = RunReader(seaweed_store, "r")
    head = reader.head()
    assert head.version >= 3
    chain = reader.chain(head.version, from_version=0)
    assert [m.version for m, _ in chain] == list(range(head.version + 1))
    replay(seaweed_store, "r", verify=True)


def _refused(good: dict, kind: str) -> dict:
    """``good`` spoiled one way the publisher refuses before it writes anything."""
    import torch

    name = sorted(good)[0]
    bad = {k: v.clone() for k, v in good.items()}
    if kind == "empty state":
        return {}
    if kind == "not contiguous":
        bad[name] = torch.stack([good[name], good[name]], dim=-1)[..., 0]  # same values, strided
        assert not bad[name].is_contiguous()
    elif kind == "wrong dtype":
        bad[name] = torch.zeros(good[name].shape, dtype=torch.int64)
    elif kind == "not a tensor":
        bad[name] = good[name].tolist()
    elif kind == "meta tensor":
        bad[name] = torch.empty(good[name].shape, dtype=good[name].dtype, device="meta")
    elif kind == "NaN":
        bad[name].view(-1)[0] = float("nan")
    elif kind == "empty name":
        bad[""] = bad.pop(name)
    return bad


REFUSALS = {"empty state": "empty state", "not contiguous": "is not contiguous", "wrong dtype": "unsupported torch dtype",
            "not a tensor": "expected a torch tensor", "meta tensor": "meta device", "NaN": "NaN/Inf",
            "empty name": "names must be non-empty strings"}


@pytest.mark.parametrize("owned", [False, True], ids=["copied", "owned"])
@pytest.mark.parametrize("kind", sorted(REFUSALS))
@pytest.mark.parametrize("store_kind", ["memory", "local"])
def test_a_refused_publish_writes_nothing_and_leaves_the_publisher_usable(tmp_path, store_kind, kind, owned):
    """One rule (issue 33.13): every refusal of a state (empty, a tensor that is not contiguous, of
    a dtype the format lacks, not a tensor, on the meta device, holding NaN, an empty name) comes
    before anything is written or the claim renewed, so the same publisher publishes that version
    next, as a first publish and as a later one; run.json appears only with the first commit."""
    from deltarl.errors import DeltaRLError
    from deltarl.storage import LocalStore

    store = MemoryStore() if store_kind == "memory" else LocalStore(tmp_path / "store")
    lay = RunLayout("e")
    trainer = TinyTrainer(0)
    with Publisher(store, "e") as pub:
        good = trainer.export()
        with pytest.raises(DeltaRLError, match=REFUSALS[kind]):
            pub.publish(_refused(good, kind), 0, owned=owned)
        assert [k for k in store.list("e/") if k != lay.writer] == []
        assert pub.publish(good, 0, owned=owned).version == 0
        trainer.step()
        later = trainer.export()
        written = sorted(store.list("e/"))
        with pytest.raises(DeltaRLError, match=REFUSALS[kind]):
            pub.publish(_refused(later, kind), 1, owned=owned)
        assert sorted(store.list("e/")) == written
        assert pub.publish(later, 1, owned=owned).version == 1
    assert states_equal(replay(store, "e", 0), good)
    assert states_equal(replay(store, "e", 1), later)
