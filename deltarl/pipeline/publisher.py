"""The trainer side of a run: publish each policy version with the commit protocol.

Per version ``v`` (see docs/RUN_NAMESPACE.md): the delta against the previous export is encoded segment by
segment while earlier segments upload on a bounded pool (``put_if_absent``); the keyframe (version
0 and every ``keyframe_interval``) uploads alongside; once every object is durable the manifest is
created with ``put_if_absent`` (the commit point), then HEAD moves by compare-and-swap. A crash at
any point leaves either no manifest (orphans that ``gc`` or the next publisher removes) or a
complete version. One writer per run is enforced by :mod:`deltarl.pipeline.claim`.

Memory: the previous export (one CPU copy of the state, updated in place after each commit, or the
caller's own export when it hands it over with ``publish(..., owned=True)``, which saves that copy)
plus at most ``max_in_flight`` encoded segments; a keyframe version also holds its serialized snapshot
while it uploads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from deltarl.codec.finite import check_before_encode, check_finite, is_finite
from deltarl.codec.heap import trim
from deltarl.codec.jit_warmup import warm_codec_quietly
from deltarl.codec.tensors import BLOCKS_V2
from deltarl.errors import (
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    RunError,
    StoreError,
    WriterConflict,
    short_pair,
)
from deltarl.pipeline.background import BackgroundPublishing
from deltarl.pipeline.claim import WriterLease, new_writer_id
from deltarl.pipeline.keyframe import plan_parts, write_part
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
from deltarl.pipeline.pieces import check_piece_size
from deltarl.pipeline.publish_config import PublishConfig
from deltarl.pipeline.reader import RunReader, entries_of, table_of
from deltarl.pipeline.uploads import UploadPool, check_materialized, copy_into, cpu_copy
from deltarl.storage.store import ObjectStore

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class VersionInfo:
    """What one ``publish`` committed, and how long its parts took (seconds)."""

    version: int
    version_id: str
    step: int
    kind: str
    manifest_key: str
    stats: DeltaStatsRecord
    segment_keys: tuple[str, ...]
    keyframe_keys: tuple[str, ...]
    state_digest: StateDigest | None
    encode_s: float
    upload_s: float
    wall_s: float
    #: manifest create (the commit point) and the HEAD compare-and-swap
    commit_s: float = 0.0
    #: bytes of the keyframe this version uploaded (0 for a delta-only version)
    keyframe_bytes: int = 0


def utc_now() -> str:
    """ISO-8601 UTC with milliseconds, e.g. ``2026-12-02T13:00:00.123Z``."""
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"



class Publisher:
    """Publishes versions of one run. Not thread-safe: call it from one thread (``publish_async``
    runs one publish at a time on a thread of its own).

    Example:
        >>> with Publisher(open_store("s3://bucket/runs"), "qwen-grpo", PublishConfig(keyframe_interval=20)) as pub:
        ...     for step in range(steps):  # doctest: +SKIP
        ...         train_step()
        ...         info = pub.publish(export_bf16(model), step=step, owned=True)
    """

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        config: PublishConfig | None = None,
        *,
        writer_id: str | None = None,
        previous_state: Mapping[str, Any] | None = None,
        on_stage: Callable[[int, str], None] | None = None,
        **settings: Any,
    ) -> None:
        """Claim ``run`` in ``store`` for writing and resume after its last committed version.

        Args:
            store: where the run lives.
            run: the run's name (its prefix in the store).
            config: how to publish (:class:`PublishConfig`); ``settings`` (its field names, e.g.
                ``keyframe_interval=10``) override single fields.
            writer_id: this writer's identity in the claim (a fresh one by default).
            previous_state: the last committed state, if the caller has it (saves reading it back).
            on_stage: called as ``on_stage(version, stage)`` when a stage of a publish completes:
                ``"segments"`` after each segment upload and ``"keyframe"`` after the keyframe
                upload (both on upload threads), ``"manifest"`` once the manifest is committed,
                before HEAD moves. For observation and fault injection in tests
                (:class:`deltarl.testing.faults.CrashAt`); it must not raise.
        """
        cfg = (config or PublishConfig()).with_settings(settings)
        self.config = cfg
        self.store = store
        self.layout = RunLayout(run)
        self.run = self.layout.run
        self.keyframe_interval = cfg.keyframe_interval
        self.digest_interval = cfg.digest_interval
        self.segment_bytes = cfg.segment_bytes
        self.segment_changes = cfg.segment_changes  # None: the encoder's default (SEGMENT_CHANGES)
        self.codec = cfg.codec
        self.max_in_flight = cfg.max_in_flight or cfg.upload_workers + 2
        self.writer_id = writer_id or new_writer_id()
        #: Record a state digest on the first version after a resume (off by default: a whole-state pass).
        self.digest_on_resume = cfg.digest_on_resume
        check_piece_size(cfg.piece_size, "Publisher")
        self.piece_size = cfg.piece_size
        self.keyframe_part_bytes = cfg.keyframe_part_bytes
        self.reader = RunReader(store, run)
        self._on_stage = on_stage
        self._lease = WriterLease(store, run, self.writer_id, lease_s=cfg.lease_s, takeover=cfg.takeover)
        self._info: RunInfo | None = None
        self._prev: dict[str, Any] | None = None
        self._prev_adopted = False  # _prev holds a caller's tensors (publish(owned=True)): never written
        #: _prev is known to hold no NaN/Inf (checked whole, or by induction: its base was and every
        #: element it changed was), so the next version need only check the elements it changes
        self._prev_finite = False
        self._head_id: str | None = None
        self._head_etag: str | None = None
        self._next = 0
        self._force_digest = False
        self._head_pending = False  # a version was committed but moving HEAD to it failed
        self._closed = False
        self._lease.acquire()
        try:
            self._resume(previous_state)
        except BaseException:
            self._lease.release()
            raise
        self._pool = ThreadPoolExecutor(cfg.upload_workers, thread_name_prefix="deltarl-upload")
        #: A resumed publisher's next publish encodes a delta (a fresh run's is a keyframe): while the
        #: trainer computes its step, the codec is warmed up and the base checked for NaN/Inf (if
        #: finite, the first publish checks only the values it changes). A publish that comes first
        #: encodes meanwhile and awaits the check before its commit.
        self._base_check: Future[bool] | None = None
        if self._prev is not None:
            dtypes = [t.dtype for t in self._info.tensors] if self._info is not None else []
            self._pool.submit(warm_codec_quietly, dtypes)
            self._base_check = self._pool.submit(is_finite, self._prev)
        self._background: BackgroundPublishing[VersionInfo] = BackgroundPublishing(self.run, lambda: self._closed)

    # --- opening -----------------------------------------------------------------------------------
    def _resume(self, previous_state: Mapping[str, Any] | None) -> None:
        if self.store.exists(self.layout.run_json):
            self._info = self.reader.info()
            stored = (self._info.keyframe_interval, self._info.digest_interval)
            if stored != (self.keyframe_interval, self.digest_interval):
                logger.warning("run %s: using keyframe/digest intervals %s from run.json", self.run, stored)
            self.keyframe_interval, self.digest_interval = stored
        head = self.reader.head_with_etag()
        if head is not None:
            record, self._head_etag = head
            manifest, vid = self.reader.manifest(record.version)
            if vid != record.version_id:
                named, has = short_pair(record.version_id, vid)
                raise RunError(f"{self.layout.head}: names id {named}, {manifest.key} has {has}")
            self._head_id, self._next = vid, record.version + 1
        self._roll_forward()
        self._remove_orphans(self._next)
        if self._head_id is None:
            return
        head_version = self._next - 1
        if previous_state is not None:
            from deltarl.codec import check_compatible, state_digest

            check_compatible(previous_state, table_of(self.reader.info()))
            manifest, _ = self.reader.manifest(head_version)
            recorded = manifest.state_digest
            if recorded is not None and state_digest(previous_state, recorded.algo) != recorded.value:
                raise RunError(f"previous_state is not version {head_version} (digest differs from {manifest.key})")
            self._prev = {name: cpu_copy(value) for name, value in previous_state.items()}
        else:
            from deltarl.pipeline.replay import replay

            logger.info("run %s: replaying version %d to resume publishing", self.run, head_version)
            self._prev = dict(replay(self.store, self.run, head_version))
        self._force_digest = self.digest_on_resume  # a whole-state pass only when asked
        logger.info("run %s: resuming after version %d as writer %s", self.run, head_version, self.writer_id)

    def _roll_forward(self) -> None:
        """Move HEAD over versions whose manifest was committed by a writer that crashed before HEAD."""
        while self.reader.has_manifest(self._next):
            manifest, vid = self.reader.manifest(self._next)
            if manifest.parent != self._head_id:
                raise RunError(f"{manifest.key}: parent does not match {self.layout.head}; the run needs repair")
            logger.warning("run %s: version %d was committed but HEAD not moved; moving HEAD", self.run, self._next)
            self._move_head(self._next, vid)

    def _remove_orphans(self, version: int) -> None:
        """Delete objects of an uncommitted publish of ``version`` (we hold the writer claim)."""
        keys = [
            *self.store.list(self.layout.version_prefix(version)),
            *self.store.list(self.layout.keyframe_prefix(version)),
            self.layout.keyframe(version),
        ]
        for key in keys:
            if self.store.exists(key):
                logger.info("removing orphan %s of an interrupted publish", key)
                self.store.delete(key)

    # --- publishing --------------------------------------------------------------------------------
    @property
    def next_version(self) -> int:
        return self._next

    @property
    def head_version_id(self) -> str | None:
        return self._head_id

    def publish_async(
        self, state_dict: Mapping[str, Any], step: int, *, owned: bool = False, allow_nonfinite: bool = False
    ) -> Future[VersionInfo]:
        """:meth:`publish` on a background thread; returns at once with the future of its VersionInfo.

        At most one publish is in flight: a call while one runs first waits for it (so version N+1
        is never published before N commits). A failed background publish fails its future and is
        raised again (as :class:`~deltarl.errors.PublishFailed`, chained) by the next call of
        ``publish``, ``publish_async`` or ``wait``. With ``owned=False`` the state is copied before
        this returns, so the caller may modify it at once; ``owned=True`` hands the tensors over as
        for :meth:`publish` (nothing is copied; the caller must not modify them).
        """
        self._background.check_open()
        check_materialized(state_dict)
        state = state_dict if owned else {name: cpu_copy(value) for name, value in state_dict.items()}
        return self._background.submit(lambda: self._publish(state, step, True, allow_nonfinite))

    def wait(self) -> VersionInfo | None:
        """Wait for the background publish in flight (if any); its VersionInfo, or raise its failure."""
        return self._background.wait()

    def publish(self, state_dict: Mapping[str, Any], step: int, *, owned: bool = False,
                allow_nonfinite: bool = False) -> VersionInfo:
        """Commit ``state_dict`` as the next version; returns once HEAD names it.

        The committed state is the base of the next version, so the publisher keeps it: by default
        as its own copy (one pass over the whole state per version, after the commit). With
        ``owned=True`` the caller hands ``state_dict`` over instead: it promises not to modify the
        mapping or its tensors afterwards (a fresh export per step, as ``export_bf16`` makes), and
        the publisher keeps references to them, copying nothing (device tensors are copied to CPU).
        A floating tensor holding NaN or Inf raises ``NonFiniteTensor`` (nothing is written) unless
        ``allow_nonfinite=True``.
        """
        self._background.settle()
        check_materialized(state_dict)
        return self._publish(state_dict, step, owned, allow_nonfinite)

    def _publish(
        self, state_dict: Mapping[str, Any], step: int, owned: bool, allow_nonfinite: bool = False
    ) -> VersionInfo:
        from deltarl.codec import check_compatible, state_digest

        if self._closed:
            raise RunError(f"publisher of run {self.run!r} is closed")
        base_check = self._base_check  # the resumed base, checked in the background
        if base_check is not None and (base_check.done() or allow_nonfinite):
            self._prev_finite, self._base_check, base_check = base_check.result(), None, None
        if base_check is not None:  # still running: the encoder checks the changes, the base is awaited before commit
            check_changes = True
        else:
            check_changes = check_before_encode(state_dict, allow_nonfinite=allow_nonfinite,
                                                base_finite=self._prev_finite and self._next > 0)
        t0 = time.perf_counter()
        early: Future[None] | None = None
        try:
            if self._head_pending:
                self._lease.renew()
                self._repair_head()
            else:  # renew while encoding: a lost claim shows up before commit without a round trip here
                early = self._pool.submit(self._lease.renew)
        except WriterConflict:
            self._closed = True
            raise
        version = self._next
        if self._info is None:
            self._info = self._create_run_info(state_dict)
        check_compatible(state_dict, table_of(self._info))
        is_keyframe = version % self.keyframe_interval == 0
        uploads = UploadPool(self._pool, self.max_in_flight)
        encode_s = 0.0
        changed = encoded = 0
        try:
            if version > 0:
                encode_s, changed, encoded = self._encode_delta(state_dict, version, uploads, check_finite=check_changes)
            digest = None
            if is_keyframe:  # each part streams from the state, hashed as it is written, on the pool
                specs = {t.name: t for t in self._info.tensors}
                for i, ranges in enumerate(plan_parts(self._info.tensors, self.keyframe_part_bytes)):
                    key = self.layout.keyframe_part(version, i, epoch=self._lease.epoch)
                    uploads.submit(self._upload_part, version, key, state_dict, ranges, specs)
            if is_keyframe or version % self.digest_interval == 0 or self._force_digest:
                digest = StateDigest(BLOCKS_V2, state_digest(state_dict, BLOCKS_V2))
            if base_check is not None:  # unchanged values are the base's: a base with NaN/Inf needs a whole check
                self._prev_finite, self._base_check = base_check.result(), None
                if not self._prev_finite:
                    check_finite(state_dict)
            refs = uploads.results()
        except BaseException:
            if early is not None and early.exception() is not None:
                self._closed = True  # the claim is lost: what we wrote may now be another writer's keys
            else:
                self._discard(uploads)
            raise
        seg_refs = tuple(r for r in refs if not isinstance(r, KeyframePart))
        parts = tuple(r for r in refs if isinstance(r, KeyframePart))
        kf_ref = Keyframe(tuple(sorted(parts, key=lambda p: p.key))) if parts else None
        full = self._info.total_elements, sum(t.numel * _DTYPE_BYTES[t.dtype] for t in self._info.tensors)
        if version == 0:
            stats = DeltaStatsRecord(full[0], full[0], kf_ref.size if kf_ref else 0, full[1])
        else:
            stats = DeltaStatsRecord(changed, full[0], encoded, full[1])
        manifest = Manifest(
            run=self.run,
            version=version,
            step=step,
            parent=self._head_id,
            kind="keyframe" if is_keyframe else "delta",
            base_version=None if version == 0 else version - 1,
            segments=seg_refs,
            keyframe=kf_ref,
            stats=stats,
            state_digest=digest,
            codec=self.codec,
            created_at=utc_now(),
            writer_id=self.writer_id,
        )
        data = manifest.to_bytes()
        try:
            if early is not None:
                early.result()
            self._lease.renew()  # a writer fenced or taken over stops here, before committing
        except WriterConflict:
            self._closed = True  # its objects stay for gc: their keys may be the new writer's now
            raise
        t_commit = time.perf_counter()
        self._commit_manifest(manifest.key, data)
        self._stage(version, "manifest")
        vid = manifest.version_id
        self._retain(state_dict, owned)  # the version is committed: it is the base of the next one
        self._prev_finite = not allow_nonfinite  # checked whole, or its changes on a finite base
        self._force_digest = False
        self._head_id, self._next = vid, version + 1
        self._head_pending = True
        self._move_head(version, vid)
        self._head_pending = False
        commit_s = time.perf_counter() - t_commit
        wall = time.perf_counter() - t0
        info = VersionInfo(
            version=version,
            version_id=vid,
            step=step,
            kind=manifest.kind,
            manifest_key=manifest.key,
            stats=stats,
            segment_keys=tuple(r.key for r in seg_refs),
            keyframe_keys=() if kf_ref is None else kf_ref.keys,
            state_digest=digest,
            encode_s=encode_s,
            upload_s=uploads.busy_s,
            wall_s=wall,
            commit_s=commit_s,
            keyframe_bytes=0 if kf_ref is None else kf_ref.size,
        )
        logger.info(
            "published %s v%d (%s): %d segments, %d bytes, changed %.4f%%, encode %.3fs upload %.3fs wall %.3fs",
            self.run, version, manifest.kind, len(seg_refs), stats.encoded_bytes, 100 * stats.changed_fraction,
            encode_s, uploads.busy_s, wall,
        )  # fmt: skip
        return info

    def _retain(self, state: Mapping[str, Any], owned: bool) -> None:
        """Keep the committed ``state`` as the next base: adopt it (``owned``) or copy it."""
        from deltarl.codec.tensors import is_cuda

        if owned:
            self._prev = {name: cpu_copy(v) if is_cuda(v) else v for name, v in state.items()}
            self._prev_adopted = True
        elif self._prev is None or self._prev_adopted:  # never write into tensors a caller handed over
            self._prev = {name: cpu_copy(value) for name, value in state.items()}
            self._prev_adopted = False
        else:
            for name, value in state.items():
                copy_into(self._prev[name], value, name)
        trim()  # the export dropped above: give its memory back to the OS

    def _encode_delta(self, state: Mapping[str, Any], version: int, uploads: UploadPool, *, check_finite: bool = False
                      ) -> tuple[float, int, int]:
        from deltarl.codec import iter_encode_delta, read_segment_header
        from deltarl.codec.encode import SEGMENT_CHANGES

        assert self._prev is not None
        assert self._head_id is not None
        it = iter_encode_delta(self._prev, state, base=self._head_id, segment_bytes=self.segment_bytes, codec=self.codec,
                               segment_changes=self.segment_changes or SEGMENT_CHANGES, check_finite=check_finite)
        encode_s = 0.0
        changed = encoded = 0
        index = 0
        while True:
            t = time.perf_counter()
            seg = next(it, None)
            if seg is not None:
                changed += sum(c.changed for c in read_segment_header(seg).chunks)
                encoded += len(seg)
            encode_s += time.perf_counter() - t
            if seg is None:
                return encode_s, changed, encoded
            key = self.layout.segment(version, index, epoch=self._lease.epoch)
            uploads.submit(self._upload, version, "segments", key, seg)
            index += 1
            del seg

    def _upload_part(self, version: int, key: str, state: Mapping[str, Any], ranges: Any, specs: Any) -> KeyframePart:
        try:
            part = write_part(self.store, key, state, ranges, specs, piece_size=self.piece_size)
        except ObjectExists as err:  # our epoch is in the key: only a retry of our own write lands here
            raise WriterConflict(f"{key} already exists: another writer with this epoch is publishing this run") from err
        self._stage(version, "keyframe")
        return part

    def _upload(self, version: int, point: str, key: str, data: bytes) -> ObjectRef:
        ref = ObjectRef.of(key, data, piece_size=self.piece_size)
        try:
            self.store.put_if_absent(key, data)
        except ObjectExists as err:
            existing = self.store.get(key)
            if existing != data:
                raise WriterConflict(f"{key} already exists with other bytes: another writer is publishing this run") from err
        self._stage(version, point)
        return ref

    def _stage(self, version: int, stage: str) -> None:
        if self._on_stage is not None:
            self._on_stage(version, stage)

    def _discard(self, uploads: UploadPool) -> None:
        """After a failed publish: wait for in-flight uploads and delete what they wrote (best effort)."""
        for f in uploads.futures:
            if f.exception() is None:
                try:
                    self.store.delete(f.result().key)
                except StoreError as err:
                    logger.warning("could not delete %s after a failed publish (gc will): %s", f.result().key, err)

    def _create_run_info(self, state: Mapping[str, Any]) -> RunInfo:
        info = RunInfo(
            run=self.run,
            tensors=entries_of(state),
            codec=self.codec,
            keyframe_interval=self.keyframe_interval,
            digest_interval=self.digest_interval,
            segment_bytes=self.segment_bytes,
            created_at=utc_now(),
        )
        try:
            self.store.put_if_absent(self.layout.run_json, info.to_bytes())
        except ObjectExists:
            stored = RunInfo.from_bytes(self.store.get(self.layout.run_json), where=self.layout.run_json)
            if stored.tensors != info.tensors:
                raise RunError(f"{self.layout.run_json} exists with another tensor table") from None
            return stored
        return info

    def _commit_manifest(self, key: str, data: bytes) -> None:
        try:
            self.store.put_if_absent(key, data)
        except ObjectExists as err:
            if self.store.get(key) != data:  # not our own write retried after an ambiguous failure
                self._closed = True
                raise WriterConflict(f"{key}: another writer committed this version first; this publisher stops") from err

    def _move_head(self, version: int, vid: str) -> None:
        record = HeadRecord(version=version, version_id=vid, writer_id=self.writer_id).to_bytes()
        try:
            self._head_etag = self.store.cas(self.layout.head, record, self._head_etag)
        except (PreconditionFailed, ObjectNotFound) as err:
            current = self.reader.head_with_etag()
            if current is None or current[0].to_bytes() != record:
                self._closed = True
                raise WriterConflict(
                    f"{self.layout.head} moved underneath writer {self.writer_id!r} (now "
                    f"{current[0] if current else 'absent'}); version {version} is committed, this publisher stops"
                ) from err
            self._head_etag = current[1]
        self._head_id, self._next = vid, version + 1

    def _repair_head(self) -> None:
        """Retry moving HEAD to the last committed version after a failed (or ambiguous) CAS."""
        current = self.reader.head_with_etag()
        want = self._next - 1
        if current is not None and (current[0].version, current[0].version_id) == (want, self._head_id):
            self._head_etag = current[1]
        else:
            if current is not None and (current[0].version != want - 1 or current[0].writer_id != self.writer_id):
                raise WriterConflict(f"{self.layout.head} moved underneath writer {self.writer_id!r} (now {current[0]})")
            self._head_etag = None if current is None else current[1]
            assert self._head_id is not None
            self._move_head(want, self._head_id)
        self._head_pending = False

    # --- lifetime ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for a background publish and the upload pool, and release the writer claim.

        A background failure not yet raised by another call is logged, not raised."""
        if getattr(self, "_background", None) is not None:
            self._background.shutdown()
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=True)
        self._closed = True
        self._lease.release()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
