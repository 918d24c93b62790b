"""The three ways of keeping actors fresh, each as a trainer-side publisher and an actor.

* **ideal**: a version is at every actor the moment the trainer has it (one RDMA cluster).
* **full**: the trainer writes the full BF16 state every step as raw shards plus an index (written
  last) to the origin store; actors long-poll the index through their relay, fetch the shards on
  several streams into a staging copy while generating, and copy it in at the batch boundary.
* **deltarl**: the real :class:`~deltarl.Publisher` (extract, encode, upload, manifest,
  HEAD) and the real :class:`~deltarl.actor.subscriber.Subscriber` (long-poll, multi-stream fetch,
  decode into a stager as segments arrive, commit in place at the boundary).

Every actor exposes the same small surface to the step driver: ``staged()`` (the version ready to
commit, if any), ``wait_changed()``, ``commit()`` and ``staged_at`` (when each version became
ready, monotonic seconds).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from deltarl.actor.fetcher import Fetcher
from deltarl.actor.subscriber import Subscriber
from deltarl.codec import BF16
from deltarl.errors import ObjectNotFound, TransferError
from deltarl.pipeline.manifest import ObjectRef
from deltarl.pipeline.publisher import Publisher
from deltarl.storage.store import ObjectStore

State = dict[str, BF16]
WATCH_S = 0.005


def copy_state(state: Mapping[str, BF16]) -> State:
    return {name: BF16(t.bits.copy()) for name, t in state.items()}


class Actor:
    """What the driver needs from an actor of any mode."""

    name: str

    def __init__(self, name: str) -> None:
        self.name = name
        self.version = 0
        self.staged_at: dict[int, float] = {}
        self.pauses: list[float] = []
        self._changed = asyncio.Event()

    async def start(self) -> None:
        """Begin prefetching in the background."""

    async def close(self) -> None:
        """Stop background work."""

    def staged(self) -> int | None:
        raise NotImplementedError

    def commit(self) -> None:
        raise NotImplementedError

    async def wait_changed(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    def _mark_staged(self, version: int) -> None:
        self.staged_at.setdefault(version, time.monotonic())
        self._changed.set()

    async def advance_to(self, need: int) -> None:
        """At a window's start: commit what is staged, then wait and commit until at least ``need``."""
        if self.staged() is not None:
            self.commit()
        while self.version < need:
            if self.staged() is None:
                await self.wait_changed()
                continue
            self.commit()


# --- ideal ------------------------------------------------------------------------------------------


class IdealBoard:
    """The 'cluster': publishing a version makes it present at every actor at once."""

    def __init__(self) -> None:
        self.latest = 0
        self.actors: list[IdealActor] = []

    def publish(self, state: Mapping[str, BF16], version: int) -> dict[str, Any]:
        self.latest = version
        for actor in self.actors:
            actor._mark_staged(version)
        return {}


class IdealActor(Actor):
    def __init__(self, name: str, board: IdealBoard) -> None:
        super().__init__(name)
        self.board = board
        board.actors.append(self)

    def staged(self) -> int | None:
        return self.board.latest if self.board.latest > self.version else None

    def commit(self) -> None:
        self.version = self.board.latest
        self.pauses.append(0.0)


# --- full broadcast ---------------------------------------------------------------------------------


def full_index_key(run: str, version: int) -> str:
    return f"{run}/full/{version:012d}/index.json"


