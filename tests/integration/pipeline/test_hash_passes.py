"""One hash pass per byte: every byte published is hashed once on the way out, and every byte read
(through a relay, by an actor, by replay) is hashed once by each process that checks it.

The one BLAKE3 constructor every hash goes through (``deltarl.codec.hashing._blake3``) is wrapped
so that each call counts its bytes, by the first deltarl module on the stack that asked for it (the
publisher, a keyframe writer, the relay, the actor's fetcher, replay's reader, the state digest).
Interior nodes of the hash tree (pieces, roots, the digest's composition: 32 bytes per 64 KiB
block) are counted apart from the data.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from typing import Any

import pytest

from deltarl.codec import hashing
from deltarl.storage import MemoryStore
from tests.fixtures.relays import StartRelay
from tests.fixtures.runs import TinyTrainer, states_equal

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

#: Big enough for several parts, pieces and segments; small enough for a unit of seconds.
SHAPES: dict[str, tuple[tuple[int, ...], str]] = {
    "embed.weight": ((640, 256), "bfloat16"),
    "layers.0.attn.weight": ((256, 256), "bfloat16"),
    "layers.0.mlp.weight": ((1024, 256), "bfloat16"),
    "layers.0.norm.bias": ((256,), "float32"),
    "lm_head.weight": ((300, 256), "float16"),
}
KW = {"keyframe_interval": 3, "digest_interval": 1000, "keyframe_part_bytes": 256 << 10, "piece_size": 64 << 10,
      "segment_bytes": 64 << 10}  # fmt: skip
_PASS_THROUGH = ("deltarl.codec.hashing", "deltarl.pipeline.pieces", "deltarl.pipeline.manifest")


class HashCounter:
    """Wraps the BLAKE3 constructor: data bytes hashed per asking module, and interior-node bytes."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.data: Counter[str] = Counter()
        self.tree = 0
        self.lock = threading.Lock()

    def __call__(self, data: Any = b"", **kw: Any) -> Any:
        n = memoryview(data).nbytes
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(_PASS_THROUGH):
            frame = frame.f_back
        role = frame.f_globals.get("__name__", "?") if frame is not None else "?"
        with self.lock:
            if "derive_key_context" in kw:
                self.tree += n
            else:
                self.data[role] += n
        return self.real(data, **kw)

    def take(self) -> tuple[Counter[str], int]:
        with self.lock:
            out, tree = self.data, self.tree
            self.data, self.tree = Counter(), 0
        return out, tree

    def by_part(self, data: Counter[str]) -> Counter[str]:
        return Counter({part: sum(n for m, n in data.items() if m.startswith(f"deltarl.{part}")) for part in
                        ("pipeline", "relay", "actor", "codec")})  # fmt: skip


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> HashCounter:
    c = HashCounter(hashing._blake3)
    monkeypatch.setattr(hashing, "_blake3", c)
    return c


def _objects(store: MemoryStore, run: str, version: int) -> int:
    """Bytes of every object version ``version`` wrote (segments, keyframe parts, manifest)."""
    from deltarl.pipeline.layout import RunLayout

    lay = RunLayout(run)
    keys = [*store.list(lay.version_prefix(version)), *store.list(lay.keyframe_prefix(version))]
    return sum(store.head(k).size for k in keys)


def _publish(store: MemoryStore, counter: HashCounter, versions: int, **kw: Any) -> list[dict[str, Any]]:
    from deltarl.pipeline.publisher import Publisher

    trainer = TinyTrainer(0, shapes=SHAPES, lr=2e-2)
    exports = []
    with Publisher(store, "r", writer_id="w", **{**KW, **kw}) as pub:
        counter.take()
        for step in range(versions):
            if step:
                trainer.step()
            export = trainer.export()
            info = pub.publish(export, step=step)
            data, tree = counter.take()
            written = _objects(store, "r", step)
            state = sum(t.numel() * t.element_size() for t in export.values())
            digest = state if info.state_digest is not None and info.kind == "delta" else 0
            assert sum(data.values()) == written + digest, (step, info.kind, data, written)
            assert data["deltarl.codec.tensors"] == digest  # a keyframe's digest is composed, never hashed
            assert tree <= written // 1000 + 4096  # interior nodes: 32 bytes per 64 KiB block, and the roots
            exports.append({n: t.clone() for n, t in export.items()})
    return exports


def test_publishing_hashes_each_byte_written_once(counter: HashCounter) -> None:
    store = MemoryStore()
    _publish(store, counter, 5)  # keyframe 0, deltas 1 2, keyframe (and delta) 3, delta 4
    _publish(MemoryStore(), counter, 3, digest_interval=2)  # a delta digest: one pass over the state


def test_replay_with_verify_hashes_each_byte_read_once(counter: HashCounter) -> None:
    from deltarl.pipeline.replay import replay

    store = MemoryStore()
    exports = _publish(store, counter, 3)
    read = sum(_objects(store, "r", v) for v in range(3))
    state = replay(store, "r", 2, verify=True)
    assert states_equal(state, exports[2])
    data, _ = counter.take()
    assert sum(data.values()) == read == counter.by_part(data)["pipeline"], data

    store = MemoryStore()
    exports = _publish(store, counter, 3, digest_interval=2)  # version 2 records a digest: verify hashes the state once
    read = sum(_objects(store, "r", v) for v in range(3))
    assert states_equal(replay(store, "r", 2, verify=True), exports[2])
    data, _ = counter.take()
    assert data["deltarl.codec.tensors"] == sum(t.numel() * t.element_size() for t in exports[2].values())
    assert sum(data.values()) - data["deltarl.codec.tensors"] == read


@pytest.mark.parametrize("check_on_serve", [False, True])
async def test_bootstrap_through_a_relay_hashes_each_byte_once_per_process(counter: HashCounter, start_relay: StartRelay,
                                                                           check_on_serve: bool) -> None:
    from deltarl.actor.fetcher import Fetcher
    from deltarl.actor.subscriber import Subscriber

    origin = MemoryStore()
    exports = _publish(origin, counter, 3)  # keyframe 0, deltas 1 2
    objects = sum(_objects(origin, "r", v) for v in range(3))
    relay = await start_relay(origin, check_on_serve=check_on_serve)
    model = {name: torch.zeros_like(t) for name, t in exports[-1].items()}
    async with Fetcher([relay.url], streams=4, range_bytes=256 << 10) as fetcher, Subscriber(model, "r", fetcher) as sub:
        info = await sub.bootstrap()
    assert info.version == 2
    assert states_equal(model, exports[2])
    data, _ = counter.take()
    parts = counter.by_part(data)
    pulled = relay.counters()["deltarl_relay_upstream_bytes_total"]
    # every byte the relay pulled, once (HEAD, run.json and model.json too); with check_on_serve, a
    # whole object served from its cache (not from a pull in flight) is checked against the disk again
    assert data["deltarl.relay.pull"] == pulled, data
    assert parts["relay"] == pulled if not check_on_serve else pulled <= parts["relay"] <= 2 * pulled, data
    assert parts["actor"] + parts["pipeline"] == objects, data  # every object the actor read, once; no state digest
    assert parts["codec"] == 0
