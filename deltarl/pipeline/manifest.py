"""The manifest: the commit record of one version, and the version id (the BLAKE3 of its bytes).

Every record is a frozen dataclass with an explicit ``format_version`` that serializes to canonical
JSON and parses strictly (:mod:`deltarl.pipeline.canonical`), so a version id names exactly one
manifest. The run-wide records (``run.json``, ``HEAD``) live in :mod:`deltarl.pipeline.run_records`
and are re-exported here, as is the canonical JSON encoder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from deltarl.codec.hashing import content_id, object_root
from deltarl.codec.tensors import DIGEST_ALGOS
from deltarl.errors import FormatError, UnsupportedFormatVersion
from deltarl.pipeline.canonical import Fields, canonical_json, check_run, is_hash_hex, load_record
from deltarl.pipeline.layout import RunLayout
from deltarl.pipeline.pieces import (
    DEFAULT_PIECE_SIZE,
    PieceHasher,
    PieceVerifier,
    check_piece_size,
    piece_count,
)
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
    "Keyframe",
    "KeyframePart",
    "Kind",
    "Manifest",
    "ObjectRef",
    "RunInfo",
    "StateDigest",
    "TensorEntry",
    "TensorRange",
    "canonical_json",
    "version_id",
]

MANIFEST_FORMAT_VERSION = 3
MAX_MANIFEST_BYTES = 8 << 20
Kind = Literal["keyframe", "delta"]


def version_id(manifest_bytes: bytes) -> str:
    """The version id: the BLAKE3-256 hex of a manifest's canonical bytes."""
    return content_id(manifest_bytes)


# --- records ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectRef:
    """A stored object a manifest depends on: key, size, piece hashes and the root composed from them.

    ``pieces[i]`` is the hash of bytes ``[i * piece_size, min((i + 1) * piece_size, size))`` and
    ``root`` the object's root (:mod:`.pieces`, :mod:`deltarl.codec.hashing`), all BLAKE3-256 hex.
    """

    key: str
    root: str
    size: int
    piece_size: int
    pieces: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise FormatError(f"object ref: bad key {self.key!r}")
        if not is_hash_hex(self.root):
            raise FormatError(f"object ref {self.key}: blake3_root must be 64 lowercase hex digits")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            raise FormatError(f"object ref {self.key}: bad size {self.size!r}")
        try:
            check_piece_size(self.piece_size, f"object ref {self.key}")
        except ValueError as err:
            raise FormatError(str(err)) from None
        if not isinstance(self.pieces, tuple) or len(self.pieces) != piece_count(self.size, self.piece_size):
            raise FormatError(
                f"object ref {self.key}: {len(self.pieces)} pieces, a {self.size}-byte object has "
                f"{piece_count(self.size, self.piece_size)} of {self.piece_size} bytes"
            )
        if not all(is_hash_hex(p) for p in self.pieces):
            raise FormatError(f"object ref {self.key}: every piece must be 64 lowercase hex digits")
        if object_root(self.size, self.piece_size, self.pieces) != self.root:
            raise FormatError(f"object ref {self.key}: blake3_root is not the root of its size, piece size and pieces")

    @classmethod
    def of(cls, key: str, data: Any, *, piece_size: int = DEFAULT_PIECE_SIZE) -> ObjectRef:
        """The ref of ``data`` stored at ``key`` (pieces and root in one pass)."""
        hasher = PieceHasher(piece_size)
        hasher.update(data)
        return cls.from_hasher(key, hasher)

    @classmethod
    def from_hasher(cls, key: str, hasher: PieceHasher) -> ObjectRef:
        """The ref of the bytes fed through ``hasher``."""
        root, size, pieces = hasher.finish()
        return cls(key=key, root=root, size=size, piece_size=hasher.piece_size, pieces=tuple(pieces))

    def verifier(self, named_by: str) -> PieceVerifier:
        """A :class:`PieceVerifier` for this object's bytes, read in order."""
        return PieceVerifier(self.key, self.size, self.pieces, self.piece_size, named_by)

    def to_obj(self) -> dict[str, Any]:
        return {"key": self.key, "size": self.size, "piece_size": self.piece_size,
                "blake3_pieces": list(self.pieces), "blake3_root": self.root}  # fmt: skip

    @staticmethod
    def _fields(f: Fields) -> dict[str, Any]:
        out: dict[str, Any] = {"key": f.str_("key"), "root": f.str_("blake3_root"), "size": f.int_("size"),
                               "piece_size": f.int_("piece_size", minimum=1)}  # fmt: skip
        pieces = f.list_("blake3_pieces")
        if not all(isinstance(p, str) for p in pieces):
            raise FormatError(f"{f.where}: blake3_pieces must be strings")
        out["pieces"] = tuple(pieces)
        return out

    @classmethod
    def from_obj(cls, obj: object, where: str) -> ObjectRef:
        f = Fields(obj, where)
        ref = cls(**cls._fields(f))
        f.done()
        return ref