class FullPublisher:
    """Full BF16 weights every version: raw shards uploaded in parallel, then the index."""

    def __init__(self, store: ObjectStore, run: str, *, shard_bytes: int, workers: int = 4) -> None:
        self.store, self.run, self.shard_bytes = store, run, shard_bytes
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="full-upload")

    def publish(self, state: Mapping[str, BF16], version: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        blob = b"".join(t.bits.tobytes() for _, t in sorted(state.items()))
        prefix = f"{self.run}/full/{version:012d}/"

        def put(i: int) -> ObjectRef:
            data = blob[i * self.shard_bytes : (i + 1) * self.shard_bytes]
            key = f"{prefix}shard-{i:05d}.bin"
            self.store.put_if_absent(key, data)
            return ObjectRef.of(key, data)

        refs = list(self._pool.map(put, range(-(-len(blob) // self.shard_bytes))))
        index = {"version": version, "shard_bytes": self.shard_bytes, "shards": [r.to_obj() for r in refs]}
        self.store.put_if_absent(full_index_key(self.run, version), json.dumps(index).encode())
        return {"bytes": len(blob), "objects": len(refs), "wall_s": time.perf_counter() - t0}

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class FullActor(Actor):
    """Prefetches whole states into one staging buffer; the commit copies it into the live state."""

    def __init__(self, name: str, state: State, run: str, fetcher: Fetcher, *, poll_wait_s: float) -> None:
        super().__init__(name)
        self.state, self.run, self.fetcher, self.poll_wait_s = state, run, fetcher, poll_wait_s
        self._names = sorted(state)
        self._buf = bytearray(sum(t.bits.nbytes for t in state.values()))
        self._staged: int | None = None
        self._free = asyncio.Event()
        self._free.set()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        version = self.version + 1
        while True:
            await self._free.wait()
            try:
                index = json.loads(await self.fetcher.fetch_key(full_index_key(self.run, version), wait_s=self.poll_wait_s))
            except (ObjectNotFound, TransferError):
                continue
            step = index["shard_bytes"]
            refs = [ObjectRef.from_obj(r, where="index") for r in index["shards"]]
            offsets = {r.key: i * step for i, r in enumerate(refs)}
            async for ref, data in self.fetcher.fetch_objects(refs):
                off = offsets[ref.key]
                self._buf[off : off + len(data)] = data
            self._staged = version
            self._free.clear()
            self._mark_staged(version)
            version += 1

    def staged(self) -> int | None:
        return self._staged

    def commit(self) -> None:
        assert self._staged is not None
        t0 = time.perf_counter()
        off = 0
        for name in self._names:
            bits = self.state[name].bits
            n = bits.size
            np.copyto(bits.reshape(-1), np.frombuffer(self._buf, np.uint16, n, off))
            off += 2 * n
        self.version, self._staged = self._staged, None
        self.pauses.append(time.perf_counter() - t0)
        self._free.set()


# --- deltarl ----------------------------------------------------------------------------------------


class DeltaPublisher:
    """The real Publisher, one version per call (runs in a worker thread)."""

    def __init__(self, store: ObjectStore, run: str, state0: Mapping[str, BF16], *, segment_bytes: int) -> None:
        self.pub = Publisher(store, run, keyframe_interval=10**9, digest_interval=10**9, segment_bytes=segment_bytes)
        self.pub.publish(state0, step=0)  # version 0: the keyframe every actor starts from
        assert self.pub.head_version_id is not None
        self.vid0: str = self.pub.head_version_id

    def publish(self, state: Mapping[str, BF16], version: int) -> dict[str, Any]:
        info = self.pub.publish(state, step=version)
        assert info.version == version, (info.version, version)
        return {"bytes": info.stats.encoded_bytes, "objects": len(info.segment_keys), "wall_s": info.wall_s,
                "encode_s": info.encode_s, "changed_fraction": info.stats.changed_fraction}  # fmt: skip

    def close(self) -> None:
        self.pub.close()


class DeltaActor(Actor):
    """A Subscriber over the region's fetcher; a watcher records when each version is staged."""

    def __init__(self, name: str, state: dict[str, Any], run: str, fetcher: Fetcher, vid0: str | None, *, poll_wait_s: float) -> None:
        """``vid0``: the id of version 0 the state holds; ``None`` for an empty state that bootstraps."""
        super().__init__(name)
        self.state = state
        self.sub = Subscriber(state, run, fetcher, version=0 if vid0 else None, version_id=vid0, poll_wait_s=poll_wait_s,
                              poll_interval_s=0.01, verify_digest=False)  # fmt: skip
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.sub.start()
        self._watch = asyncio.ensure_future(self._watcher())

    async def _watcher(self) -> None:
        while True:
            v = self.sub.staged_version
            if v is not None and v not in self.staged_at:
                self._mark_staged(v)
            await asyncio.sleep(WATCH_S)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        await self.sub.close()

    def staged(self) -> int | None:
        return self.sub.staged_version

    def commit(self) -> None:
        info = self.sub.commit()
        self.version = info.version
        self.pauses.append(info.pause_s)
