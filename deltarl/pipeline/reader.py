"""Read a run back from the store, trusting nothing: every object is checked before use.

``RunReader`` is what replay, relays, actors and ``gc`` share. It checks that run.json and each
manifest name the run and version they are stored under, that a manifest's bytes hash to the id its
child names (the parent chain), and that every segment and keyframe matches the size and pieces
its manifest records (by its piece hashes). Every error names the offending object's key.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from deltarl.errors import IntegrityError, ObjectNotFound, RunError, short_pair
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.manifest import HeadRecord, Manifest, ObjectRef, RunInfo, TensorEntry, version_id
from deltarl.storage.store import ObjectStore

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


def check_ref(ref: ObjectRef, data: bytes, *, named_by: str) -> bytes:
    """Return ``data`` if it has the size and the pieces ``ref`` records, else raise IntegrityError.
    One hash pass: the object is checked by its pieces only."""
    if len(data) != ref.size:
        what = "truncated" if len(data) < ref.size else "oversized"
        raise IntegrityError(f"{ref.key}: {what}: {len(data)} bytes, {named_by} records {ref.size}")
    verifier = ref.verifier(named_by)
    verifier.update(data)
    verifier.finish()
    return data


def table_of(info: RunInfo) -> list[TensorEntry]:
    """run.json's tensor table (pipeline ``TensorSpec`` rows, for ``check_compatible``)."""
    return list(info.tensors)


