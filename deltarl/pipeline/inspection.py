"""Table data for ``deltarl inspect``: one row per committed version, read from its manifest."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from deltarl.errors import ObjectNotFound
from deltarl.pipeline.manifest import DeltaStatsRecord, HeadRecord, Manifest, RunInfo
from deltarl.pipeline.reader import RunReader
from deltarl.storage.store import ObjectStore


@dataclass(frozen=True)
class VersionRow:
    """One version as ``deltarl inspect`` shows it."""

    version: int
    version_id: str
    step: int
    kind: str
    parent: str | None
    segments: int
    stats: DeltaStatsRecord  # changed and encoded sizes, with ``changed_fraction`` and ``ratio``
    keyframe_bytes: int | None
    state_digest: str | None
    created_at: str

    @classmethod
    def of(cls, manifest: Manifest, vid: str) -> VersionRow:
        return cls(
            version=manifest.version,
            version_id=vid,
            step=manifest.step,
            kind=manifest.kind,
            parent=manifest.parent,
            segments=len(manifest.segments),
            stats=manifest.stats,
            keyframe_bytes=None if manifest.keyframe is None else manifest.keyframe.size,
            state_digest=None if manifest.state_digest is None else manifest.state_digest.value,
            created_at=manifest.created_at,
        )

    def to_obj(self) -> dict[str, Any]:
        """The row as ``deltarl inspect --json`` prints it: the stats' fields in place, then
        ``changed_fraction`` and ``ratio`` (encoded bytes of the full state's)."""
        out: dict[str, Any] = {}
        for key, value in self.__dict__.items():
            out.update(self.stats.to_obj() if key == "stats" else {key: value})
        return {**out, "changed_fraction": self.stats.changed_fraction, "ratio": self.stats.ratio}


@dataclass(frozen=True)
class RunSummary:
    """run.json, HEAD, the rows asked for (ascending), and the gaps of the stored chain."""

    info: RunInfo
    head: HeadRecord | None
    rows: tuple[VersionRow, ...]
    #: Versions with no manifest between the oldest stored one and the last committed one: a
    #: broken chain (versions ``gc --keep-last`` removed come before the oldest stored, no gap).
    missing: tuple[int, ...] = ()


def inspect_run(store: ObjectStore, run: str, *, version: int | None = None, last: int | None = 50) -> RunSummary:
    """Rows for ``version`` alone, or for the ``last`` versions up to HEAD (``None``: all kept)."""
    reader = RunReader(store, run)
    info = reader.info()
    try:
        head: HeadRecord | None = reader.head()
    except ObjectNotFound:
        head = None
    top = None if version is not None else reader.last_committed()
    if version is not None:
        wanted = [version]
    elif top is None:
        wanted = []
    else:
        first = 0 if last is None else max(0, top - last + 1)
        wanted = list(range(first, top + 1))

    def row(v: int) -> VersionRow | None:
        try:
            return VersionRow.of(*reader.manifest(v))
        except ObjectNotFound:
            if version is not None:
                raise
            return None  # removed by gc

    with ThreadPoolExecutor(8) as pool:
        rows = [r for r in pool.map(row, wanted) if r is not None]
    return RunSummary(info=info, head=head, rows=tuple(rows), missing=_gaps(reader, reader.last_committed()))


def _gaps(reader: RunReader, top: int | None) -> tuple[int, ...]:
    """Versions up to ``top`` that have no manifest although an older version has one."""
    if top is None:
        return ()
    layout = reader.layout
    stored = set()
    for key in reader.store.list(layout.versions_prefix):
        parsed = layout.parse_version_key(key)
        if parsed is not None and parsed[1] == "manifest.json":
            stored.add(parsed[0])
    oldest = min(stored, default=top)
    return tuple(v for v in range(oldest, top + 1) if v not in stored)


def spans(versions: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` as ``"3..5, 9"``."""
    out: list[str] = []
    for v in versions:
        if out and v == int(out[-1].rsplit(".", 1)[-1]) + 1:
            out[-1] = f"{out[-1].split('..')[0]}..{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


def human_bytes(n: float) -> str:
    """``n`` bytes as a short binary-unit string (``'1.5 MiB'``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
