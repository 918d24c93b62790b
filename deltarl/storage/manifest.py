"""Records of the run namespace: manifests, run.json, HEAD, and the version id.

Every record is a frozen dataclass with an explicit ``format_version``; unknown versions raise
:class:`~deltarl.errors.UnsupportedFormatVersion`, never patched up. Records serialize to
*canonical JSON* (sorted keys, no spaces, UTF-8, integers and strings only - no floats), and
parsing is strict: a size cap, no unknown or missing fields, exact types, and the bytes must be
canonical, so a version id (the sha256 of a manifest's bytes) names exactly one manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from deltarl.errors import FormatError, InvalidKey, UnsupportedFormatVersion
from deltarl.storage.layout import RunLayout, validate_run_name

MANIFEST_FORMAT_VERSION = 1
RUN_INFO_FORMAT_VERSION = 1
HEAD_FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 8 << 20
MAX_RUN_INFO_BYTES = 16 << 20
MAX_HEAD_BYTES = 4096
DTYPE_NAMES = ("bfloat16", "float16", "float32")

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
Kind = Literal["keyframe", "delta"]


def canonical_json(obj: Any) -> bytes:
    """Canonical JSON bytes: sorted keys, ``,``/``:`` separators, UTF-8 (not ASCII-escaped)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def version_id(manifest_bytes: bytes) -> str:
    """The version id: sha256 hex of a manifest's canonical bytes."""
    return hashlib.sha256(manifest_bytes).hexdigest()


def _check_run(run: object, where: str) -> None:
    try:
        validate_run_name(run)  # type: ignore[arg-type]
    except InvalidKey as err:
        raise FormatError(f"{where}: {err}") from err


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and bool(_HEX64.match(value))


# --- strict parsing ------------------------------------------------------------------------------