class RunReader:
    """Verified reads of one run. Manifests are cached (they are immutable). Thread-safe.

    Example:
        >>> reader = RunReader(open_store("s3://bucket/runs"), "qwen-grpo")  # doctest: +SKIP
        >>> manifest, version_id = reader.manifest(reader.head().version)  # doctest: +SKIP
    """

    def __init__(self, store: ObjectStore, run: str) -> None:
        """Args:
            store: the store the run lives in (any store, a relay's ``http://`` included).
            run: the run's name.
        """
        self.store = store
        self.layout = RunLayout(run)
        self.run = self.layout.run
        self._info: RunInfo | None = None
        self._manifests: dict[int, tuple[Manifest, str]] = {}
        self._lock = threading.Lock()

    def _get(self, key: str, what: str) -> bytes:
        try:
            return self.store.get(key)
        except ObjectNotFound as err:
            raise ObjectNotFound(f"{key}: {what} of run {self.run!r} is missing") from err

    def info(self) -> RunInfo:
        """run.json, validated; a run.json that names another run is a RunError."""
        if self._info is None:
            key = self.layout.run_json
            info = RunInfo.from_bytes(self._get(key, "run.json"), where=key)
            if info.run != self.run:
                raise RunError(f"{key}: run.json names run {info.run!r}, not {self.run!r}")
            self._info = info
        return self._info

    def head(self) -> HeadRecord:
        """The HEAD record (a hint: the manifests are the truth)."""
        key = self.layout.head
        return HeadRecord.from_bytes(self._get(key, "HEAD"), where=key)

    def head_with_etag(self) -> tuple[HeadRecord, str] | None:
        """HEAD and its ETag (consistent across a concurrent swap), or None if there is no HEAD."""
        key = self.layout.head
        for _ in range(10):
            try:
                before = self.store.head(key).etag
                data = self.store.get(key)
                after = self.store.head(key).etag
            except ObjectNotFound:
                return None
            if before == after:
                return HeadRecord.from_bytes(data, where=key), after
        raise RunError(f"{key}: HEAD keeps changing while being read")

    def manifest(self, version: int) -> tuple[Manifest, str]:
        """The manifest of ``version`` and its version id, checked to belong to this run and version."""
        with self._lock:
            hit = self._manifests.get(version)
        if hit is not None:
            return hit
        key = self.layout.manifest(version)
        data = self._get(key, f"manifest of version {version}")
        manifest = Manifest.from_bytes(data, where=key)
        if manifest.run != self.run or manifest.version != version:
            raise RunError(f"{key}: manifest is for run {manifest.run!r} version {manifest.version}")
        result = (manifest, version_id(data))
        with self._lock:
            self._manifests[version] = result
        return result

    def has_manifest(self, version: int) -> bool:
        return self.store.exists(self.layout.manifest(version))

    def last_committed(self) -> int | None:
        """The newest committed version, or None if there is none: HEAD's, or later where manifests
        exist past it (HEAD is a hint; a crash between manifest and HEAD leaves it behind)."""
        try:
            last: int | None = self.head().version
        except ObjectNotFound:
            last = None
        nxt = 0 if last is None else last + 1
        while self.has_manifest(nxt):
            last, nxt = nxt, nxt + 1
        return last

    def kept_chain(self) -> list[tuple[Manifest, str]]:
        """Every version replay can rebuild: from the oldest stored keyframe up to the last committed
        version, ascending, with every parent link checked. Versions before it were removed by
        ``gc --keep-last`` (or are being removed: gc deletes the oldest first). Empty if no version."""
        last = self.last_committed()
        if last is None:
            return []
        out: list[tuple[Manifest, str]] = []
        try:
            for item in self._down(last):
                out.append(item)
        except ObjectNotFound:  # the first version gc removed: the stored chain starts after it
            if not out:
                raise
        out.reverse()
        for i, (manifest, _) in enumerate(out):
            if manifest.keyframe is not None:
                return out[i:]
        raise RunError(f"{self.layout.versions_prefix}: no keyframe among the stored versions {out[0][0].version}..{last}")

    def version_numbers(self) -> dict[str, int]:
        """Version id -> version number for every version of :meth:`kept_chain`."""
        return {vid: manifest.version for manifest, vid in self.kept_chain()}

    def segment(self, manifest: Manifest, index: int) -> bytes:
        """Segment ``index`` of ``manifest``, checked against its recorded size and pieces."""
        ref = manifest.segments[index]
        return check_ref(ref, self._get(ref.key, f"segment {index} of version {manifest.version}"), named_by=manifest.key)

    def keyframe(self, manifest: Manifest, into: dict[str, Any] | None = None, *, workers: int = 4) -> dict[str, Any]:
        """The full state of a keyframe version, checked (pieces, tensor table of run.json).

        Parts are read straight into ``into`` (writable CPU tensors of run.json's table; default:
        fresh ones), ``workers`` parts at a time, each piece checked as it lands: no whole-object
        bytes, no second copy.
        """
        from deltarl.codec.tensors import check_compatible
        from deltarl.pipeline.keyframe import empty_state, read_part_into

        if manifest.keyframe is None:
            raise RunError(f"{manifest.key}: version {manifest.version} has no keyframe")
        info = self.info()
        keyframe = manifest.keyframe
        keyframe.check_covers(info.tensors, manifest.key)
        state = empty_state(info.tensors) if into is None else into
        check_compatible(state, table_of(info))
        specs = {t.name: t for t in info.tensors}

        def read(part: Any) -> None:
            try:
                read_part_into(self.store, part, specs, state, named_by=manifest.key)
            except ObjectNotFound as err:
                raise ObjectNotFound(f"{part.key}: keyframe part of version {manifest.version} of run {self.run!r} is missing") from err

        if workers <= 1 or len(keyframe.parts) == 1:
            for part in keyframe.parts:
                read(part)
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(workers, len(keyframe.parts)), thread_name_prefix="deltarl-keyframe") as pool:
                for _ in pool.map(read, keyframe.parts):
                    pass
        return state

    def chain(self, to_version: int, *, from_version: int | None = None) -> list[tuple[Manifest, str]]:
        """Manifests from ``from_version`` (default: the nearest keyframe at or before ``to_version``)
        up to ``to_version``, ascending, with every parent link checked."""
        if from_version is not None and from_version > to_version:
            raise ValueError(f"from_version {from_version} is after to_version {to_version}")
        out: list[tuple[Manifest, str]] = []
        for manifest, vid in self._down(to_version):
            out.append((manifest, vid))
            if manifest.version == from_version or (from_version is None and manifest.keyframe is not None):
                break
        else:
            raise RunError(f"{self.layout.manifest(0)}: reached version 0 without finding version {from_version}")
        out.reverse()
        return out

    def _down(self, version: int) -> Iterator[tuple[Manifest, str]]:
        """Manifests from ``version`` down to 0, each checked to be the parent its child names."""
        child: Manifest | None = None
        for v in range(version, -1, -1):
            manifest, vid = self.manifest(v)
            if child is not None and child.parent != vid:
                named, has = short_pair(child.parent, vid)
                raise RunError(f"{child.key}: broken parent chain: it names parent {named}, but {manifest.key} has id {has}")
            yield manifest, vid
            child = manifest

    def check_head(self, version: int, vid: str) -> None:
        """If HEAD names ``version``, check that it names the same id; a mismatch is a RunError."""
        try:
            head = self.head()
        except ObjectNotFound:
            return
        if head.version == version and head.version_id != vid:
            named, has = short_pair(head.version_id, vid)
            raise RunError(f"{self.layout.head}: names id {named} for version {version}, manifest has {has}")
        if head.version < version:
            logger.debug("version %d is past HEAD (%d): committed but HEAD not yet moved", version, head.version)
