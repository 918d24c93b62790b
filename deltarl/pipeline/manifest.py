"""The manifest: the commit record of one version, and the version id (the sha256 of its bytes).

Every record is a frozen dataclass with an explicit ``format_version`` that serializes to canonical
JSON and parses strictly (:mod:`deltarl.pipeline.canonical`), so a version id names exactly one
manifest. The run-wide records (``run.json``, ``HEAD``) live in :mod:`deltarl.pipeline.run_records`
and are re-exported here, as is the canonical JSON encoder.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

from deltarl.errors import FormatError, UnsupportedFormatVersion
from deltarl.pipeline.canonical import Fields, canonical_json, check_run, is_sha256, load_record
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.run_records import (
    DTYPE_NAMES,
    HEAD_FORMAT_VERSION,
    MAX_HEAD_BYTES,
    MAX_RUN_INFO_BYTES,
    RUN_INFO_FORMAT_VERSION,
    HeadRecord,
    RunInfo,
    TensorEntry,
)

__all__ = [
    "DTYPE_NAMES",
    "HEAD_FORMAT_VERSION",
    "MANIFEST_FORMAT_VERSION",
    "MAX_HEAD_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_RUN_INFO_BYTES",
    "RUN_INFO_FORMAT_VERSION",
    "DeltaStatsRecord",
    "HeadRecord",
    "Kind",
    "Manifest",
    "ObjectRef",
    "RunInfo",
    "TensorEntry",
    "canonical_json",
    "version_id",
]

MANIFEST_FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 8 << 20
Kind = Literal["keyframe", "delta"]


def version_id(manifest_bytes: bytes) -> str:
    """The version id: sha256 hex of a manifest's canonical bytes."""
    return hashlib.sha256(manifest_bytes).hexdigest()


# --- records ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectRef:
    """A stored object a manifest depends on: its key, sha256 (hex) and size in bytes."""

    key: str
    sha256: str
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise FormatError(f"object ref: bad key {self.key!r}")
        if not is_sha256(self.sha256):
            raise FormatError(f"object ref {self.key}: sha256 must be 64 lowercase hex digits")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            raise FormatError(f"object ref {self.key}: bad size {self.size!r}")

    @classmethod
    def of(cls, key: str, data: bytes) -> ObjectRef:
        """The ref of ``data`` stored at ``key``."""
        return cls(key=key, sha256=hashlib.sha256(data).hexdigest(), size=len(data))

    def to_obj(self) -> dict[str, Any]:
        return {"key": self.key, "sha256": self.sha256, "size": self.size}

    @classmethod
    def from_obj(cls, obj: object, where: str) -> ObjectRef:
        f = Fields(obj, where)
        ref = cls(key=f.str_("key"), sha256=f.str_("sha256"), size=f.int_("size"))
        f.done()
        return ref


@dataclass(frozen=True)
class DeltaStatsRecord:
    """Size of one version's delta: changed elements of all elements, encoded vs full bytes."""

    changed_elements: int
    total_elements: int
    encoded_bytes: int
    full_bytes: int

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    @property
    def ratio(self) -> float:
        """Encoded bytes as a fraction of the full state's bytes."""
        return self.encoded_bytes / self.full_bytes if self.full_bytes else 0.0

    def to_obj(self) -> dict[str, Any]:
        return {
            "changed_elements": self.changed_elements,
            "total_elements": self.total_elements,
            "encoded_bytes": self.encoded_bytes,
            "full_bytes": self.full_bytes,
        }

    @classmethod
    def from_obj(cls, obj: object, where: str) -> DeltaStatsRecord:
        f = Fields(obj, where)
        rec = cls(f.int_("changed_elements"), f.int_("total_elements"), f.int_("encoded_bytes"), f.int_("full_bytes"))
        f.done()
        if rec.changed_elements > rec.total_elements:
            raise FormatError(f"{where}: changed_elements exceeds total_elements")
        return rec


