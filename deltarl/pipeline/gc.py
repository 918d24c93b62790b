"""Garbage collection of a run: orphans of interrupted publishes, and (on request) old versions.

*Orphans* are segments and keyframes that no committed manifest names: left by a publisher that
crashed before its manifest, or by a gc that stopped half way. Objects of the version after the
last committed one may belong to a publish still in flight; instead of guessing from object ages,
gc sweeps them only after *fencing* the writer claim (see :mod:`deltarl.pipeline.claim`): it takes
an expired claim (or any claim with ``force``), so a writer that is still alive fails its next
renewal instead of committing a manifest that names swept objects. A live claim means "in
flight": those objects are left alone and reported with the claim, so the caller can say when its
lease expires (a dry run reports the same without fencing).

*Pending writes* are what a writer killed mid-write leaves in the store without it ever becoming an
object (:meth:`ObjectStore.pending_writes`: a local temp file, an S3 multipart upload and its
parts). They are swept on the same terms, after the same fencing, and only once untouched for
``pending_grace_s`` (so a write in progress of another writer of the run, the coordinator's
records, is never cut); their bytes count in ``freed_bytes``.

gc refuses to act on a run it cannot read safely, and then removes nothing: a run with no objects
at all (a typo'd name); committed versions without a readable run.json; a HEAD that names a
version whose manifest is missing, or another id than that manifest's (a damaged HEAD would make
a live writer's in-flight objects look like orphans of committed versions).

``keep_last=N`` also removes old versions while keeping what replay of the last N needs: the
newest keyframe at or before the oldest kept version that *verifies*, and every version after it
(:mod:`deltarl.pipeline.retention` checks it by its hashes before anything is deleted; a damaged
keyframe is passed over for an older one, so its fallback is never removed). Versions are removed
oldest first, manifest before objects, so a gc that stops half way leaves a contiguous,
replayable suffix plus orphans that the next gc removes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from deltarl.errors import FormatError, ObjectNotFound, RunError, WriterConflict
from deltarl.pipeline.claim import WriterClaim, fence_claim, read_claim
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.reader import RunReader
from deltarl.pipeline.retention import Retention, plan_retention
from deltarl.storage.store import ObjectStore, PendingWrite

logger = logging.getLogger(__name__)

#: How long a pending write must have been left untouched before gc may sweep it (seconds).
PENDING_GRACE_S = 60.0


@dataclass
class GcReport:
    """What gc removed (or, with ``dry_run``, would remove)."""

    run: str
    dry_run: bool
    last_committed: int | None
    orphans: list[str] = field(default_factory=list)
    removed_versions: list[int] = field(default_factory=list)
    removed_keys: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    in_flight: list[str] = field(default_factory=list)
    oldest_kept: int | None = None
    #: Unfinished writes of dead writers removed (or, dry run, that would be), and those left
    #: because a live writer holds the run or they were written to within ``pending_grace_s``.
    pending: list[PendingWrite] = field(default_factory=list)
    pending_left: list[PendingWrite] = field(default_factory=list)
    #: The live claim that kept gc from sweeping ``in_flight`` and ``pending_left``, if one did.
    live_writer: WriterClaim | None = None
    #: Keyframes ``keep_last`` found damaged and passed over (one line each: the object, the reason).
    damaged: list[str] = field(default_factory=list)


def _size(store: ObjectStore, key: str) -> int:
    try:
        return store.head(key).size
    except ObjectNotFound:
        return 0


def gc(
    store: ObjectStore,
    run: str,
    *,
    keep_last: int | None = None,
    dry_run: bool = False,
    force: bool = False,
    pending_grace_s: float = PENDING_GRACE_S,
) -> GcReport:
    """Remove orphans and dead writers' pending writes, and with ``keep_last`` old versions; see the
    module docstring."""
    if keep_last is not None and keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    layout = RunLayout(run)
    reader = RunReader(store, run)
    last = _check_run(store, reader, layout)
    report = GcReport(run=run, dry_run=dry_run, last_committed=last)
    retention: Retention | None = None

    by_version: dict[int, list[str]] = {}
    for key in store.list(layout.versions_prefix):
        parsed = layout.parse_version_key(key)
        if parsed is not None:
            by_version.setdefault(parsed[0], []).append(key)
    keyframes: dict[int, list[str]] = {}
    for key in store.list(layout.keyframes_prefix):
        if (v := layout.parse_keyframe_key(key)) is not None:
            keyframes.setdefault(v, []).append(key)
    listed = {v for v, keys in by_version.items() if layout.manifest(v) in keys}
    if keep_last is not None and last is not None:
        retention = plan_retention(reader, last, keep_last, listed)  # before anything is deleted
        if retention is not None:
            report.damaged = retention.damaged
        else:  # nothing is old enough to go: every stored version stays
            report.oldest_kept = min(listed, default=None)

    in_flight: list[str] = []
    for version in sorted(set(by_version) | set(keyframes)):
        keys = by_version.get(version, [])
        kf = keyframes.get(version, [])
        manifest_key = layout.manifest(version)
        if manifest_key in keys:
            manifest, _ = reader.manifest(version)
            wanted = {ref.key for ref in manifest.segments} | {manifest_key}
            wanted |= set(manifest.keyframe.keys if manifest.keyframe is not None else ())
            dead = [k for k in keys + kf if k not in wanted]  # e.g. a fenced writer's late uploads
        else:
            dead = keys + kf
            if last is None or version > last:
                in_flight.extend(dead)
                continue
        report.orphans.extend(dead)

    _sweep_in_flight(store, layout, in_flight, report, force=force, pending_grace_s=pending_grace_s)
    for key in report.orphans:
        report.freed_bytes += _size(store, key)
        if not dry_run:
            store.delete(key)
            logger.info("gc removed orphan %s", key)
    for write in report.pending:
        report.freed_bytes += write.size
        if not dry_run:
            store.abort_pending(write)
            logger.info("gc removed an unfinished write of %s (%s, %d bytes)", write.key, write.handle, write.size)

    if retention is not None:
        _remove_old_versions(store, reader, layout, retention.keyframe, listed, report)
    return report


def _check_run(store: ObjectStore, reader: RunReader, layout: RunLayout) -> int | None:
    """The last committed version, once the run is known safe to collect: RunError for a run that
    does not exist, committed versions without a readable run.json, and a HEAD naming a version
    whose manifest is missing or another id than that manifest's."""
    refuse = "the run needs repair; gc removes nothing"
    try:
        head = reader.head()
    except ObjectNotFound:
        head = None
        if not store.exists(layout.run_json) and next(iter(store.list(layout.run + "/")), None) is None:
            raise RunError(f"no run {layout.run!r} in {store.url}") from None
    except FormatError as err:
        raise RunError(f"{layout.head}: unreadable ({err}): {refuse}") from err
    if head is not None and not reader.has_manifest(head.version):
        raise RunError(f"{layout.head} names version {head.version}, whose manifest {layout.manifest(head.version)} "
                       f"is missing: {refuse}")  # fmt: skip
    last = reader.last_committed()
    if last is None:
        return None
    try:
        reader.info()
        if head is not None:
            reader.check_head(head.version, reader.manifest(head.version)[1])
    except (FormatError, ObjectNotFound, RunError) as err:
        raise RunError(f"{err}: {refuse}") from err
    return last


