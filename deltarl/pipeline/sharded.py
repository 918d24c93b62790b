"""Publish from every rank of a sharded trainer: one version, encoded and uploaded in parallel.

Per version, every rank of the group encodes its own rows (a dim-0 shard of each tensor) against
its own previous rows, with chunks at global element positions, and uploads its segments under
per-rank keys (``e<epoch>-seg-r<rank>-<i>.bin``) with ``put_if_absent``. Rank 0 holds the writer
claim: it gathers every rank's segment refs and chunk tables (``gather_object``), checks that the
chunks cover every element of every tensor exactly once against one base, writes the manifest (the
commit), moves HEAD, and broadcasts the outcome. Ranks adopt their new rows as the next base only
after that commit; if any rank fails, no manifest is written, every base stays, and every rank
raises :class:`~deltarl.errors.ShardedPublishError` (objects already uploaded are deleted where
possible and otherwise left for ``gc``). Keyframes are parts written by every rank; the
``blocks64k-v2`` digest is computed rank by rank (:mod:`deltarl.pipeline.shard_digest`).

Memory per rank: its previous rows, its new rows, and a few encoded segments in flight. A job that
resumes a run gets its base rows from rank 0, which replays the HEAD version once (verified) and
scatters each tensor's rows to the rank that holds them: one process holds the full state for the
time of the resume, not every rank.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from deltarl.codec.finite import check_before_encode
from deltarl.errors import ObjectExists, RunError, ShardedPublishError, StoreError, WriterConflict, short_pair
from deltarl.pipeline import shard_rows as sr
from deltarl.pipeline.background import BackgroundPublishing
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
from deltarl.pipeline.pieces import PieceHasher
from deltarl.pipeline.reader import RunReader
from deltarl.pipeline.shard_digest import ALGO, combine_digest, shard_hashes
from deltarl.pipeline.uploads import UploadPool
from deltarl.storage.store import ObjectStore

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ShardedVersionInfo:
    """What one sharded publish committed (the same on every rank) and this rank's share of it."""

    version: int
    version_id: str
    step: int
    kind: str
    stats: DeltaStatsRecord
    segments: int
    local_encoded_bytes: int
    encode_s: float
    upload_wait_s: float
    commit_s: float
    wall_s: float


