"""Publisher.publish_async: one publish in flight, in version order; failures on the future and
again on the next call; owned / copied states; on a real (local) store."""

from __future__ import annotations

import threading

import pytest

from deltarl.errors import PublishFailed, StoreError, TransientStoreError
from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.reader import RunReader
from deltarl.pipeline.replay import replay
from deltarl.storage import LocalStore, MemoryStore
from tests.fixtures.runs import TinyTrainer, states_equal

pytestmark = pytest.mark.torch


class GatedStore(MemoryStore):
    """A memory store whose segment puts of one version wait for a gate, or fail."""

    def __init__(self, version: int, *, fail: bool = False) -> None:
        super().__init__()
        self.marker = f"/versions/{version:012d}/"
        self.fail = fail
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put_if_absent(self, key: str, data: bytes) -> None:  # type: ignore[override]
        if self.marker in key and key.endswith(".bin"):
            self.entered.set()
            if not self.gate.wait(30):
                raise TimeoutError("gate never opened")
            if self.fail:
                raise TransientStoreError(f"injected failure writing {key}")
        super().put_if_absent(key, data)


def test_versions_commit_in_order_and_the_caller_runs_meanwhile(local_store: LocalStore) -> None:
    trainer = TinyTrainer(0)
    exports = []
    with Publisher(local_store, "r", segment_bytes=4096) as pub:
        futures = []
        for step in range(5):
            if step:
                trainer.step()  # the next step runs while the previous version publishes
            export = trainer.export()
            exports.append({n: t.clone() for n, t in export.items()})
            futures.append(pub.publish_async(export, step, owned=True))
            if step:
                assert futures[-2].done()  # a second call waits for the first: one in flight
        assert pub.wait() == futures[-1].result()
    infos = [f.result() for f in futures]
    assert [i.version for i in infos] == list(range(5))
    chain = RunReader(local_store, "r").chain(4, from_version=0)
    assert [vid for _, vid in chain] == [i.version_id for i in infos]
    for v in (2, 4):
        assert states_equal(replay(local_store, "r", v), exports[v])


def test_publish_overlaps_the_callers_next_step() -> None:
    store = GatedStore(1)
    trainer = TinyTrainer(1, shapes={"w": ((256, 256), "bfloat16")})
    with Publisher(store, "r", segment_bytes=4096) as pub:
        pub.publish(trainer.export(), 0, owned=True)
        trainer.step()
        fut = pub.publish_async(trainer.export(), 1, owned=True)
        assert store.entered.wait(30)
        assert not fut.done()  # publishing is blocked in the store, yet we are back: the trainer steps
        trainer.step()
        store.gate.set()
        assert fut.result(30).version == 1


def test_a_failure_surfaces_on_the_future_and_on_the_next_call() -> None:
    store = GatedStore(1, fail=True)
    store.gate.set()
    trainer = TinyTrainer(2)
    with Publisher(store, "r", segment_bytes=4096) as pub:
        pub.publish_async(trainer.export(), 0, owned=True).result(30)
        trainer.step()
        export = trainer.export()
        fut = pub.publish_async(export, 1, owned=True)
        with pytest.raises(StoreError, match="injected"):
            fut.result(30)
        with pytest.raises(PublishFailed, match="injected") as err:
            pub.publish_async(trainer.export(), 1)
        assert isinstance(err.value.__cause__, TransientStoreError)
        store.fail = False  # raised once: the publisher goes on with the same version
        info = pub.publish_async(export, 1).result(30)
    assert info.version == 1
    assert states_equal(replay(store, "r", 1), export)


def test_a_failure_is_raised_by_a_following_synchronous_publish() -> None:
    store = GatedStore(1, fail=True)
    store.gate.set()
    trainer = TinyTrainer(3)
    with Publisher(store, "r", segment_bytes=4096) as pub:
        pub.publish(trainer.export(), 0)
        trainer.step()
        pub.publish_async(trainer.export(), 1)
        with pytest.raises(PublishFailed):
            pub.publish(trainer.export(), 1)
        assert pub.wait() is None


def test_owned_states_are_adopted_and_copied_states_are_free_to_change(memory_store: MemoryStore) -> None:
    trainer = TinyTrainer(4)
    with Publisher(memory_store, "r", segment_bytes=4096) as pub:
        owned = trainer.export()
        pub.publish_async(owned, 0, owned=True)
        pub.wait()
        assert all(pub._prev[n] is t for n, t in owned.items())  # adopted: no copy
        trainer.step()
        mine = trainer.export()
        want = {n: t.clone() for n, t in mine.items()}
        pub.publish_async(mine, 1)  # owned=False: copied before returning
        for t in mine.values():
            t.zero_()  # the caller reuses its tensors at once
        pub.wait()
        assert not any(pub._prev[n] is t for n, t in mine.items())
    assert states_equal(replay(memory_store, "r", 1), want)
