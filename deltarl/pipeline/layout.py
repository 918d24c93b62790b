"""The run namespace: where each object of a training run lives in the store.

One prefix per run (see docs/RUN_NAMESPACE.md)::

    <run>/run.json                                   immutable: tensor table, codec, intervals
    <run>/versions/000000000042/e000003-seg-r000-00000.bin   immutable delta segments of version 42
    <run>/versions/000000000042/manifest.json                immutable commit record, written LAST
    <run>/keyframes/000000000040/e000003-part-r000-000.safetensors  immutable full snapshot, in parts
    <run>/HEAD                                       mutable hint: latest committed version (CAS)
    <run>/WRITER                                     mutable: the publisher's writer claim (CAS)
    <run>/rollouts/step-000000000042/…               immutable admitted results
    <run>/coordinator/…                              immutable coordinator records

Versions and steps are written with 12 zero-padded digits so keys sort in numeric order. Object
keys carry the writer's claim epoch (``e<epoch:06d>``) and rank (``r<rank:03d>``), so a fenced
writer's late uploads never land on a key its successor writes.
"""

from __future__ import annotations

import re

from deltarl.errors import InvalidKey

VERSION_DIGITS = 12
MAX_VERSION = 10**VERSION_DIGITS - 1
#: Object names that are overwritten in place (by compare-and-swap); every other key is write-once.
MUTABLE_NAMES = frozenset({"HEAD", "WRITER"})

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SEGMENT_NAME = re.compile(r"^e(\d{6})-seg-r(\d{3})-(\d{5})\.bin$")
_PART_NAME = re.compile(r"^e(\d{6})-part-r(\d{3})-(\d{3})\.safetensors$")
_VERSIONED_OBJECT = re.compile(r"^([^/]+)/(versions|keyframes)/(\d{12})/([^/]+)$")
MAX_EPOCH = 999_999
MAX_RANK = 999


def validate_run_name(run: str) -> str:
    """Return ``run`` if it is a valid run name (1-128 of ``[A-Za-z0-9._-]``, alphanumeric first)."""
    if not isinstance(run, str) or not _RUN_NAME.match(run):
        raise InvalidKey(
            f"invalid run name {run!r}: use 1-128 characters of [A-Za-z0-9._-], starting with a letter or digit"
        )
    return run


def _check_number(what: str, n: int, top: int = MAX_VERSION, low: int = 0) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not low <= n <= top:
        raise InvalidKey(f"{what} must be an int in [{low}, {top}], got {n!r}")
    return n


def key_epoch(key: str) -> int | None:
    """The writer epoch a segment or keyframe-part key carries, else ``None``."""
    name = key.rsplit("/", 1)[-1]
    m = _SEGMENT_NAME.match(name) or _PART_NAME.match(name)
    return int(m.group(1)) if m else None


def manifest_key_for(key: str) -> str | None:
    """The key of the manifest that records ``key`` (a segment or keyframe part of some run and
    version, by the grammar above), else ``None``."""
    m = _VERSIONED_OBJECT.match(key)
    if m is None or not _RUN_NAME.match(m[1]):
        return None
    name_ok = _SEGMENT_NAME.match(m[4]) if m[2] == "versions" else _PART_NAME.match(m[4])
    return f"{m[1]}/versions/{m[3]}/manifest.json" if name_ok else None


def is_immutable(key: str) -> bool:
    """Whether ``key`` is write-once (everything but HEAD and the WRITER claim)."""
    return key.rsplit("/", 1)[-1] not in MUTABLE_NAMES


class RunLayout:
    """Key builders for one run's namespace. Keys are ``str`` relative to the store root."""

    def __init__(self, run: str) -> None:
        self.run = validate_run_name(run)
        self.prefix = f"{run}/"

    def __repr__(self) -> str:
        return f"RunLayout({self.run!r})"

    # --- fixed objects -------------------------------------------------------------------------
    @property
    def run_json(self) -> str:
        return f"{self.run}/run.json"

    @property
    def head(self) -> str:
        return f"{self.run}/HEAD"

    @property
    def writer(self) -> str:
        return f"{self.run}/WRITER"

    @property
    def versions_prefix(self) -> str:
        return f"{self.run}/versions/"

    @property
    def keyframes_prefix(self) -> str:
        return f"{self.run}/keyframes/"

    @property
    def coordinator_prefix(self) -> str:
        return f"{self.run}/coordinator/"

    # --- per version -----------------------------------------------------------------------------
    def version_prefix(self, version: int) -> str:
        return f"{self.run}/versions/{_check_number('version', version):0{VERSION_DIGITS}d}/"

    def manifest(self, version: int) -> str:
        return self.version_prefix(version) + "manifest.json"

    def segment(self, version: int, index: int, *, epoch: int, rank: int = 0) -> str:
        """Key of delta segment ``index`` written by ``rank`` under claim ``epoch``."""
        _check_number("segment index", index, 99999)
        _check_number("epoch", epoch, MAX_EPOCH, 1)
        _check_number("rank", rank, MAX_RANK)
        return self.version_prefix(version) + f"e{epoch:06d}-seg-r{rank:03d}-{index:05d}.bin"

    def keyframe_prefix(self, version: int) -> str:
        """Where the parts of version ``version``'s keyframe live."""
        return f"{self.run}/keyframes/{_check_number('version', version):0{VERSION_DIGITS}d}/"

    def keyframe_part(self, version: int, index: int, *, epoch: int, rank: int = 0) -> str:
        """Key of keyframe part ``index`` written by ``rank`` under claim ``epoch``."""
        _check_number("keyframe part index", index, 999)
        _check_number("epoch", epoch, MAX_EPOCH, 1)
        _check_number("rank", rank, MAX_RANK)
        return self.keyframe_prefix(version) + f"e{epoch:06d}-part-r{rank:03d}-{index:03d}.safetensors"

    def rollouts_prefix(self, step: int) -> str:
        return f"{self.run}/rollouts/step-{_check_number('step', step):0{VERSION_DIGITS}d}/"

    # --- parsing -----------------------------------------------------------------------------------
    def parse_version_key(self, key: str) -> tuple[int, str] | None:
        """``(version, name)`` for a key under ``versions/``, else ``None``."""
        if not key.startswith(self.versions_prefix):
            return None
        rest = key[len(self.versions_prefix) :]
        digits, sep, name = rest.partition("/")
        if not sep or len(digits) != VERSION_DIGITS or not digits.isdigit() or not name:
            return None
        return int(digits), name

    def parse_keyframe_key(self, key: str) -> int | None:
        """The version of a keyframe part key (``keyframes/<v>/<part>``), else ``None``."""
        if not key.startswith(self.keyframes_prefix):
            return None
        digits, sep, name = key[len(self.keyframes_prefix) :].partition("/")
        if not sep or len(digits) != VERSION_DIGITS or not digits.isdigit() or not _PART_NAME.match(name):
            return None
        return int(digits)

    def is_segment_key(self, key: str, version: int) -> bool:
        """Whether ``key`` names a segment of ``version`` (``e<epoch>-seg-r<rank>-<i>.bin``)."""
        parsed = self.parse_version_key(key)
        return parsed is not None and parsed[0] == version and bool(_SEGMENT_NAME.match(parsed[1]))

    def is_keyframe_part_key(self, key: str, version: int) -> bool:
        """Whether ``key`` names a keyframe part of ``version``."""
        prefix = self.keyframe_prefix(version)
        return key.startswith(prefix) and bool(_PART_NAME.match(key[len(prefix) :]))