class _Fields:
    """Pops typed fields out of a parsed JSON object; ``done()`` rejects leftovers."""

    def __init__(self, obj: object, where: str) -> None:
        if not isinstance(obj, dict):
            raise FormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        self.obj = dict(obj)
        self.where = where

    def _pop(self, name: str) -> Any:
        if name not in self.obj:
            raise FormatError(f"{self.where}: missing field {name!r}")
        return self.obj.pop(name)

    def int_(self, name: str, *, minimum: int = 0) -> int:
        value = self._pop(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise FormatError(f"{self.where}: field {name!r} must be an int >= {minimum}, got {value!r}")
        return value

    def opt_int(self, name: str) -> int | None:
        if self.obj.get(name, 0) is None:
            self.obj.pop(name)
            return None
        return self.int_(name)

    def str_(self, name: str) -> str:
        value = self._pop(name)
        if not isinstance(value, str):
            raise FormatError(f"{self.where}: field {name!r} must be a string, got {value!r}")
        return value

    def opt_str(self, name: str) -> str | None:
        if self.obj.get(name, "") is None:
            self.obj.pop(name)
            return None
        return self.str_(name)

    def list_(self, name: str) -> list[Any]:
        value = self._pop(name)
        if not isinstance(value, list):
            raise FormatError(f"{self.where}: field {name!r} must be a list, got {type(value).__name__}")
        return value

    def any_(self, name: str) -> Any:
        return self._pop(name)

    def done(self) -> None:
        if self.obj:
            raise FormatError(f"{self.where}: unknown fields {sorted(self.obj)}")


def _load(data: bytes, where: str, cap: int, format_version: int) -> _Fields:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise FormatError(f"{where}: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > cap:
        raise FormatError(f"{where}: {len(data)} bytes exceeds the {cap}-byte cap")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise FormatError(f"{where}: not valid UTF-8 JSON: {err}") from err
    fields = _Fields(obj, where)
    got = fields.obj.get("format_version")
    if got != format_version or isinstance(got, bool):
        raise UnsupportedFormatVersion(f"{where}: format_version {got!r} is not supported (this build reads {format_version})")
    fields.obj.pop("format_version")
    if canonical_json(obj) != data:
        raise FormatError(f"{where}: bytes are not canonical JSON (sorted keys, no spaces, UTF-8)")
    return fields


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
        if not _is_sha256(self.sha256):
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
        f = _Fields(obj, where)
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
        f = _Fields(obj, where)
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
        _check_run(self.run, where)
        layout = RunLayout(self.run)
        if self.version == 0:
            if self.parent is not None or self.base_version is not None or self.segments:
                raise FormatError(f"{where}: version 0 has no parent, base or segments")
            if self.kind != "keyframe":
                raise FormatError(f"{where}: version 0 must be a keyframe")
        else:
            if not _is_sha256(self.parent):
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
        if self.state_digest is not None and not _is_sha256(self.state_digest):
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
        f = _load(data, where, MAX_MANIFEST_BYTES, MANIFEST_FORMAT_VERSION)
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


@dataclass(frozen=True)
class TensorEntry:
    """One row of run.json's tensor table."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def to_obj(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class RunInfo:
    """``run.json``: what every version of the run shares. Written once, before version 0."""

    run: str
    tensors: tuple[TensorEntry, ...]
    codec: str
    keyframe_interval: int
    digest_interval: int
    segment_bytes: int
    created_at: str
    format_version: int = RUN_INFO_FORMAT_VERSION
    extra: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"run.json of {self.run!r}"
        if self.format_version != RUN_INFO_FORMAT_VERSION:
            raise UnsupportedFormatVersion(f"{where}: format_version {self.format_version} is not supported")
        _check_run(self.run, where)
        names = [t.name for t in self.tensors]
        if names != sorted(set(names)):
            raise FormatError(f"{where}: tensor names must be unique and sorted")
        for t in self.tensors:
            if t.dtype not in DTYPE_NAMES:
                raise FormatError(f"{where}: tensor {t.name!r} has unsupported dtype {t.dtype!r}")
        if self.keyframe_interval < 1 or self.digest_interval < 1 or self.segment_bytes < 1:
            raise FormatError(f"{where}: intervals and segment_bytes must be >= 1")

    @property
    def total_elements(self) -> int:
        return sum(t.numel for t in self.tensors)

    def to_bytes(self) -> bytes:
        return canonical_json(
            {
                "format_version": self.format_version,
                "run": self.run,
                "tensors": [t.to_obj() for t in self.tensors],
                "codec": self.codec,
                "keyframe_interval": self.keyframe_interval,
                "digest_interval": self.digest_interval,
                "segment_bytes": self.segment_bytes,
                "created_at": self.created_at,
                "extra": dict(self.extra),
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "run.json") -> RunInfo:
        f = _load(data, where, MAX_RUN_INFO_BYTES, RUN_INFO_FORMAT_VERSION)
        tensors = []
        for i, obj in enumerate(f.list_("tensors")):
            t = _Fields(obj, f"{where} tensor {i}")
            shape = t.list_("shape")
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise FormatError(f"{where} tensor {i}: bad shape {shape!r}")
            tensors.append(TensorEntry(name=t.str_("name"), dtype=t.str_("dtype"), shape=tuple(shape)))
            t.done()
        extra = f.any_("extra")
        if not isinstance(extra, dict) or not all(isinstance(v, str) for v in extra.values()):
            raise FormatError(f"{where}: extra must map strings to strings")
        info = cls(
            run=f.str_("run"),
            tensors=tuple(tensors),
            codec=f.str_("codec"),
            keyframe_interval=f.int_("keyframe_interval", minimum=1),
            digest_interval=f.int_("digest_interval", minimum=1),
            segment_bytes=f.int_("segment_bytes", minimum=1),
            created_at=f.str_("created_at"),
            extra=extra,
        )
        f.done()
        return info


@dataclass(frozen=True)
class HeadRecord:
    """``HEAD``: the latest committed version, its id, and the writer that moved it there."""

    version: int
    version_id: str
    writer_id: str | None = None
    format_version: int = HEAD_FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.format_version != HEAD_FORMAT_VERSION:
            raise UnsupportedFormatVersion(f"HEAD: format_version {self.format_version} is not supported")
        if not _is_sha256(self.version_id):
            raise FormatError("HEAD: version_id must be 64 hex digits")

    def to_bytes(self) -> bytes:
        return canonical_json(
            {
                "format_version": self.format_version,
                "version": self.version,
                "version_id": self.version_id,
                "writer_id": self.writer_id,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "HEAD") -> HeadRecord:
        f = _load(data, where, MAX_HEAD_BYTES, HEAD_FORMAT_VERSION)
        rec = cls(version=f.int_("version"), version_id=f.str_("version_id"), writer_id=f.opt_str("writer_id"))
        f.done()
        return rec
