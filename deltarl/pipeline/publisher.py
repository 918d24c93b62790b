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
from concurrent.futures import wait as wait_futures
from typing import Any

from deltarl.codec.finite import check_before_encode, check_finite, is_finite
from deltarl.codec.heap import trim
from deltarl.codec.jit_warmup import warm_codec_quietly
from deltarl.codec.tensors import DIGEST_ALGO
from deltarl.errors import RunError, WriterConflict
from deltarl.pipeline.background import BackgroundPublishing
from deltarl.pipeline.fp8_checkpoint import serving_state
from deltarl.pipeline.keyframe import keyframe_state_digest, plan_parts, write_part
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.manifest import KeyframePart, ObjectRef, StateDigest
from deltarl.pipeline.pieces import check_piece_size
from deltarl.pipeline.publish_config import PublishConfig
from deltarl.pipeline.reader import table_of
from deltarl.pipeline.uploads import (
    UploadPool,
    check_materialized,
    check_readable,
    copy_into,
    cpu_copy,
    discard,
    upload_object,
)
from deltarl.pipeline.writer import ProgressHook, RunWriter, VersionInfo, utc_now
from deltarl.storage.store import ObjectStore

logger = logging.getLogger(__name__)

__all__ = ["Publisher", "VersionInfo", "utc_now"]


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
        on_progress: ProgressHook | None = None,
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
            on_progress: called as ``on_progress(version, point)`` at each point of a publish
                (:data:`deltarl.pipeline.writer.ProgressHook`); for observation and fault injection
                in tests; it must not raise.
        """
        cfg = (config or PublishConfig()).with_settings(settings)
        check_piece_size(cfg.piece_size, "Publisher")
        check_piece_size(cfg.segment_piece_size, "Publisher")
        self.config = cfg
        self.store = store
        self.layout = RunLayout(run)
        self.run = self.layout.run
        self.max_in_flight = cfg.max_in_flight or cfg.upload_workers + 2
        self._writer = RunWriter(store, run, cfg, writer_id=writer_id, on_progress=on_progress)
        self.writer_id = self._writer.writer_id
        self._prev: dict[str, Any] | None = None
        self._prev_adopted = False  # _prev holds a caller's tensors (publish(owned=True)): never written
        #: _prev is known to hold no NaN/Inf (checked whole, or by induction: its base was and every
        #: element it changed was), so the next version need only check the elements it changes
        self._prev_finite = False
        self._writer.open()
        try:
            self._load_base(previous_state)
        except BaseException:
            self._writer.release()
            raise
        self._pool = ThreadPoolExecutor(cfg.upload_workers, thread_name_prefix="deltarl-upload")
        #: A resumed publisher's next publish encodes a delta (a fresh run's is a keyframe): while the
        #: trainer computes its step, the codec is warmed up and the base checked for NaN/Inf (if
        #: finite, the first publish checks only the values it changes). A publish that comes first
        #: encodes meanwhile and awaits the check before its commit.
        self._base_check: Future[bool] | None = None
        if self._prev is not None:
            info = self._writer.info
            self._pool.submit(warm_codec_quietly, [t.dtype for t in info.tensors] if info is not None else [])
            self._base_check = self._pool.submit(is_finite, self._prev)
        self._background: BackgroundPublishing[VersionInfo] = BackgroundPublishing(self.run, lambda: self._writer.closed)

    def _load_base(self, previous_state: Mapping[str, Any] | None) -> None:
        """The HEAD version's state, the base of the next delta: the caller's (checked against the
        recorded digest) or replayed from the store."""
        if not self._writer.resumed:
            return
        head_version = self._writer.next_version - 1
        if previous_state is not None:
            from deltarl.codec.tensors import check_compatible, state_digest

            check_compatible(previous_state, table_of(self._writer.reader.info()))
            manifest, _ = self._writer.reader.manifest(head_version)
            recorded = manifest.state_digest
            if recorded is not None and state_digest(previous_state, recorded.algo) != recorded.value:
                raise RunError(f"previous_state is not version {head_version} (digest differs from {manifest.key})")
            self._prev = {name: cpu_copy(value) for name, value in previous_state.items()}
        else:
            from deltarl.pipeline.replay import replay

            logger.info("run %s: replaying version %d to resume publishing", self.run, head_version)
            self._prev = dict(replay(self.store, self.run, head_version))
        logger.info("run %s: resuming after version %d as writer %s", self.run, head_version, self.writer_id)

    # --- publishing --------------------------------------------------------------------------------
    @property
    def next_version(self) -> int:
        return self._writer.next_version

    @property
    def head_version_id(self) -> str | None:
        return self._writer.head_id

    @property
    def keyframe_interval(self) -> int:
        """The run's keyframe interval (run.json's, for a run that has one)."""
        return self._writer.keyframe_interval

    @property
    def digest_interval(self) -> int:
        return self._writer.digest_interval

    def publish_async(
        self, state_dict: Mapping[str, Any], step: int, *, owned: bool = False, allow_nonfinite: bool = False,
        on_published: Callable[[VersionInfo], None] | None = None,
    ) -> Future[VersionInfo]:
        """:meth:`publish` on a background thread; returns at once with the future of its VersionInfo.

        At most one publish is in flight: a call while one runs first waits for it (so version N+1
        is never published before N commits). A failed background publish fails its future and is
        raised again (as :class:`~deltarl.errors.PublishFailed`, chained) by the next call of
        ``publish``, ``publish_async`` or ``wait``. With ``owned=False`` the state is copied before
        this returns, so the caller may modify it at once; ``owned=True`` hands the tensors over as
        for :meth:`publish` (nothing is copied; the caller must not modify them). ``on_published``
        runs on the publishing thread with the committed version's info; an exception in it fails
        the future. With ``serve_as`` the state is quantized before this returns (instead of copied:
        the FP8 state is the publisher's own).
        """
        self._background.check_open()
        check_materialized(state_dict)
        state_dict, owned = serving_state(state_dict, self.config.serve_as, owned)
        state = state_dict if owned else {name: cpu_copy(value) for name, value in state_dict.items()}
        return self._background.submit(lambda: self._publish(state, step, True, allow_nonfinite), on_published)

    def wait(self) -> VersionInfo | None:
        """Wait for the background publish in flight (if any); its VersionInfo, or raise its failure."""
        return self._background.wait()

    def publish(self, state_dict: Mapping[str, Any], step: int, *, owned: bool = False,
                allow_nonfinite: bool = False) -> VersionInfo:
        """Commit ``state_dict`` as the next version; returns once the manifest is committed.

        The committed state is the base of the next version, so the publisher keeps it: by default
        as its own copy (one pass over the whole state per version, after the commit). With
        ``owned=True`` the caller hands ``state_dict`` over instead: it promises not to modify the
        mapping or its tensors afterwards (a fresh export per step, as ``export_bf16`` makes), and
        the publisher keeps references to them, copying nothing (device tensors are copied to CPU).
        A floating tensor holding NaN or Inf raises ``NonFiniteTensor`` (nothing is written) unless
        ``allow_nonfinite=True``. A state that does not fit the run (another tensor table, no
        tensors at all, a tensor that cannot be read) is refused before anything is written.
        With ``serve_as="fp8-block128"`` the version is the FP8 serving state of ``state_dict``
        (:mod:`deltarl.codec.fp8`; NaN/Inf in a quantized weight is always refused).
        """
        self._background.settle()
        check_materialized(state_dict)
        state_dict, owned = serving_state(state_dict, self.config.serve_as, owned)
        return self._publish(state_dict, step, owned, allow_nonfinite)

    def _check_changes(self, state: Mapping[str, Any], allow_nonfinite: bool) -> tuple[bool, Future[bool] | None]:
        """Whether the encoder checks the changed values for NaN/Inf, and the resumed base's check
        still running (awaited before the commit), if any."""
        base_check = self._base_check
        if base_check is not None and (base_check.done() or allow_nonfinite):
            self._prev_finite, self._base_check, base_check = base_check.result(), None, None
        if base_check is not None:
            return True, base_check
        return check_before_encode(state, allow_nonfinite=allow_nonfinite,
                                   base_finite=self._prev_finite and self.next_version > 0), None

    def _publish(self, state: Mapping[str, Any], step: int, owned: bool, allow_nonfinite: bool = False) -> VersionInfo:
        from deltarl.codec.tensors import state_digest, tensor_table

        writer = self._writer
        writer.check_open()
        # Every refusal of the state comes before anything is written (or the claim renewed), so a
        # refused publish leaves the publisher as it was: the next call publishes the same version.
        if not state:
            raise RunError(f"run {self.run!r}: refusing to publish an empty state (no tensors)")
        check_readable(state)
        table = tensor_table(state)  # refuses unsupported values, naming the tensor
        writer.check_table(table)
        check_changes, base_check = self._check_changes(state, allow_nonfinite)
        t0 = time.perf_counter()
        renewal = writer.begin(self._pool)
        version = writer.next_version
        uploads = UploadPool(self._pool, self.max_in_flight)
        encode_s, changed = 0.0, 0
        try:
            if version > 0:
                encode_s, changed = self._encode_delta(state, version, uploads, check_finite=check_changes)
            if writer.is_keyframe(version):  # each part streams from the state, hashed as it is written
                specs = {t.name: t for t in table}
                for i, ranges in enumerate(plan_parts(table, self.config.keyframe_part_bytes)):
                    key = self.layout.keyframe_part(version, i, epoch=writer.epoch)
                    uploads.submit(self._upload_part, version, key, state, ranges, specs)
            keyframe = writer.is_keyframe(version)  # a keyframe's digest is composed from its parts' hashes
            digest = StateDigest(DIGEST_ALGO, state_digest(state, DIGEST_ALGO)) if not keyframe and writer.records_digest(version) else None
            if base_check is not None:  # unchanged values are the base's: a base with NaN/Inf needs a whole check
                self._prev_finite, self._base_check = base_check.result(), None
                if not self._prev_finite:
                    check_finite(state)
            tw = time.perf_counter()
            refs = uploads.results()
            upload_wait_s = time.perf_counter() - tw
            segments = [r for r in refs if not isinstance(r, KeyframePart)]
            parts = [r for r in refs if isinstance(r, KeyframePart)]
            if keyframe:
                digest = keyframe_state_digest(state, table, parts)
            committed = writer.commit(version, step, table, segments=segments, parts=parts, changed=changed,
                                      digest=digest, renewal=renewal)
        except BaseException as err:
            if renewal is not None:  # settle the claim's renewal: the next one must not race it
                wait_futures([renewal])
            if isinstance(err, WriterConflict) or (renewal is not None and renewal.exception()):
                writer.closed = True  # the claim is lost: what we wrote may now be another writer's keys
            elif not writer.has_committed(version):
                discard(self.store, uploads)
            raise
        self._retain(state, owned)  # the version is committed: it is the base of the next one
        self._prev_finite = not allow_nonfinite  # checked whole, or its changes on a finite base
        manifest = committed.manifest
        info = VersionInfo(
            version=version, version_id=committed.version_id, step=step, kind=manifest.kind,
            manifest_key=manifest.key, stats=manifest.stats, segment_keys=tuple(r.key for r in segments),
            keyframe_keys=() if manifest.keyframe is None else manifest.keyframe.keys, state_digest=digest,
            encode_s=encode_s, upload_s=uploads.busy_s, upload_wait_s=upload_wait_s, commit_s=committed.commit_s,
            wall_s=time.perf_counter() - t0, keyframe_bytes=0 if manifest.keyframe is None else manifest.keyframe.size,
            local_encoded_bytes=sum(r.size for r in segments),
        )  # fmt: skip
        logger.info(
            "published %s v%d (%s): %d segments, %d bytes, changed %.4f%%, encode %.3fs upload %.3fs wall %.3fs",
            self.run, version, manifest.kind, len(segments), manifest.stats.encoded_bytes,
            100 * manifest.stats.changed_fraction, encode_s, uploads.busy_s, info.wall_s,
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
                      ) -> tuple[float, int]:
        """Encode the delta against the base segment by segment, each uploaded as it fills;
        returns the encode seconds and the changed elements."""
        from deltarl.codec.encode import SEGMENT_CHANGES, iter_encode_delta
        from deltarl.codec.segment import read_segment_header

        assert self._prev is not None
        assert self._writer.head_id is not None
        it = iter_encode_delta(self._prev, state, base=self._writer.head_id, segment_bytes=self.config.segment_bytes,
                               codec=self.config.codec, segment_changes=self.config.segment_changes or SEGMENT_CHANGES,
                               check_finite=check_finite, cells=self.config.cells)
        encode_s = 0.0
        changed = 0
        for index in range(1 << 30):
            t = time.perf_counter()
            seg = next(it, None)
            if seg is not None:
                changed += sum(c.changed for c in read_segment_header(seg).chunks)
            encode_s += time.perf_counter() - t
            if seg is None:
                break
            key = self.layout.segment(version, index, epoch=self._writer.epoch)
            uploads.submit(self._upload_segment, version, key, seg)
            del seg
        return encode_s, changed

    def _upload_part(self, version: int, key: str, state: Mapping[str, Any], ranges: Any, specs: Any) -> KeyframePart:
        part = write_part(self.store, key, state, ranges, specs, piece_size=self.config.piece_size)
        self._writer.progress(version, "keyframe")
        return part

    def _upload_segment(self, version: int, key: str, data: bytes) -> ObjectRef:
        ref = upload_object(self.store, key, data, self.config.segment_piece_size)
        self._writer.progress(version, "segments")
        return ref

    # --- lifetime ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for a background publish and the upload pool, and release the writer claim.

        A background failure not yet raised by another call is logged, not raised."""
        if getattr(self, "_background", None) is not None:
            self._background.shutdown()
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=True)
        self._writer.release()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