#: One element range of a keyframe part: (tensor name, first element, element count).
TensorRange = tuple[str, int, int]


@dataclass(frozen=True)
class KeyframePart(ObjectRef):
    """One part of a keyframe: an ObjectRef plus the element ranges it holds, in stored order.

    ``block_hashes`` is not recorded: a writer that just hashed the part keeps the hashes of its
    64 KiB blocks there, from which the state digest is composed (:mod:`.keyframe`).
    """

    tensors: tuple[TensorRange, ...] = ()
    block_hashes: bytes | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        names = set()
        for item in self.tensors:
            if (
                not isinstance(item, tuple)
                or len(item) != 3
                or not isinstance(item[0], str)
                or not item[0]
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in item[1:])
            ):
                raise FormatError(f"keyframe part {self.key}: bad range {item!r} (want [name, start, count])")
            if item[0] in names:
                raise FormatError(f"keyframe part {self.key}: tensor {item[0]!r} appears twice in one part")
            names.add(item[0])

    def to_obj(self) -> dict[str, Any]:
        obj = super().to_obj()
        obj["tensors"] = [list(t) for t in self.tensors]
        return obj

    @classmethod
    def from_obj(cls, obj: object, where: str) -> KeyframePart:
        f = Fields(obj, where)
        fields = cls._fields(f)
        items = f.list_("tensors")
        if not all(isinstance(t, list) for t in items):
            raise FormatError(f"{where}: tensors must be [name, start, count] lists")
        tensors = tuple((t[0], t[1], t[2]) if len(t) == 3 else tuple(t) for t in items)  # checked in __post_init__
        f.done()
        return cls(**fields, tensors=tensors)


@dataclass(frozen=True)
class Keyframe:
    """The full state of a keyframe version: parts holding element ranges."""

    parts: tuple[KeyframePart, ...]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(p.key for p in self.parts)

    def check_covers(self, tensors: Any, where: str) -> None:
        """FormatError unless the parts' ranges cover every element of ``tensors`` (run.json's
        TensorSpec rows) exactly once: no unknown tensor, no gap, no overlap."""
        numel = {t.name: t.numel for t in tensors}
        ranges: dict[str, list[tuple[int, int, str]]] = {name: [] for name in numel}
        for part in self.parts:
            for name, start, count in part.tensors:
                if name not in numel:
                    raise FormatError(f"{where}: keyframe part {part.key} holds {name!r}, which run.json does not list")
                ranges[name].append((start, count, part.key))
        for name, items in ranges.items():
            pos = 0
            for start, count, key in sorted(items):
                if start < pos:
                    raise FormatError(f"{where}: keyframe part {key} overlaps elements {start}..{pos} of {name!r}")
                if start > pos:
                    raise FormatError(f"{where}: keyframe parts leave elements {pos}..{start} of {name!r} uncovered")
                pos = start + count
            if pos != numel[name]:
                what = "beyond the" if pos > numel[name] else f"leave elements {pos}..{numel[name]} of"
                raise FormatError(f"{where}: keyframe parts {what} {numel[name]} elements of {name!r}")

    def to_obj(self) -> Any:
        return {"parts": [p.to_obj() for p in self.parts]}

    @classmethod
    def from_obj(cls, obj: object, where: str) -> Keyframe:
        f = Fields(obj, where)
        parts = tuple(KeyframePart.from_obj(p, f"{where} part {i}") for i, p in enumerate(f.list_("parts")))
        f.done()
        return cls(parts)