@dataclass(frozen=True)
class Manifest:
    """The commit record of one version (``versions/<v>/manifest.json``), written last.

    Version 0 is a keyframe with no parent and no segments. Every later version names its parent's
    version id (a hash chain) and carries the delta from version ``v - 1`` as segments whose base is
    that parent id; a version that is also a keyframe additionally names its full snapshot.
    """

    run: str
    version: int
    step: int
    parent: str | None
    kind: Kind
    base_version: int | None
    segments: tuple[ObjectRef, ...]
    keyframe: ObjectRef | None
    stats: DeltaStatsRecord
    state_digest: str | None
    codec: str
    created_at: str
    writer_id: str
    format_version: int = MANIFEST_FORMAT_VERSION

    def __post_init__(self) -> None:
        where = f"manifest of {self.run!r} version {self.version}"
        if self.format_version != MANIFEST_FORMAT_VERSION:
            raise UnsupportedFormatVersion(f"{where}: format_version {self.format_version} is not supported")
        check_run(self.run, where)
        layout = RunLayout(self.run)
        if self.version == 0:
            if self.parent is not None or self.base_version is not None or self.segments:
                raise FormatError(f"{where}: version 0 has no parent, base or segments")
            if self.kind != "keyframe":
                raise FormatError(f"{where}: version 0 must be a keyframe")
        else:
            if not is_sha256(self.parent):
                raise FormatError(f"{where}: parent must be a version id (64 hex digits)")
            if self.base_version != self.version - 1:
                raise FormatError(f"{where}: base_version must be {self.version - 1}")
        if self.kind not in ("keyframe", "delta"):
            raise FormatError(f"{where}: unknown kind {self.kind!r}")
        if (self.kind == "keyframe") != (self.keyframe is not None):
            raise FormatError(f"{where}: kind {self.kind!r} disagrees with the keyframe field")
        if self.keyframe is not None and self.keyframe.key != layout.keyframe(self.version):
            raise FormatError(f"{where}: keyframe key {self.keyframe.key!r} is not {layout.keyframe(self.version)!r}")
        keys = [ref.key for ref in self.segments]
        if len(set(keys)) != len(keys):
            raise FormatError(f"{where}: duplicate segment keys")
        for key in keys:
            if not layout.is_segment_key(key, self.version):
                raise FormatError(f"{where}: segment key {key!r} is outside {layout.version_prefix(self.version)}")
        if self.state_digest is not None and not is_sha256(self.state_digest):
            raise FormatError(f"{where}: state_digest must be 64 hex digits")
        if self.kind == "keyframe" and self.state_digest is None:
            raise FormatError(f"{where}: a keyframe must record its state digest")

    @property
    def key(self) -> str:
        return RunLayout(self.run).manifest(self.version)

    def to_obj(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "run": self.run,
            "version": self.version,
            "step": self.step,
            "parent": self.parent,
            "kind": self.kind,
            "base_version": self.base_version,
            "segments": [ref.to_obj() for ref in self.segments],
            "keyframe": None if self.keyframe is None else self.keyframe.to_obj(),
            "stats": self.stats.to_obj(),
            "state_digest": self.state_digest,
            "codec": self.codec,
            "created_at": self.created_at,
            "writer_id": self.writer_id,
        }

    def to_bytes(self) -> bytes:
        """Canonical JSON; its sha256 is the version id."""
        return canonical_json(self.to_obj())

    @property
    def version_id(self) -> str:
        return version_id(self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        """Parse and validate strictly; raises FormatError / UnsupportedFormatVersion."""
        f = load_record(data, where, MAX_MANIFEST_BYTES, MANIFEST_FORMAT_VERSION)
        kind = f.str_("kind")
        seg_objs = f.list_("segments")
        kf_obj = f.any_("keyframe")
        manifest = cls(
            run=f.str_("run"),
            version=f.int_("version"),
            step=f.int_("step"),
            parent=f.opt_str("parent"),
            kind=kind,  # type: ignore[arg-type]  # checked in __post_init__
            base_version=f.opt_int("base_version"),
            segments=tuple(ObjectRef.from_obj(o, f"{where} segment {i}") for i, o in enumerate(seg_objs)),
            keyframe=None if kf_obj is None else ObjectRef.from_obj(kf_obj, f"{where} keyframe"),
            stats=DeltaStatsRecord.from_obj(f.any_("stats"), f"{where} stats"),
            state_digest=f.opt_str("state_digest"),
            codec=f.str_("codec"),
            created_at=f.str_("created_at"),
            writer_id=f.str_("writer_id"),
        )
        f.done()
        return manifest
