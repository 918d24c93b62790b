"""Publish from every rank of a sharded trainer: one version, encoded and uploaded in parallel.

Per version, every rank of the group encodes its own rows (a dim-0 shard of each tensor) against
its own previous rows, with chunks at global element positions, and uploads its segments under
per-rank keys (``e<epoch>-seg-r<rank>-<i>.bin``) with ``put_if_absent``. Rank 0 holds the writer
(:class:`~deltarl.pipeline.writer.RunWriter`, the same core as :class:`Publisher`'s): it gathers
every rank's :class:`~deltarl.pipeline.shard_messages.RankReport`, checks that the chunks cover
every element of every tensor exactly once against one base, commits, and broadcasts the
:class:`~deltarl.pipeline.shard_messages.Outcome`. Ranks adopt their new rows as the next base
only after that commit; if any rank fails, no manifest is written, every base stays, and every
rank raises :class:`~deltarl.errors.ShardedPublishError` (objects already uploaded are deleted
where possible and otherwise left for ``gc``). Keyframes are parts written by every rank; the
``blake3-stream64k`` digest is computed rank by rank (:mod:`deltarl.pipeline.shard_digest`). With
``serve_as="fp8-block128"`` the ranks first reduce their rows' FP8 block maxima in one collective
and each publishes its rows of the FP8 serving state (:mod:`deltarl.pipeline.sharded_fp8`).

Memory per rank: its previous rows, its new rows, and a few encoded segments in flight. A job that
resumes a run gets its base rows from rank 0 (:mod:`deltarl.pipeline.shard_resume`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from deltarl.codec.finite import check_before_encode
from deltarl.codec.tensors import TensorSpec
from deltarl.errors import RunError, ShardedPublishError, WriterConflict
from deltarl.pipeline import shard_rows as sr
from deltarl.pipeline.background import BackgroundPublishing
from deltarl.pipeline.keyframe import stream_part
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.manifest import KeyframePart, StateDigest
from deltarl.pipeline.pieces import check_piece_size
from deltarl.pipeline.publish_config import PublishConfig
from deltarl.pipeline.shard_digest import ALGO, combine_digest, shard_hashes
from deltarl.pipeline.shard_messages import Collectives, Go, Opened, Outcome, RankReport, describe_errors
from deltarl.pipeline.shard_resume import resume_rows
from deltarl.pipeline.sharded_fp8 import quantize_shard, reduce_block_maxima
from deltarl.pipeline.uploads import UploadPool, discard, upload_object
from deltarl.pipeline.writer import ProgressHook, RunWriter, VersionInfo
from deltarl.storage.store import ObjectStore

logger = logging.getLogger(__name__)


def encode_threads_per_rank() -> int:
    """Encode threads for one rank: ``DELTARL_THREADS``, else the node's cores over its local ranks."""
    from deltarl.codec.kernels import worker_threads

    if os.environ.get("DELTARL_THREADS"):
        return worker_threads()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(4, worker_threads() // max(1, local)))


class ShardedPublisher:
    """Publishes versions of one run from every rank of ``group`` (collective: call on all ranks).

    Takes the same :class:`PublishConfig` (and field overrides) as :class:`Publisher`; returns the
    same :class:`VersionInfo` on every rank.

    Example:
        >>> with ShardedPublisher(store, "qwen3-8b-grpo") as pub:  # doctest: +SKIP
        ...     pub.publish_model(fsdp_model, step)   # every rank, its own shard
    """

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        config: PublishConfig | None = None,
        *,
        group: Any = None,
        encode_threads: int | None = None,
        writer_id: str | None = None,
        on_progress: ProgressHook | None = None,
        **settings: Any,
    ) -> None:
        """Open ``run`` for writing from every rank of ``group`` (collective); rank 0 claims it.

        Args:
            store: where the run lives (every rank writes its own objects to it).
            run: the run's name.
            config: how to publish (:class:`PublishConfig`); ``settings`` override single fields.
            group: the process group of the ranks that publish together (default: the world);
                background publishing needs a group of its own (``dist.new_group(backend="gloo")``).
            encode_threads: encode threads per rank (default: the node's cores over its local ranks).
            writer_id: rank 0's identity in the writer claim (a fresh one by default).
            on_progress: called as ``on_progress(version, point)`` on every rank (tests, observation).
        """
        import torch.distributed as dist

        cfg = (config or PublishConfig()).with_settings(settings)
        check_piece_size(cfg.piece_size, "ShardedPublisher")
        self.config = cfg
        self._dist = dist
        self.group = group
        self._comm = Collectives(dist, group)
        self.rank, self.world = self._comm.rank, self._comm.world
        serve_as: list[Any] = [None] * self.world  # every rank publishes the same serving state, or none opens the run
        dist.all_gather_object(serve_as, cfg.serve_as, group=group)
        if len(set(serve_as)) > 1:
            raise ValueError(f"ranks disagree on serve_as (rank by rank: {serve_as}); the run was not opened")
        self.store = store
        self.layout = RunLayout(run)
        self.run = self.layout.run
        self.max_in_flight = cfg.max_in_flight or cfg.upload_workers + 2
        self.encode_threads = encode_threads or encode_threads_per_rank()
        self._on_progress = on_progress
        self._writer: RunWriter | None = None
        self._prev: dict[str, Any] | None = None
        self._prev_finite = False  # as Publisher's: the base rows are known to hold no NaN/Inf
        self._closed = False
        opened = Opened(None)
        if self.rank == 0:
            writer = RunWriter(store, run, cfg, writer_id=writer_id, on_progress=on_progress)
            try:
                writer.open()
                self._writer = writer
                opened = Opened(None, writer.writer_id, writer.epoch, writer.keyframe_interval, writer.digest_interval,
                                writer.next_version, writer.head_id, writer.resumed and cfg.digest_on_resume)
            except Exception as err:  # every rank learns why opening failed
                opened = Opened(f"{type(err).__name__}: {err}")
        opened = self._comm.bcast(opened)
        if opened.error is not None:
            raise ShardedPublishError(f"rank 0 could not open run {self.run!r}: {opened.error}")
        self.writer_id = opened.writer_id
        self.epoch = opened.epoch
        self.keyframe_interval, self.digest_interval = opened.keyframe_interval, opened.digest_interval
        self._next = opened.next_version
        self._head_id = opened.head_id
        self._force_digest = opened.digest_on_resume
        self._pool = ThreadPoolExecutor(cfg.upload_workers, thread_name_prefix="deltarl-upload")
        self._background: BackgroundPublishing[VersionInfo] = BackgroundPublishing(self.run, lambda: self._closed)

    def _progress(self, version: int, point: str) -> None:
        if self._on_progress is not None:
            self._on_progress(version, point)

    # --- publishing ------------------------------------------------------------------------------------
    @property
    def next_version(self) -> int:
        return self._next

    @property
    def head_version_id(self) -> str | None:
        return self._head_id

    def publish_model(self, model: Any, step: int, *, allow_nonfinite: bool = False) -> VersionInfo:
        """Publish this rank's share of an FSDP2/DTensor ``model`` (BF16 export of local shards, no gather).

        A NaN or Inf on any rank fails the version on every rank (``ShardedPublishError`` naming the
        rank and tensor) unless ``allow_nonfinite=True``; as for :class:`Publisher`, only a version's
        changed elements are checked once its base is known finite."""
        self._background.settle()
        local, rows, early = self._export(model)
        return self._publish(local, rows, step, owned=True, early=early, allow_nonfinite=allow_nonfinite)

    def publish_model_async(
        self, model: Any, step: int, *, on_published: Callable[[VersionInfo], None] | None = None,
        allow_nonfinite: bool = False,
    ) -> Future[VersionInfo]:
        """:meth:`publish_model` in the background (collective: every rank, same order of calls).

        This rank's shard is exported (copied to CPU BF16) before this returns, so the optimizer may
        step at once; encoding, uploads and the commit's collectives run on a thread of their own, so
        the publisher's ``group`` must be one nothing else uses concurrently (training collectives on
        the default group would interleave with ours): ``group=dist.new_group(backend="gloo")``. At
        most one publish is in flight; a failure fails the future and is raised again (as
        :class:`~deltarl.errors.PublishFailed`, chained) by the next call. ``on_published`` runs on
        the publishing thread with the committed version's info; an exception in it fails the future.
        """
        if self.group is None or self.group is self._dist.group.WORLD:
            raise ValueError(
                "background sharded publishing needs a process group of its own (training collectives run on the "
                "default group meanwhile): ShardedPublisher(..., group=torch.distributed.new_group(backend='gloo'))"
            )
        self._background.check_open()
        local, rows, early = self._export(model)
        return self._background.submit(
            lambda: self._publish(local, rows, step, owned=True, early=early, allow_nonfinite=allow_nonfinite), on_published)

    def wait(self) -> VersionInfo | None:
        """Wait for the background publish in flight (if any); its info, or raise its failure."""
        return self._background.wait()

    def _export(self, model: Any) -> tuple[dict[str, Any] | None, sr.Rows | None, Exception | None]:
        try:
            local, rows = sr.dtensor_rows(model, self.rank, self.world)
        except Exception as err:  # every rank must still join the version's collectives to fail it
            return None, None, err
        return local, rows, None

    def publish_local(
        self, tensors: Mapping[str, tuple[Any, Sequence[int], int]], step: int, *, owned: bool = False,
        allow_nonfinite: bool = False,
    ) -> VersionInfo:
        """Publish plain row shards: ``name -> (local tensor, global shape, row offset)``, every name on
        every rank (an empty local tensor where a rank holds no rows). ``owned``: the tensors are a
        fresh export the publisher may keep as the next base instead of copying."""
        self._background.settle()
        try:
            local, rows = sr.local_rows(tensors)
        except Exception as err:
            return self._publish(None, None, step, owned=owned, early=err)
        return self._publish(local, rows, step, owned=owned, allow_nonfinite=allow_nonfinite)

    def _go(self, version: int) -> None:
        """Rank 0 renews the claim; every rank learns whether the version may go on."""
        go = Go()
        if self._writer is not None:
            try:
                self._writer.check_open()
                self._writer.renew()
            except (WriterConflict, RunError) as err:
                go = Go(str(err))
        try:
            go = self._comm.bcast(go)
        except Exception as err:
            self._closed = True
            raise ShardedPublishError(f"version {version}: the process group failed before publishing: {err}") from err
        if go.error is not None:
            self._closed = True
            raise ShardedPublishError(f"version {version}: {go.error}")

    def _publish(
        self, local: dict[str, Any] | None, rows: sr.Rows | None, step: int, *, owned: bool, early: Exception | None = None,
        allow_nonfinite: bool = False,
    ) -> VersionInfo:
        if self._closed:
            raise RunError(f"sharded publisher of run {self.run!r} is closed")
        t0 = time.perf_counter()
        version = self._next
        self._go(version)
        if self.config.serve_as is not None:
            local, rows, early, owned = self._serving(local, rows, early, owned, version)
        keyframe = version % self.keyframe_interval == 0
        digest = keyframe or version % self.digest_interval == 0 or self._force_digest
        # _prev is set only by a commit, on every rank alike, so every rank takes this branch or none
        resumed = version > 0 and self._prev is None
        if resumed:
            early = self._resume(local, rows, version) or early
        uploads = UploadPool(self._pool, self.max_in_flight)
        encode_s = upload_wait_s = 0.0
        try:
            if early is not None:
                raise early
            assert local is not None
            assert rows is not None
            te = time.perf_counter()
            report = self._encode_and_upload(local, rows, version, uploads, digest, allow_nonfinite)
            encode_s = time.perf_counter() - te
            tu = time.perf_counter()
            refs = uploads.results()
            upload_wait_s = time.perf_counter() - tu
            report = RankReport(
                None, report.specs, report.ranges, report.chunks, report.bases, report.changed, report.digest,
                segments=tuple(r for r in refs if not isinstance(r, KeyframePart)),
                parts=tuple(r for r in refs if isinstance(r, KeyframePart)),
            )
            self._progress(version, "gathered")
        except Exception as err:
            discard(self.store, uploads)
            report = RankReport(f"{type(err).__name__}: {err}")
        outcome = self._commit_collectively(version, step, report, uploads)
        if outcome.error is not None:
            discard(self.store, uploads)
            if resumed:  # every rank resumes again on the next call (a rank that failed early got no rows)
                self._prev = None
            raise ShardedPublishError(f"version {version} not committed: {outcome.error}")
        assert local is not None
        assert outcome.stats is not None
        self._prev = local if owned else {name: t.detach().clone() for name, t in local.items()}
        self._prev_finite = not allow_nonfinite
        self._head_id, self._next = outcome.version_id, version + 1
        self._force_digest = False
        return VersionInfo(
            version=version, version_id=outcome.version_id, step=step, kind=outcome.kind,
            manifest_key=outcome.manifest_key, stats=outcome.stats, segment_keys=outcome.segment_keys,
            keyframe_keys=outcome.keyframe_keys, state_digest=outcome.state_digest, encode_s=encode_s,
            upload_s=uploads.busy_s, upload_wait_s=upload_wait_s, commit_s=outcome.commit_s,
            wall_s=time.perf_counter() - t0, keyframe_bytes=outcome.keyframe_bytes, ranks=self.world,
            local_encoded_bytes=sum(r.size for r in report.segments),
        )  # fmt: skip

    def _serving(self, local: dict[str, Any] | None, rows: sr.Rows | None, early: Exception | None, owned: bool,
                 version: int) -> tuple[dict[str, Any] | None, sr.Rows | None, Exception | None, bool]:
        """This rank's shard of the FP8 serving state (:mod:`deltarl.pipeline.sharded_fp8`;
        collective), or the error that fails the version on this rank."""
        try:
            plan, amax, early = reduce_block_maxima(self._comm, local, rows, early)
        except Exception as err:  # a collective failed: a rank died
            self._closed = True
            raise ShardedPublishError(f"version {version}: the process group failed while reducing FP8 block scales: {err}") from err
        if early is not None:
            return None, None, early, owned
        assert local is not None
        assert rows is not None
        try:
            local, rows = quantize_shard(local, rows, plan, amax, owned)
        except Exception as err:
            return None, None, err, owned
        return local, rows, None, True

    def _resume(self, local: dict[str, Any] | None, rows: sr.Rows | None, version: int) -> Exception | None:
        want = None if local is None or rows is None else {
            name: (start, tuple(local[name].shape)) for name, (_, start) in rows.items()}
        try:
            mine, error = resume_rows(self._comm, self.store, self.run, version - 1, want)
        except Exception as err:  # a collective failed: a rank died
            self._closed = True
            raise ShardedPublishError(f"version {version}: the process group failed while resuming: {err}") from err
        if mine is not None:
            self._prev = mine
        return error

    def _commit_collectively(self, version: int, step: int, report: RankReport, uploads: UploadPool) -> Outcome:
        """Gather every rank's report, commit on rank 0, broadcast the outcome."""
        outcome = Outcome("not reached")
        try:
            reports = self._comm.gather(report)
            if self._writer is not None:
                assert reports is not None
                outcome = self._commit(version, step, reports)
            return self._comm.bcast(outcome)
        except Exception as err:  # a rank died: the process group is broken
            self._closed = True
            if self._writer is not None and outcome.error is None:
                raise ShardedPublishError(
                    f"version {version} was committed, but the process group failed before every rank learned it: {err}"
                ) from err
            if self._writer is not None:  # only rank 0 knows nothing was committed; other ranks leave their objects to gc
                discard(self.store, uploads)
            raise ShardedPublishError(f"version {version} not committed (or not known to be): the process group failed: {err}") from err

    def _encode_and_upload(self, local: dict[str, Any], rows: sr.Rows, version: int, uploads: UploadPool,
                           digest: bool, allow_nonfinite: bool) -> RankReport:
        """This rank's segments (and keyframe parts) submitted for upload; its report without refs."""
        from deltarl.codec.encode import iter_encode_rows
        from deltarl.codec.segment import read_segment_header

        chunks: list[tuple[str, int, int]] = []
        bases: set[str] = set()
        changed = 0
        # a whole-state check where the base is not known finite (version 0, a resume); else the encoder's
        check = check_before_encode(local, allow_nonfinite=allow_nonfinite, base_finite=self._prev_finite and version > 0)
        if version > 0:
            assert self._prev is not None
            assert self._head_id is not None
            it = iter_encode_rows(self._prev, local, rows, base=self._head_id, segment_bytes=self.config.segment_bytes,
                                  codec=self.config.codec, threads=self.encode_threads, check_finite=check)
            for i, seg in enumerate(it):
                header = read_segment_header(seg)
                bases.add(header.base)
                chunks.extend((c.tensor, c.start, c.count) for c in header.chunks)
                changed += sum(c.changed for c in header.chunks)
                key = self.layout.segment(version, i, epoch=self.epoch, rank=self.rank)
                uploads.submit(upload_object, self.store, key, seg, self.config.piece_size)
                self._progress(version, "segments")
        if version % self.keyframe_interval == 0:
            for i, ranges in enumerate(sr.plan_local_parts(local, rows)):
                key = self.layout.keyframe_part(version, i, epoch=self.epoch, rank=self.rank)
                uploads.submit(self._upload_part, key, local, rows, ranges)
        return RankReport(
            None, specs=tuple(sorted((s.name, s.dtype, s.shape) for s, _ in rows.values())),
            ranges=tuple(sr.held_ranges(local, rows)), chunks=tuple(chunks), bases=tuple(sorted(bases)),
            changed=changed, digest=shard_hashes(local, rows) if digest else None,
        )

    def _upload_part(self, key: str, local: dict[str, Any], rows: sr.Rows, ranges: list[sr.TensorRange]) -> KeyframePart:
        """Stream one keyframe part of this rank's rows to ``key``, hashed in the same pass."""
        return stream_part(self.store, key, sr.iter_local_part(local, rows, ranges), ranges,
                           piece_size=self.config.piece_size)

    # --- rank 0: check and commit ---------------------------------------------------------------------
    def _commit(self, version: int, step: int, reports: list[RankReport]) -> Outcome:
        writer = self._writer
        assert writer is not None
        failed = describe_errors(reports)
        if failed is not None:
            return Outcome(failed)
        try:
            table = [TensorSpec(n, d, tuple(sh)) for n, d, sh in sorted({s for r in reports for s in r.specs})]
            if len({t.name for t in table}) != len(table) or any(r.specs != reports[0].specs for r in reports):
                raise RunError("ranks disagree on the tensor table (names, dtypes or global shapes)")
            writer.check_table(table)
            sr.check_cover(table, [x for r in reports for x in r.ranges], f"version {version} shards")
            if version > 0:
                sr.check_cover(table, [c for r in reports for c in r.chunks], f"version {version} delta chunks")
                bases = {b for r in reports for b in r.bases}
                if bases - {writer.head_id}:
                    raise RunError(f"version {version}: segments encoded against {sorted(bases)}, not {writer.head_id}")
            value = combine_digest(table, [r.digest for r in reports if r.digest is not None]) if reports[0].digest else None
            committed = writer.commit(
                version, step, table, segments=[s for r in reports for s in r.segments],
                parts=[p for r in reports for p in r.parts], changed=sum(r.changed for r in reports),
                digest=None if value is None else StateDigest(ALGO, value),
            )
        except Exception as err:
            logger.warning("run %s: version %d not committed: %s", self.run, version, err)
            if isinstance(err, WriterConflict):
                self._closed = True
            return Outcome(f"rank 0: {type(err).__name__}: {err}")
        m = committed.manifest
        logger.info("published %s v%d from %d ranks: %d segments, %d bytes, changed %.4f%%", self.run, version,
                    self.world, len(m.segments), m.stats.encoded_bytes, 100 * m.stats.changed_fraction)
        return Outcome(None, committed.version_id, m.key, m.kind, m.stats, tuple(s.key for s in m.segments),
                       () if m.keyframe is None else m.keyframe.keys, m.state_digest,
                       0 if m.keyframe is None else m.keyframe.size, committed.commit_s)

    # --- lifetime ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for a background publish and uploads, and (rank 0) release the writer claim. Not
        collective. A background failure not yet raised by another call is logged, not raised."""
        if getattr(self, "_background", None) is not None:
            self._background.shutdown()
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=True)
        self._closed = True
        if self._writer is not None:
            self._writer.release()

    def __enter__(self) -> ShardedPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
