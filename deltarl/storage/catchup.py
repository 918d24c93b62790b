"""Stored squashes: one delta from version a to version b, for actors that fell behind.

``store_squash`` computes the delta a → b from the run's objects (:func:`deltarl.storage.replay.squash`)
and stores it as segments plus a record, under ``<run>/squash/<a>-<b>/`` (record last, with
``put_if_absent``; the encoding is deterministic, so a second writer of the same squash writes the
same bytes). ``read_squash`` fetches it back with every object verified, and checks that the
record's ids are those of the run's versions a and b. An actor holding version a applies the
segments with ``base = from_id`` and then holds version b, bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from deltarl.errors import FormatError, IntegrityError, ObjectExists
from deltarl.storage.canonical import canonical_json, is_sha256, load_record
from deltarl.storage.layout import RunLayout
from deltarl.storage.manifest import DeltaStatsRecord, ObjectRef
from deltarl.storage.reader import RunReader, check_ref
from deltarl.storage.store import ObjectStore

logger = logging.getLogger(__name__)

SQUASH_FORMAT_VERSION = 1
MAX_SQUASH_BYTES = 8 << 20


@dataclass(frozen=True)
class SquashRecord:
    """``squash/<a>-<b>/manifest.json``: segments of the delta a → b and the ids of a and b."""

    run: str
    from_version: int
    from_id: str
    to_version: int
    to_id: str
    segments: tuple[ObjectRef, ...]
    stats: DeltaStatsRecord
    format_version: int = SQUASH_FORMAT_VERSION

    def __post_init__(self) -> None:
        where = f"squash {self.run!r} {self.from_version}->{self.to_version}"
        if not 0 <= self.from_version < self.to_version:
            raise FormatError(f"{where}: needs 0 <= from_version < to_version")
        if not (is_sha256(self.from_id) and is_sha256(self.to_id)):
            raise FormatError(f"{where}: ids must be 64 hex digits")
        prefix = RunLayout(self.run).squash_prefix(self.from_version, self.to_version)
        if not self.segments or any(not ref.key.startswith(prefix) for ref in self.segments):
            raise FormatError(f"{where}: segment keys must lie under {prefix}")

    @property
    def key(self) -> str:
        return RunLayout(self.run).squash_manifest(self.from_version, self.to_version)

    def to_bytes(self) -> bytes:
        return canonical_json(
            {
                "format_version": self.format_version,
                "run": self.run,
                "from_version": self.from_version,
                "from_id": self.from_id,
                "to_version": self.to_version,
                "to_id": self.to_id,
                "segments": [ref.to_obj() for ref in self.segments],
                "stats": self.stats.to_obj(),
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "squash") -> SquashRecord:
        f = load_record(data, where, MAX_SQUASH_BYTES, SQUASH_FORMAT_VERSION)
        rec = cls(
            run=f.str_("run"),
            from_version=f.int_("from_version"),
            from_id=f.str_("from_id"),
            to_version=f.int_("to_version"),
            to_id=f.str_("to_id"),
            segments=tuple(ObjectRef.from_obj(o, f"{where} segment {i}") for i, o in enumerate(f.list_("segments"))),
            stats=DeltaStatsRecord.from_obj(f.any_("stats"), f"{where} stats"),
        )
        f.done()
        return rec


def store_squash(
    store: ObjectStore, run: str, from_version: int, to_version: int, *, segment_bytes: int = 16 << 20, codec: str = "auto"
) -> SquashRecord:
    """Compute the squash a → b from the run's objects and store it (idempotent)."""
    from deltarl.pipeline import read_segment_header
    from deltarl.storage.replay import squash

    layout = RunLayout(run)
    key = layout.squash_manifest(from_version, to_version)
    if store.exists(key):
        return SquashRecord.from_bytes(store.get(key), where=key)
    reader = RunReader(store, run)
    _, from_id = reader.manifest(from_version)
    to_manifest, to_id = reader.manifest(to_version)
    segments = squash(store, run, from_version, to_version, segment_bytes=segment_bytes, codec=codec)
    refs = []
    changed = 0
    for i, seg in enumerate(segments):
        ref = ObjectRef.of(layout.squash_segment(from_version, to_version, i), seg)
        _put_once(store, ref.key, seg)
        refs.append(ref)
        changed += sum(c.changed for c in read_segment_header(seg).chunks)
    full = to_manifest.stats
    record = SquashRecord(
        run=run,
        from_version=from_version,
        from_id=from_id,
        to_version=to_version,
        to_id=to_id,
        segments=tuple(refs),
        stats=DeltaStatsRecord(changed, full.total_elements, sum(r.size for r in refs), full.full_bytes),
    )
    _put_once(store, key, record.to_bytes())
    logger.info("stored squash %s %d->%d: %d segments, %d bytes", run, from_version, to_version, len(refs), record.stats.encoded_bytes)
    return record


def _put_once(store: ObjectStore, key: str, data: bytes) -> None:
    try:
        store.put_if_absent(key, data)
    except ObjectExists as err:
        if store.get(key) != data:
            raise IntegrityError(f"{key} exists with other bytes") from err


def read_squash(store: ObjectStore, run: str, from_version: int, to_version: int) -> tuple[SquashRecord, list[bytes]]:
    """A stored squash and its segments, every object verified and both ids checked against the run."""
    layout = RunLayout(run)
    key = layout.squash_manifest(from_version, to_version)
    record = SquashRecord.from_bytes(store.get(key), where=key)
    if (record.run, record.from_version, record.to_version) != (run, from_version, to_version):
        raise IntegrityError(f"{key}: record is for {record.run!r} {record.from_version}->{record.to_version}")
    reader = RunReader(store, run)
    for version, vid in ((from_version, record.from_id), (to_version, record.to_id)):
        _, actual = reader.manifest(version)
        if actual != vid:
            raise IntegrityError(f"{key}: names id {vid[:16]}… for version {version}, the run has {actual[:16]}…")
    segments: list[Any] = [check_ref(ref, store.get(ref.key), named_by=key) for ref in record.segments]
    return record, segments