@dataclass(frozen=True)
class StateDigest:
    """A whole-state digest: its algorithm (:data:`~deltarl.codec.tensors.DIGEST_ALGOS`) and hex value."""

    algo: str
    value: str

    def __post_init__(self) -> None:
        if self.algo not in DIGEST_ALGOS:
            raise FormatError(f"state digest: unknown algo {self.algo!r} (known: {', '.join(DIGEST_ALGOS)})")
        if not is_hash_hex(self.value):
            raise FormatError("state digest: value must be 64 lowercase hex digits")

    def to_obj(self) -> Any:
        return {"algo": self.algo, "value": self.value}

    @classmethod
    def from_obj(cls, obj: object, where: str) -> StateDigest:
        f = Fields(obj, where)
        digest = cls(f.str_("algo"), f.str_("value"))
        f.done()
        return digest

    def short(self) -> str:
        return self.value[:16] + "…"


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
    keyframe: Keyframe | None
    stats: DeltaStatsRecord
    state_digest: StateDigest | None
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
            if not is_hash_hex(self.parent):
                raise FormatError(f"{where}: parent must be a version id (64 hex digits)")
            if self.base_version != self.version - 1:
                raise FormatError(f"{where}: base_version must be {self.version - 1}")
        if self.kind not in ("keyframe", "delta"):
            raise FormatError(f"{where}: unknown kind {self.kind!r}")
        if (self.kind == "keyframe") != (self.keyframe is not None):
            raise FormatError(f"{where}: kind {self.kind!r} disagrees with the keyframe field")
        if self.keyframe is not None:
            self._check_keyframe(self.keyframe, layout, where)
        keys = [ref.key for ref in self.segments]
        if len(set(keys)) != len(keys):
            raise FormatError(f"{where}: duplicate segment keys")
        for key in keys:
            if not layout.is_segment_key(key, self.version):
                raise FormatError(f"{where}: segment key {key!r} is not a segment key of this version")
        if self.kind == "keyframe" and self.state_digest is None:
            raise FormatError(f"{where}: a keyframe must record its state digest")

    def _check_keyframe(self, keyframe: Keyframe, layout: RunLayout, where: str) -> None:
        if not keyframe.parts:
            raise FormatError(f"{where}: a keyframe has at least one part")
        if len(set(keyframe.keys)) != len(keyframe.keys):
            raise FormatError(f"{where}: duplicate keyframe part keys")
        seen: dict[str, list[tuple[int, int, str]]] = {}
        for part in keyframe.parts:
            if not layout.is_keyframe_part_key(part.key, self.version):
                raise FormatError(f"{where}: keyframe part key {part.key!r} is not a part key of this version")
            for name, start, count in part.tensors:
                seen.setdefault(name, []).append((start, count, part.key))
        for name, items in seen.items():
            end = 0
            for start, count, key in sorted(items):
                if start < end:
                    raise FormatError(f"{where}: keyframe part {key} overlaps elements {start}..{end} of {name!r}")
                end = start + count

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
            "segments": [ObjectRef.to_obj(ref) for ref in self.segments],
            "keyframe": None if self.keyframe is None else self.keyframe.to_obj(),
            "stats": self.stats.to_obj(),
            "state_digest": None if self.state_digest is None else self.state_digest.to_obj(),
            "codec": self.codec,
            "created_at": self.created_at,
            "writer_id": self.writer_id,
        }

    def to_bytes(self) -> bytes:
        """Canonical JSON; its BLAKE3 is the version id."""
        return canonical_json(self.to_obj())

    @property
    def version_id(self) -> str:
        return version_id(self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        """Parse and validate strictly (format 3 only); raises FormatError / UnsupportedFormatVersion."""
        f = load_record(data, where, MAX_MANIFEST_BYTES, MANIFEST_FORMAT_VERSION)
        kind = f.str_("kind")
        seg_objs = f.list_("segments")
        kf_obj = f.any_("keyframe")
        digest_obj = f.any_("state_digest")
        manifest = cls(
            run=f.str_("run"),
            version=f.int_("version"),
            step=f.int_("step"),
            parent=f.opt_str("parent"),
            kind=kind,  # type: ignore[arg-type]  # checked in __post_init__
            base_version=f.opt_int("base_version"),
            segments=tuple(ObjectRef.from_obj(o, f"{where} segment {i}") for i, o in enumerate(seg_objs)),
            keyframe=None if kf_obj is None else Keyframe.from_obj(kf_obj, f"{where} keyframe"),
            stats=DeltaStatsRecord.from_obj(f.any_("stats"), f"{where} stats"),
            state_digest=None if digest_obj is None else StateDigest.from_obj(digest_obj, f"{where} state_digest"),
            codec=f.str_("codec"),
            created_at=f.str_("created_at"),
            writer_id=f.str_("writer_id"),
        )
        f.done()
        return manifest
