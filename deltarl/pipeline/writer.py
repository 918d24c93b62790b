"""The one writer core under every publisher: the claim, resume, run.json, the commit and HEAD.

:class:`~deltarl.pipeline.publisher.Publisher` and rank 0 of
:class:`~deltarl.pipeline.sharded.ShardedPublisher` encode and upload in their own ways (one process,
or every rank its rows); everything that makes a version *committed* happens here, once:

* **open**: take the writer claim (:mod:`deltarl.pipeline.claim`), check HEAD against the manifest
  it names, move HEAD over manifests a crashed writer committed past it (roll-forward), delete the
  uncommitted objects of the next version (we hold the claim, so they are orphans);
* **commit** of version ``v``: create ``run.json`` if the run has none yet (only now, once every
  object of the first version is durable, so a refused or crashed first publish leaves no record
  that poisons the run's name), build the manifest and its stats, renew the claim (a fenced writer
  stops here), create the manifest with ``put_if_absent`` (the commit point), then move HEAD by
  compare-and-swap, repairing it on the next version if the swap failed ambiguously.

See docs/RUN_NAMESPACE.md for the protocol.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from deltarl.codec.tensors import TensorSpec
from deltarl.errors import (
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    RunError,
    StoreError,
    TensorMismatch,
    WriterConflict,
    short_pair,
)
from deltarl.pipeline.claim import WriterLease, new_writer_id
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.manifest import (
    DeltaStatsRecord,
    HeadRecord,
    Keyframe,
    KeyframePart,
    Manifest,
    ObjectRef,
    RunInfo,
    StateDigest,
)
from deltarl.pipeline.publish_config import PublishConfig
from deltarl.pipeline.reader import RunReader
from deltarl.storage.store import ObjectStore

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}

#: ``on_progress(version, point)``: called when a point of a publish is reached (``"segments"``
#: after each segment upload, ``"keyframe"`` after each keyframe part, ``"gathered"`` once a
#: sharded version's ranks reported, ``"manifest"`` once the manifest is committed, before HEAD
#: moves). For observation and fault injection in tests (:class:`deltarl.testing.faults.CrashAt`).
ProgressHook = Callable[[int, str], None]


def utc_now() -> str:
    """ISO-8601 UTC with milliseconds, e.g. ``2026-12-02T13:00:00.123Z``."""
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def table_bytes(table: Sequence[TensorSpec]) -> int:
    """Bytes of a full state of ``table`` in its stored dtypes."""
    return sum(t.numel * _DTYPE_BYTES[t.dtype] for t in table)


def table_difference(run: Sequence[TensorSpec], state: Sequence[TensorSpec]) -> str:
    """What differs between the run's tensor table and a state's, in a few words."""
    have, want = {t.name: t for t in state}, {t.name: t for t in run}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        return f"the state lacks {missing[:5]} and has unexpected {extra[:5]} ({len(missing)} and {len(extra)} tensors)"
    for name, spec in want.items():
        if have[name] != spec:
            got = have[name]
            return f"tensor {name!r} is {got.dtype}{list(got.shape)} in the state, {spec.dtype}{list(spec.shape)} in the run"
    return "the tables are equal"


@dataclass(frozen=True)
class VersionInfo:
    """What one publish committed, and how long its parts took (seconds).

    The same for a single publisher and on every rank of a sharded one; ``local_encoded_bytes``,
    ``encode_s`` and ``upload_s`` are this process's (this rank's) share."""

    version: int
    version_id: str
    step: int
    kind: str
    manifest_key: str
    stats: DeltaStatsRecord
    segment_keys: tuple[str, ...]
    keyframe_keys: tuple[str, ...]
    state_digest: StateDigest | None
    #: encoding this process's delta (and, sharded, hashing its rows for the digest)
    encode_s: float
    #: time during which at least one of this process's uploads was running
    upload_s: float
    #: time spent waiting for this process's uploads once encoding had finished
    upload_wait_s: float
    #: manifest create (the commit point) and the HEAD compare-and-swap
    commit_s: float
    wall_s: float
    #: bytes of the keyframe this version uploaded (0 for a delta-only version)
    keyframe_bytes: int = 0
    #: ranks that published the version (1 for a single publisher)
    ranks: int = 1
    #: encoded delta bytes this process uploaded (all of them for a single publisher)
    local_encoded_bytes: int = 0


@dataclass(frozen=True)
class Committed:
    """A version the writer committed: its manifest, id and the time the commit took."""

    manifest: Manifest
    version_id: str
    commit_s: float


class RunWriter:
    """The writer of one run: claim, resume, commit. Used from one thread at a time."""

    def __init__(self, store: ObjectStore, run: str, config: PublishConfig, *, writer_id: str | None = None,
                 on_progress: ProgressHook | None = None) -> None:
        self.store = store
        self.layout = RunLayout(run)
        self.run = self.layout.run
        self.config = config
        self.keyframe_interval = config.keyframe_interval
        self.digest_interval = config.digest_interval
        self.writer_id = writer_id or new_writer_id()
        self.reader = RunReader(store, run)
        self.lease = WriterLease(store, run, self.writer_id, lease_s=config.lease_s, takeover=config.takeover)
        self.info: RunInfo | None = None
        self.head_id: str | None = None
        self.next_version = 0
        self.closed = False
        self._on_progress = on_progress
        self._head_etag: str | None = None
        self._head_pending = False  # a version was committed but moving HEAD to it failed
        self._force_digest = False

    # --- open --------------------------------------------------------------------------------------
    def open(self) -> None:
        """Take the claim and find where the run stands (HEAD checked, rolled forward, orphans of the
        next version removed). Releases the claim again if any of it fails."""
        self.lease.acquire()
        try:
            self._resume()
        except BaseException:
            self.lease.release()
            raise

    def _resume(self) -> None:
        if self.store.exists(self.layout.run_json):
            self.info = self.reader.info()
            stored = (self.info.keyframe_interval, self.info.digest_interval)
            if stored != (self.keyframe_interval, self.digest_interval):
                logger.warning("run %s: using keyframe/digest intervals %s from run.json", self.run, stored)
            self.keyframe_interval, self.digest_interval = stored
        head = self.reader.head_with_etag()
        if head is not None:
            record, self._head_etag = head
            manifest, vid = self.reader.manifest(record.version)
            if vid != record.version_id:
                named, has = short_pair(record.version_id, vid)
                raise RunError(f"{self.layout.head}: names id {named} for version {record.version}, "
                               f"but {manifest.key} has id {has}")
            self.head_id, self.next_version = vid, record.version + 1
        while self.reader.has_manifest(self.next_version):  # committed by a writer that died before HEAD
            manifest, vid = self.reader.manifest(self.next_version)
            if manifest.parent != self.head_id:
                raise RunError(f"{manifest.key}: parent does not match {self.layout.head}; the run needs repair")
            logger.warning("run %s: version %d was committed but HEAD not moved; moving HEAD", self.run, self.next_version)
            self._move_head(self.next_version, vid)
        self._remove_orphans(self.next_version)
        self._force_digest = self.head_id is not None and self.config.digest_on_resume

    def _remove_orphans(self, version: int) -> None:
        """Delete objects of an uncommitted publish of ``version`` (we hold the writer claim)."""
        keys = [*self.store.list(self.layout.version_prefix(version)), *self.store.list(self.layout.keyframe_prefix(version))]
        for key in keys:
            logger.info("removing orphan %s of an interrupted publish", key)
            self.store.delete(key)

    # --- a version ---------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The claim epoch every key this writer writes carries."""
        return self.lease.epoch

    @property
    def resumed(self) -> bool:
        """Whether the run already has a committed version (the next one is a delta)."""
        return self.head_id is not None

    def is_keyframe(self, version: int) -> bool:
        return version % self.keyframe_interval == 0

    def records_digest(self, version: int) -> bool:
        """Whether version ``version``'s manifest records a state digest."""
        return self.is_keyframe(version) or version % self.digest_interval == 0 or self._force_digest

    def has_committed(self, version: int) -> bool:
        """Whether ``version`` is committed (by this writer, or before it opened)."""
        return version < self.next_version

    def check_open(self) -> None:
        if self.closed:
            raise RunError(f"publisher of run {self.run!r} is closed")

    def check_table(self, table: Sequence[TensorSpec]) -> None:
        """A TensorMismatch unless ``table`` is the run's (when it has one): checked before anything is written."""
        if self.info is not None and list(self.info.tensors) != list(table):
            raise TensorMismatch(f"{self.layout.run_json}: {table_difference(self.info.tensors, table)}")

    def begin(self, pool: ThreadPoolExecutor) -> Future[None] | None:
        """Start a version: repair HEAD if the last swap failed, else renew the claim on ``pool``
        while the caller encodes (a lost claim shows up before the commit, without a round trip
        in front of the encode). Returns the renewal to pass to :meth:`commit`."""
        self.check_open()
        try:
            if self._head_pending:
                self.renew()
                self._repair_head()
                return None
        except WriterConflict:
            self.closed = True
            raise
        return pool.submit(self.lease.renew)

    def renew(self) -> None:
        """Renew the claim; a WriterConflict closes the writer."""
        try:
            self.lease.renew()
        except WriterConflict:
            self.closed = True
            raise

    def progress(self, version: int, point: str) -> None:
        if self._on_progress is not None:
            self._on_progress(version, point)

    def commit(self, version: int, step: int, table: Sequence[TensorSpec], *, segments: Sequence[ObjectRef],
               parts: Sequence[KeyframePart], changed: int, digest: StateDigest | None,
               renewal: Future[None] | None = None) -> Committed:
        """Commit version ``version`` whose objects are all durable: run.json if the run has none,
        the manifest (the commit point), then HEAD. ``WriterConflict`` closes the writer."""
        t0 = time.perf_counter()
        if version != self.next_version:
            raise RunError(f"run {self.run!r}: committing version {version}, but the next version is {self.next_version}")
        keyframe = Keyframe(tuple(sorted(parts, key=lambda p: p.key))) if parts else None
        if keyframe is not None:
            keyframe.check_covers(table, f"version {version} keyframe")
        total, full = sum(t.numel for t in table), table_bytes(table)
        encoded = keyframe.size if version == 0 and keyframe is not None else sum(s.size for s in segments)
        stats = DeltaStatsRecord(total if version == 0 else changed, total, encoded, full)
        manifest = Manifest(
            run=self.run, version=version, step=step, parent=self.head_id,
            kind="keyframe" if keyframe is not None else "delta",
            base_version=None if version == 0 else version - 1,
            segments=tuple(segments), keyframe=keyframe, stats=stats, state_digest=digest,
            codec=self.config.codec, created_at=utc_now(), writer_id=self.writer_id,
        )  # fmt: skip
        data = manifest.to_bytes()
        try:
            if renewal is not None:
                renewal.result()
            self.lease.renew()  # a writer fenced or taken over stops here, before committing
            if self.info is None:
                self.info = self._create_run_info(table)
            self.check_table(table)
            self._create_manifest(manifest.key, data)
        except WriterConflict:
            self.closed = True  # its objects stay for gc: their keys may be the new writer's now
            raise
        self.progress(version, "manifest")
        vid = manifest.version_id
        self.head_id, self.next_version = vid, version + 1
        self._force_digest = False
        self._head_pending = True
        try:
            self._move_head(version, vid)
            self._head_pending = False
        except WriterConflict:
            raise
        except StoreError as err:  # HEAD is a hint (readers find manifests past it): repaired next version
            logger.warning("run %s: version %d is committed, but moving HEAD failed (%s); the next publish repairs it",
                           self.run, version, err)
        return Committed(manifest, vid, time.perf_counter() - t0)

    def _create_run_info(self, table: Sequence[TensorSpec]) -> RunInfo:
        if not table:
            raise RunError(f"run {self.run!r}: a state needs at least one tensor")
        cfg = self.config
        info = RunInfo(run=self.run, tensors=tuple(table), codec=cfg.codec, keyframe_interval=self.keyframe_interval,
                       digest_interval=self.digest_interval, segment_bytes=cfg.segment_bytes, created_at=utc_now())
        try:
            self.store.put_if_absent(self.layout.run_json, info.to_bytes())
        except ObjectExists:
            stored = RunInfo.from_bytes(self.store.get(self.layout.run_json), where=self.layout.run_json)
            if list(stored.tensors) != list(table):
                raise TensorMismatch(f"{self.layout.run_json} exists with another tensor table: "
                                     f"{table_difference(stored.tensors, table)}") from None
            return stored
        return info

    def _create_manifest(self, key: str, data: bytes) -> None:
        try:
            self.store.put_if_absent(key, data)
        except ObjectExists as err:
            if self.store.get(key) != data:  # not our own write retried after an ambiguous failure
                raise WriterConflict(f"{key}: another writer committed this version first; this publisher stops") from err

    def _move_head(self, version: int, vid: str) -> None:
        record = HeadRecord(version=version, version_id=vid, writer_id=self.writer_id).to_bytes()
        try:
            self._head_etag = self.store.cas(self.layout.head, record, self._head_etag)
        except (PreconditionFailed, ObjectNotFound) as err:
            current = self.reader.head_with_etag()
            if current is None or current[0].to_bytes() != record:  # not our own swap, retried
                self.closed = True
                raise WriterConflict(
                    f"{self.layout.head} moved underneath writer {self.writer_id!r} (now "
                    f"{current[0] if current else 'absent'}); version {version} is committed, this publisher stops"
                ) from err
            self._head_etag = current[1]
        self.head_id, self.next_version = vid, version + 1

    def _repair_head(self) -> None:
        """Retry moving HEAD to the last committed version after a failed (or ambiguous) swap."""
        current = self.reader.head_with_etag()
        want = self.next_version - 1
        if current is not None and (current[0].version, current[0].version_id) == (want, self.head_id):
            self._head_etag = current[1]
        else:
            if current is not None and (current[0].version != want - 1 or current[0].writer_id != self.writer_id):
                raise WriterConflict(f"{self.layout.head} moved underneath writer {self.writer_id!r} (now {current[0]})")
            self._head_etag = None if current is None else current[1]
            assert self.head_id is not None
            self._move_head(want, self.head_id)
        self._head_pending = False

    def release(self) -> None:
        """Release the claim (another writer may take it at once). Idempotent."""
        self.closed = True
        self.lease.release()