def _sweep_in_flight(
    store: ObjectStore, layout: RunLayout, in_flight: list[str], report: GcReport, *, force: bool, pending_grace_s: float
) -> None:
    """Decide about the objects of the version in flight and the run's pending writes: fence the
    writer claim if it is expired (or ``force``) and add them to what is swept, else leave them
    (``report.in_flight``, ``report.pending_left``, ``report.live_writer``). A pending write
    touched within ``pending_grace_s`` is always left, and alone never causes a fence."""
    cutoff = time.time() - pending_grace_s
    pending: list[PendingWrite] = []
    for write in store.pending_writes(layout.prefix):
        (pending if write.touched_at <= cutoff else report.pending_left).append(write)
    if not in_flight and not pending and not report.pending_left:
        return
    claim = read_claim(store, layout.writer)
    live = claim is not None and claim[0].expires_at_ms > int(time.time() * 1000) and not force
    if not in_flight and not pending:  # only writes in progress (or just cut): nothing to fence for
        report.live_writer = claim[0] if live and claim is not None else None
        return
    if not live and not report.dry_run:
        try:
            fenced = fence_claim(store, layout.run, "gc", force=force)
            if fenced is not None:
                logger.info("gc fenced the writer claim of %s (was %s)", layout.run, fenced.describe())
        except WriterConflict as err:  # the claim moved meanwhile (renewed, taken): a writer is active
            logger.warning("gc leaves a publish in flight: %s", err)
            claim, live = read_claim(store, layout.writer), True
    if live:
        report.live_writer = claim[0] if claim is not None else None
        report.in_flight = in_flight
        report.pending_left.extend(pending)
        logger.warning("gc leaves %d objects and %d unfinished writes of a publish in flight: %s holds the run",
                       len(in_flight), len(pending), claim[0].describe() if claim else "a writer")  # fmt: skip
        return
    report.orphans.extend(in_flight)
    report.pending.extend(pending)


def _remove_old_versions(
    store: ObjectStore, reader: RunReader, layout: RunLayout, keyframe: int, listed: set[int], report: GcReport
) -> None:
    """Remove every listed version before ``keyframe`` (the checked one the kept versions start from)."""
    report.oldest_kept = keyframe
    for version in sorted(v for v in listed if v < keyframe):  # oldest first: what remains is a replayable suffix
        manifest, _ = reader.manifest(version)
        keys = [manifest.key, *(ref.key for ref in manifest.segments)]
        report.freed_bytes += _size(store, manifest.key) + sum(ref.size for ref in manifest.segments)
        if manifest.keyframe is not None:
            keys.extend(manifest.keyframe.keys)
            report.freed_bytes += manifest.keyframe.size
        report.removed_versions.append(version)
        report.removed_keys.extend(keys)
        if not report.dry_run:
            for key in keys:
                store.delete(key)
    if report.removed_versions:
        logger.info("gc %s versions %d..%d of %s", "would remove" if report.dry_run else "removed",
                    report.removed_versions[0], report.removed_versions[-1], layout.run)  # fmt: skip
