"""Records of a run as a whole: ``run.json`` (what every version shares) and ``HEAD`` (the latest version).

Both are canonical JSON records (:mod:`deltarl.pipeline.canonical`); a version's own commit record
is the manifest (:mod:`deltarl.pipeline.manifest`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from deltarl.codec.tensors import TensorSpec
from deltarl.errors import FormatError, UnsupportedFormatVersion
from deltarl.pipeline.canonical import Fields, canonical_json, check_run, is_hash_hex, load_record

RUN_INFO_FORMAT_VERSION = 3
HEAD_FORMAT_VERSION = 3
MAX_RUN_INFO_BYTES = 16 << 20
MAX_HEAD_BYTES = 4096
DTYPE_NAMES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")

#: One row of run.json's tensor table: name, dtype and shape, exactly the pipeline's ``TensorSpec``.
TensorEntry = TensorSpec

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
        check_run(self.run, where)
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
                "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in self.tensors],
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
        f = load_record(data, where, MAX_RUN_INFO_BYTES, RUN_INFO_FORMAT_VERSION)
        tensors = []
        for i, obj in enumerate(f.list_("tensors")):
            t = Fields(obj, f"{where} tensor {i}")
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
        if not is_hash_hex(self.version_id):
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
        f = load_record(data, where, MAX_HEAD_BYTES, HEAD_FORMAT_VERSION)
        rec = cls(version=f.int_("version"), version_id=f.str_("version_id"), writer_id=f.opt_str("writer_id"))
        f.done()
        return rec
