"""Garbage collection of a run: orphans of interrupted publishes, and (on request) old versions.

*Orphans* are segments and keyframes that no committed manifest names: left by a publisher that
crashed before its manifest, or by a gc that stopped half way. Objects of the version after the
last committed one may belong to a publish still in flight; instead of guessing from object ages,
gc sweeps them only after *fencing* the writer claim (see :mod:`deltarl.pipeline.claim`): it takes
an expired claim (or any claim with ``force``), so a writer that is still alive fails its next
renewal instead of committing a manifest that names swept objects. A live claim means "in
flight": those objects are left alone and reported.

``keep_last=N`` also removes old versions while keeping what replay of the last N needs: the
newest keyframe at or before the oldest kept version, and every version after it. Versions are removed oldest first, manifest before objects, so a gc that stops half way leaves a contiguous,
replayable suffix plus orphans that the next gc removes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from deltarl.errors import ObjectNotFound, WriterConflict
from deltarl.pipeline.claim import fence_claim
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.reader import RunReader
from deltarl.storage.store import ObjectStore

logger = logging.getLogger(__name__)


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
) -> GcReport:
    """Remove orphans, and with ``keep_last`` old versions; see the module docstring."""
    if keep_last is not None and keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    layout = RunLayout(run)
    reader = RunReader(store, run)
    last = reader.last_committed()
    report = GcReport(run=run, dry_run=dry_run, last_committed=last)

    by_version: dict[int, list[str]] = {}
    for key in store.list(layout.versions_prefix):
        parsed = layout.parse_version_key(key)
        if parsed is not None:
            by_version.setdefault(parsed[0], []).append(key)
    keyframes: dict[int, list[str]] = {}
    for key in store.list(layout.keyframes_prefix):
        if (v := layout.parse_keyframe_key(key)) is not None:
            keyframes.setdefault(v, []).append(key)

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

    if in_flight:
        try:
            if not dry_run:
                fenced = fence_claim(store, run, "gc", force=force)
                if fenced is not None:
                    logger.info("gc fenced the writer claim of %s (was %s)", run, fenced.describe())
            report.orphans.extend(in_flight)
        except WriterConflict as err:
            logger.warning("gc leaves %d objects of a publish in flight: %s", len(in_flight), err)
            report.in_flight = in_flight

    for key in report.orphans:
        report.freed_bytes += _size(store, key)
        if not dry_run:
            store.delete(key)
            logger.info("gc removed orphan %s", key)

    if keep_last is not None and last is not None:
        listed = {v for v, keys in by_version.items() if layout.manifest(v) in keys}
        _remove_old_versions(store, reader, layout, last, keep_last, listed, report)
    return report


def _remove_old_versions(
    store: ObjectStore,
    reader: RunReader,
    layout: RunLayout,
    last: int,
    keep_last: int,
    listed: set[int],
    report: GcReport,
) -> None:
    oldest_kept = max(0, last - keep_last + 1)
    kf_version = oldest_kept
    while True:  # newest keyframe at or before the oldest kept version
        manifest, _ = reader.manifest(kf_version)
        if manifest.keyframe is not None:
            break
        if kf_version == 0:
            return
        kf_version -= 1
    report.oldest_kept = kf_version
    for version in sorted(v for v in listed if v < kf_version):  # oldest first: what remains is a replayable suffix
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