def encode_threads_per_rank() -> int:
    """Encode threads for one rank: ``DELTARL_THREADS``, else the node's cores over its local ranks."""
    from deltarl.codec.kernels import worker_threads

    if os.environ.get("DELTARL_THREADS"):
        return worker_threads()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(4, worker_threads() // max(1, local)))


def _rows_outside(full: Mapping[str, Any], wants: Sequence[dict[str, tuple[int, tuple[int, ...]]] | None], version: int
                  ) -> str | None:
    """Why some rank's rows do not lie inside the replayed tensors (nothing could be sent), or None."""
    import math

    for rank, want in enumerate(wants):
        for name, (start, shape) in (want or {}).items():
            if name in full and start + math.prod(shape) > full[name].numel():
                return (f"rank {rank} holds elements [{start}, {start + math.prod(shape)}) of tensor {name!r}, "
                        f"which has {full[name].numel()} at version {version}")
    return None


class ShardedPublisher:
    """Publishes versions of one run from every rank of ``group`` (collective: call on all ranks)."""

    #: backends whose point-to-point calls move CPU tensors (a resume sends rows that way; other
    #: backends, NCCL, get them through ``scatter_object_list``)
    _p2p_backends: frozenset[str] = frozenset({"gloo"})

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        group: Any = None,
        *,
        keyframe_interval: int = 50,
        digest_interval: int = 10,
        segment_bytes: int = 16 << 20,
        codec: str = "auto",
        upload_workers: int = 4,
        encode_threads: int | None = None,
        writer_id: str | None = None,
        lease_s: float = 300.0,
        takeover: bool = False,
        on_stage: Callable[[int, str], None] | None = None,
    ) -> None:
        import torch.distributed as dist

        if keyframe_interval < 1 or digest_interval < 1 or segment_bytes < 1 or upload_workers < 1:
            raise ValueError("keyframe_interval, digest_interval, segment_bytes and upload_workers must be >= 1")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0) if group is not None else 0
        self.store = store
        self.layout = RunLayout(run)
        self.run = self.layout.run
        self.segment_bytes = segment_bytes
        self.codec = codec
        self.max_in_flight = upload_workers + 2
        self.encode_threads = encode_threads or encode_threads_per_rank()
        self.reader = RunReader(store, run)
        self._on_stage = on_stage  # as Publisher's: observation and fault injection in tests
        self._lease: WriterLease | None = None
        self._prev: dict[str, Any] | None = None
        self._prev_finite = False  # as Publisher's: the base rows are known to hold no NaN/Inf
        self._head_etag: str | None = None
        self._closed = False
        state: dict[str, Any] = {"error": None}
        if self.rank == 0:
            try:
                wid = writer_id or new_writer_id()
                self._lease = WriterLease(store, run, wid, lease_s=lease_s, takeover=takeover)
                self._lease.acquire()
                state.update(self._open_root(keyframe_interval, digest_interval, wid))
            except Exception as err:  # every rank learns why opening failed
                state["error"] = f"{type(err).__name__}: {err}"
                if self._lease is not None:
                    self._lease.release()
        state = self._bcast(state)
        if state["error"] is not None:
            raise ShardedPublishError(f"rank 0 could not open run {self.run!r}: {state['error']}")
        self.writer_id: str = state["writer_id"]
        self.epoch: int = state["epoch"]
        self.keyframe_interval, self.digest_interval = state["intervals"]
        self._next: int = state["next"]
        self._head_id: str | None = state["head_id"]
        self._force_digest = self._head_id is not None
        self._pool = ThreadPoolExecutor(upload_workers, thread_name_prefix="deltarl-upload")
        self._background: BackgroundPublishing[ShardedVersionInfo] = BackgroundPublishing(self.run, lambda: self._closed)

    # --- collectives -----------------------------------------------------------------------------------

    def _stage(self, version: int, stage: str) -> None:
        if self._on_stage is not None:
            self._on_stage(version, stage)
    def _bcast(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._root, group=self.group)
        return box[0]

    def _gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._dist.gather_object(obj, out, dst=self._root, group=self.group)
        return out

    # --- rank 0: the run's records --------------------------------------------------------------------
    def _open_root(self, keyframe_interval: int, digest_interval: int, wid: str) -> dict[str, Any]:
        assert self._lease is not None
        intervals = (keyframe_interval, digest_interval)
        if self.store.exists(self.layout.run_json):
            info = self.reader.info()
            intervals = (info.keyframe_interval, info.digest_interval)
        head_id, nxt = None, 0
        head = self.reader.head_with_etag()
        if head is not None:
            record, self._head_etag = head
            _, vid = self.reader.manifest(record.version)
            if vid != record.version_id:
                named, has = short_pair(record.version_id, vid)
                raise RunError(f"{self.layout.head}: names id {named}, manifest has {has}")
            head_id, nxt = vid, record.version + 1
        while self.reader.has_manifest(nxt):  # committed by a writer that died before moving HEAD
            manifest, vid = self.reader.manifest(nxt)
            if manifest.parent != head_id:
                raise RunError(f"{manifest.key}: parent does not match {self.layout.head}; the run needs repair")
            self._move_head(nxt, vid)
            head_id, nxt = vid, nxt + 1
        return {"writer_id": wid, "epoch": self._lease.epoch, "intervals": intervals, "next": nxt, "head_id": head_id}

    def _move_head(self, version: int, vid: str) -> None:
        record = HeadRecord(version=version, version_id=vid, writer_id=self.writer_id_root()).to_bytes()
        try:
            self._head_etag = self.store.cas(self.layout.head, record, self._head_etag)
        except StoreError as err:
            current = self.reader.head_with_etag()
            if current is None or current[0].to_bytes() != record:
                raise WriterConflict(f"{self.layout.head} moved underneath this writer; version {version} is committed") from err
            self._head_etag = current[1]

    def writer_id_root(self) -> str:
        assert self._lease is not None
        return self._lease.writer_id

    def _run_info(self, table: list[Any]) -> RunInfo:
        from deltarl.pipeline.publisher import utc_now

        info = RunInfo(
            run=self.run,
            tensors=tuple(table),
            codec=self.codec,
            keyframe_interval=self.keyframe_interval,
            digest_interval=self.digest_interval,
            segment_bytes=self.segment_bytes,
            created_at=utc_now(),
        )
        try:
            self.store.put_if_absent(self.layout.run_json, info.to_bytes())
        except ObjectExists:
            return self.reader.info()
        return info

    # --- publishing ------------------------------------------------------------------------------------
    @property
    def next_version(self) -> int:
        return self._next

    def publish_model(self, model: Any, step: int, *, allow_nonfinite: bool = False) -> ShardedVersionInfo:
        """Publish this rank's share of an FSDP2/DTensor ``model`` (BF16 export of local shards, no gather).

        A NaN or Inf on any rank fails the version on every rank (``ShardedPublishError`` naming the
        rank and tensor) unless ``allow_nonfinite=True``; as for :class:`Publisher`, only a version's
        changed elements are checked once its base is known finite."""
        self._background.settle()
        local, rows, early = self._export(model)
        return self._publish(local, rows, step, owned=True, early=early, allow_nonfinite=allow_nonfinite)

    def publish_model_async(
        self, model: Any, step: int, *, on_published: Callable[[ShardedVersionInfo], None] | None = None,
        allow_nonfinite: bool = False,
    ) -> Future[ShardedVersionInfo]:
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

        def publish() -> ShardedVersionInfo:
            info = self._publish(local, rows, step, owned=True, early=early, allow_nonfinite=allow_nonfinite)
            if on_published is not None:
                on_published(info)
            return info

        return self._background.submit(publish)

    def wait(self) -> ShardedVersionInfo | None:
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
    ) -> ShardedVersionInfo:
        """Publish plain row shards: ``name -> (local tensor, global shape, row offset)``, every name on
        every rank (an empty local tensor where a rank holds no rows). ``owned``: the tensors are a
        fresh export the publisher may keep as the next base instead of copying."""
        self._background.settle()
        try:
            local, rows = sr.local_rows(tensors)
        except Exception as err:
            return self._publish(None, None, step, owned=owned, early=err)
        return self._publish(local, rows, step, owned=owned, allow_nonfinite=allow_nonfinite)

    def _publish(
        self, local: dict[str, Any] | None, rows: sr.Rows | None, step: int, *, owned: bool, early: Exception | None = None,
        allow_nonfinite: bool = False,
    ) -> ShardedVersionInfo:
        if self._closed:
            raise RunError(f"sharded publisher of run {self.run!r} is closed")
        t0 = time.perf_counter()
        version = self._next
        plan: dict[str, Any] = {"error": None}
        if self.rank == 0:
            try:
                assert self._lease is not None
                self._lease.renew()
            except WriterConflict as err:
                plan["error"] = str(err)
        try:
            plan = self._bcast(plan)
        except Exception as err:
            self._closed = True
            raise ShardedPublishError(f"version {version}: the process group failed before publishing: {err}") from err
        if plan["error"] is not None:
            self._closed = True
            raise ShardedPublishError(f"version {version}: {plan['error']}")
        keyframe = version % self.keyframe_interval == 0
        digest = keyframe or version % self.digest_interval == 0 or self._force_digest
        # _prev is set only by a commit, on every rank alike, so every rank takes this branch or none
        resumed = version > 0 and self._prev is None
        try:
            resume_error = self._resume_rows(local, rows) if resumed else None
        except Exception as err:  # a collective failed: a rank died
            self._closed = True
            raise ShardedPublishError(f"version {version}: the process group failed while resuming: {err}") from err
        uploads = UploadPool(self._pool, self.max_in_flight)
        report: dict[str, Any]
        encode_s = upload_wait_s = 0.0
        try:
            if early is not None:
                raise early
            if resume_error is not None:
                raise resume_error
            assert local is not None
            assert rows is not None
            report = {"error": None, "specs": sorted((s.name, s.dtype, s.shape) for s, _ in rows.values())}
            report["ranges"] = sr.held_ranges(local, rows)
            te = time.perf_counter()
            check_changes = check_before_encode(local, allow_nonfinite=allow_nonfinite,
                                                base_finite=self._prev_finite and version > 0)
            report.update(self._encode(local, rows, version, uploads, check_changes) if version > 0 else {"chunks": [], "changed": 0})
            if keyframe:
                for i, ranges in enumerate(sr.plan_local_parts(local, rows)):
                    key = self.layout.keyframe_part(version, i, epoch=self.epoch, rank=self.rank)
                    uploads.submit(self._upload_part, key, local, rows, ranges)
            report["digest"] = shard_hashes(local, rows) if digest else None
            encode_s = time.perf_counter() - te
            tu = time.perf_counter()
            refs = uploads.results()
            upload_wait_s = time.perf_counter() - tu
            report["segments"] = [r for r in refs if not isinstance(r, KeyframePart)]
            report["parts"] = [r for r in refs if isinstance(r, KeyframePart)]
            self._stage(version, "gathered")
        except Exception as err:
            self._discard(uploads)
            report = {"error": f"{type(err).__name__}: {err}"}
        tc = time.perf_counter()
        outcome: dict[str, Any] = {"error": "not reached"}
        try:
            reports = self._gather(report)
            if self.rank == 0:
                assert reports is not None
                outcome = self._commit(version, step, reports, keyframe, digest)
            outcome = self._bcast(outcome)
        except Exception as err:  # a rank died: the process group is broken
            self._closed = True
            if self.rank == 0 and outcome["error"] is None:
                raise ShardedPublishError(
                    f"version {version} was committed, but the process group failed before every rank learned it: {err}"
                ) from err
            if self.rank == 0:  # only rank 0 knows nothing was committed; other ranks leave their objects to gc
                self._discard(uploads)
            raise ShardedPublishError(f"version {version} not committed (or not known to be): the process group failed: {err}") from err
        if outcome["error"] is not None:
            self._discard(uploads)
            if resumed:  # every rank resumes again on the next call (a rank that failed early got no rows)
                self._prev = None
            raise ShardedPublishError(f"version {version} not committed: {outcome['error']}")
        assert local is not None
        self._prev = local if owned else {name: t.detach().clone() for name, t in local.items()}
        self._prev_finite = not allow_nonfinite
        self._head_id, self._next = outcome["version_id"], version + 1
        self._force_digest = False
        return ShardedVersionInfo(
            version=version,
            version_id=outcome["version_id"],
            step=step,
            kind="keyframe" if keyframe else "delta",
            stats=outcome["stats"],
            segments=outcome["segments"],
            local_encoded_bytes=sum(r.size for r in report["segments"]),
            encode_s=encode_s,
            upload_wait_s=upload_wait_s,
            commit_s=time.perf_counter() - tc,
            wall_s=time.perf_counter() - t0,
        )

    def _encode(self, local: dict[str, Any], rows: sr.Rows, version: int, uploads: UploadPool, check_finite: bool
                ) -> dict[str, Any]:
        from deltarl.codec.encode import iter_encode_rows
        from deltarl.codec.segment import read_segment_header

        assert self._prev is not None
        assert self._head_id is not None
        chunks: list[tuple[str, int, int]] = []
        bases: set[str] = set()
        changed = 0
        it = iter_encode_rows(
            self._prev, local, rows, base=self._head_id, segment_bytes=self.segment_bytes, codec=self.codec,
            threads=self.encode_threads, check_finite=check_finite,
        )
        for i, seg in enumerate(it):
            header = read_segment_header(seg)
            bases.add(header.base)
            chunks.extend((c.tensor, c.start, c.count) for c in header.chunks)
            changed += sum(c.changed for c in header.chunks)
            key = self.layout.segment(version, i, epoch=self.epoch, rank=self.rank)
            uploads.submit(self._upload, key, seg)
            self._stage(version, "segments")
        return {"chunks": chunks, "bases": sorted(bases), "changed": changed}

    def _upload(self, key: str, data: bytes) -> ObjectRef:
        ref = ObjectRef.of(key, data)
        self.store.put_if_absent(key, data)
        return ref

    def _upload_part(self, key: str, local: dict[str, Any], rows: sr.Rows, ranges: list[sr.TensorRange]) -> KeyframePart:
        """Stream one keyframe part of this rank's rows to ``key``, hashed in the same pass."""
        hasher = PieceHasher()

        def hashed() -> Iterator[memoryview]:
            for buf in sr.iter_local_part(local, rows, ranges):
                hasher.update(buf)
                yield buf

        self.store.put_stream_if_absent(key, hashed())
        sha, size, pieces = hasher.finish()
        return KeyframePart(key=key, sha256=sha, size=size, piece_size=hasher.piece_size, pieces=tuple(pieces), tensors=tuple(ranges))

    def _discard(self, uploads: UploadPool) -> None:
        """After a failed version: wait for this rank's uploads and delete what they wrote (best effort)."""
        futures, uploads.futures = uploads.futures, []
        for f in futures:
            if f.exception() is None:
                try:
                    self.store.delete(f.result().key)
                except StoreError as err:
                    logger.warning("could not delete %s after a failed publish (gc will): %s", f.result().key, err)

    def _resume_rows(self, local: dict[str, Any] | None, rows: sr.Rows | None) -> Exception | None:
        """Every rank's rows of the HEAD version, as its base (``_prev``). Collective: rank 0 replays
        the version from the store (verified) and sends each tensor's rows to the rank that holds
        them, dropping each full tensor once sent. Returns the error to fail this version with on
        this rank (the replay's, named on every rank), or None. A rank without rows (its export
        failed) takes part and receives nothing."""
        from deltarl.pipeline.replay import replay

        head = self._next - 1
        want = None if local is None or rows is None else {
            name: (start, tuple(local[name].shape)) for name, (_, start) in rows.items()}
        wants = self._gather(want)
        full: dict[str, Any] = {}
        status: dict[str, Any] = {"error": None, "dtypes": {}}
        t0 = time.perf_counter()
        if self.rank == 0:
            logger.info("run %s: replaying version %d to resume; its rows go to each of %d ranks", self.run, head, self.world)
            try:
                full = replay(self.store, self.run, head)
                status["dtypes"] = {name: str(t.dtype).removeprefix("torch.") for name, t in sorted(full.items())}
                status["error"] = _rows_outside(full, wants or [], head)
            except Exception as err:  # every rank fails the version with it
                status["error"] = f"{type(err).__name__}: {err}"
        status = self._bcast(status)
        if status["error"] is not None:
            return RunError(f"resuming from version {head}: {status['error']}")
        t1 = time.perf_counter()
        mine = self._send_rows(full, wants, want, status["dtypes"])
        if self.rank == 0:
            logger.info("run %s: resumed from version %d (replay %.1f s, rows sent in %.1f s)", self.run, head,
                        t1 - t0, time.perf_counter() - t1)
        if want is None:
            return None
        missing = sorted(set(want) - set(mine))
        if missing:
            return RunError(f"resuming from version {head}: it has no tensor {missing[0]!r} ({len(missing)} missing)")
        self._prev = mine
        return None

    def _send_rows(self, full: dict[str, Any], wants: list[Any] | None, want: dict[str, Any] | None,
                   dtypes: dict[str, str]) -> dict[str, Any]:
        """Rank 0 sends each rank its rows of ``full`` (emptied as it goes); every rank returns its own.
        On gloo point to point as raw bytes; on other backends with ``scatter_object_list``."""
        import math

        import torch

        p2p = self.world > 1 and self._dist.get_backend(self.group) in self._p2p_backends
        mine: dict[str, Any] = {}
        for name, dtype_name in dtypes.items():
            dtype = getattr(torch, dtype_name)
            if self.rank == 0:
                assert wants is not None
                flat = full.pop(name).reshape(-1)
                pieces = [None if w is None or name not in w else flat[w[name][0]: w[name][0] + math.prod(w[name][1])]
                          for w in wants]
                if pieces[0] is not None:
                    mine[name] = pieces[0].clone().reshape(wants[0][name][1])
                if p2p:
                    for r, piece in enumerate(pieces[1:], start=1):
                        if piece is not None and piece.numel():
                            self._dist.send(piece.contiguous().view(torch.uint8), dst=self._global_rank(r), group=self.group)
                elif self.world > 1:  # clones: a pickled view would carry its whole storage
                    inputs = [None, *(None if p is None else p.clone() for p in pieces[1:])]
                    self._dist.scatter_object_list([None], inputs, src=self._root, group=self.group)
                del flat, pieces
                continue
            if p2p:
                if want is not None and name in want:
                    count = math.prod(want[name][1])
                    raw = torch.empty(count * torch.empty((), dtype=dtype).element_size(), dtype=torch.uint8)
                    if count:
                        self._dist.recv(raw, src=self._root, group=self.group)
                    mine[name] = raw.view(dtype).reshape(want[name][1])
            else:
                out: list[Any] = [None]
                self._dist.scatter_object_list(out, None, src=self._root, group=self.group)
                if out[0] is not None:
                    mine[name] = out[0].reshape(want[name][1]) if want is not None and name in want else out[0]
        return mine

    def _global_rank(self, rank: int) -> int:
        return int(self._dist.get_global_rank(self.group, rank)) if self.group is not None else rank

    # --- rank 0: check and commit ---------------------------------------------------------------------
    def _commit(self, version: int, step: int, reports: list[dict[str, Any]], keyframe: bool, digest: bool) -> dict[str, Any]:
        from deltarl.codec.tensors import TensorSpec
        from deltarl.pipeline.publisher import utc_now

        errors: dict[str, list[int]] = {}
        for rank, r in enumerate(reports):
            if r["error"] is not None:
                errors.setdefault(r["error"], []).append(rank)
        if errors:
            return {"error": "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {e}" for e, rs in errors.items())}
        try:
            specs = {tuple(s) for r in reports for s in r["specs"]}
            table = [TensorSpec(n, d, tuple(sh)) for n, d, sh in sorted(specs)]
            if len({t.name for t in table}) != len(table) or any(r["specs"] != reports[0]["specs"] for r in reports):
                raise RunError("ranks disagree on the tensor table (names, dtypes or global shapes)")
            if version == 0 or not self.store.exists(self.layout.run_json):
                info = self._run_info(table)
            else:
                info = self.reader.info()
            if list(info.tensors) != table:
                raise RunError(f"{self.layout.run_json} has another tensor table than the shards")
            sr.check_cover(table, [x for r in reports for x in r["ranges"]], f"version {version} shards")
            if version > 0:
                sr.check_cover(table, [tuple(c) for r in reports for c in r["chunks"]], f"version {version} delta chunks")
                bases = {b for r in reports for b in r.get("bases", [])}
                if bases - {self._head_id}:
                    raise RunError(f"version {version}: segments encoded against {sorted(bases)}, not {self._head_id}")
            segments = tuple(ref for r in reports for ref in r["segments"])
            parts = tuple(p for r in reports for p in r["parts"])
            kf = Keyframe(parts) if keyframe else None
            if kf is not None:
                kf.check_covers(table, f"version {version} keyframe")
            value = combine_digest(table, [r["digest"] for r in reports]) if digest else None
            full_elems = sum(t.numel for t in table)
            full_bytes = sum(t.numel * _DTYPE_BYTES[t.dtype] for t in table)
            if version == 0:
                stats = DeltaStatsRecord(full_elems, full_elems, sum(p.size for p in parts), full_bytes)
            else:
                stats = DeltaStatsRecord(sum(r["changed"] for r in reports), full_elems, sum(s.size for s in segments), full_bytes)
            manifest = Manifest(
                run=self.run,
                version=version,
                step=step,
                parent=self._head_id,
                kind="keyframe" if keyframe else "delta",
                base_version=None if version == 0 else version - 1,
                segments=segments,
                keyframe=kf,
                stats=stats,
                state_digest=None if value is None else StateDigest(ALGO, value),
                codec=self.codec,
                created_at=utc_now(),
                writer_id=self.writer_id,
            )
            assert self._lease is not None
            self._lease.renew()  # fenced by a newer epoch: stop before committing
            data = manifest.to_bytes()
            try:
                self.store.put_if_absent(manifest.key, data)
            except ObjectExists as err:
                if self.store.get(manifest.key) != data:
                    raise WriterConflict(f"{manifest.key}: another writer committed this version first") from err
            self._stage(version, "manifest")
            vid = manifest.version_id
            self._move_head(version, vid)
        except Exception as err:
            logger.warning("run %s: version %d not committed: %s", self.run, version, err)
            if isinstance(err, WriterConflict):
                self._closed = True
            return {"error": f"rank 0: {type(err).__name__}: {err}"}
        logger.info(
            "published %s v%d from %d ranks: %d segments, %d bytes, changed %.4f%%",
            self.run, version, self.world, len(segments), stats.encoded_bytes, 100 * stats.changed_fraction,
        )  # fmt: skip
        return {"error": None, "version_id": vid, "stats": stats, "segments": len(segments)}

    # --- lifetime ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for a background publish and uploads, and (rank 0) release the writer claim. Not
        collective. A background failure not yet raised by another call is logged, not raised."""
        if getattr(self, "_background", None) is not None:
            self._background.shutdown()
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=True)
        self._closed = True
        if self._lease is not None:
            self._lease.release()

    def __enter__(self) -> ShardedPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
