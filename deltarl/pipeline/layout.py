"""The run namespace: where each object of a training run lives in the store.

One prefix per run (see docs/RUN_NAMESPACE.md)::

    <run>/run.json                                   immutable: tensor table, codec, intervals
    <run>/versions/000000000042/seg-00000.bin        immutable delta segments of version 42
    <run>/versions/000000000042/manifest.json        immutable commit record, written LAST
    <run>/keyframes/000000000040.safetensors         immutable full snapshot
    <run>/HEAD                                       mutable hint: latest committed version (CAS)
    <run>/WRITER                                     mutable: the publisher's writer claim (CAS)
    <run>/rollouts/step-000000000042/…               immutable admitted results
    <run>/coordinator/…                              immutable coordinator records

Versions and steps are written with 12 zero-padded digits so keys sort in numeric order.
"""

from __future__ import annotations

import re

from deltarl.errors import InvalidKey

VERSION_DIGITS = 12
MAX_VERSION = 10**VERSION_DIGITS - 1
#: Object names that are overwritten in place (by compare-and-swap); every other key is write-once.
MUTABLE_NAMES = frozenset({"HEAD", "WRITER"})

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SEGMENT_NAME = re.compile(r"^seg-(\d{5,})\.bin$")


def validate_run_name(run: str) -> str:
    """Return ``run`` if it is a valid run name (1-128 of ``[A-Za-z0-9._-]``, alphanumeric first)."""
    if not isinstance(run, str) or not _RUN_NAME.match(run):
        raise InvalidKey(
            f"invalid run name {run!r}: use 1-128 characters of [A-Za-z0-9._-], starting with a letter or digit"
        )
    return run


def _check_number(what: str, n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_VERSION:
        raise InvalidKey(f"{what} must be an int in [0, {MAX_VERSION}], got {n!r}")
    return n


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

    def segment(self, version: int, index: int) -> str:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= 99999:
            raise InvalidKey(f"segment index must be an int in [0, 99999], got {index!r}")
        return self.version_prefix(version) + f"seg-{index:05d}.bin"

    def keyframe(self, version: int) -> str:
        return f"{self.run}/keyframes/{_check_number('version', version):0{VERSION_DIGITS}d}.safetensors"

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
        """The version of a key under ``keyframes/``, else ``None``."""
        if not key.startswith(self.keyframes_prefix) or not key.endswith(".safetensors"):
            return None
        digits = key[len(self.keyframes_prefix) : -len(".safetensors")]
        if len(digits) != VERSION_DIGITS or not digits.isdigit():
            return None
        return int(digits)

    def is_segment_key(self, key: str, version: int) -> bool:
        """Whether ``key`` names a segment of ``version`` (``…/versions/<v>/seg-NNNNN.bin``)."""
        parsed = self.parse_version_key(key)
        return parsed is not None and parsed[0] == version and bool(_SEGMENT_NAME.match(parsed[1]))
