"""Canonical JSON records: the bytes every record of the run namespace is written as, and strict parsing.

A record serializes to *canonical JSON* (sorted keys, no spaces, UTF-8, integers and strings only -
no floats) with an explicit ``format_version``. Parsing is strict: a size cap, the one supported
format version (others raise :class:`~deltarl.errors.UnsupportedFormatVersion`, never patched up),
no unknown or missing fields, exact types, and the bytes must be canonical, so a hash of a record's
bytes names exactly one record. Manifests, run.json, HEAD, and the writer claim all
parse through :func:`load_record` and :class:`Fields`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from deltarl.errors import FormatError, InvalidKey, UnsupportedFormatVersion
from deltarl.pipeline.layout import validate_run_name

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def canonical_json(obj: Any) -> bytes:
    """Canonical JSON bytes: sorted keys, ``,``/``:`` separators, UTF-8 (not ASCII-escaped)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def is_hash_hex(value: object) -> bool:
    """Whether ``value`` is a 256-bit hash in hex (64 lowercase hex digits)."""
    return isinstance(value, str) and bool(_HEX64.match(value))


def check_run(run: object, where: str) -> None:
    """A ``FormatError`` (naming ``where``) unless ``run`` is a valid run name."""
    try:
        validate_run_name(run)  # type: ignore[arg-type]
    except InvalidKey as err:
        raise FormatError(f"{where}: {err}") from err


class Fields:
    """Pops typed fields out of a parsed JSON object; ``done()`` rejects leftovers."""

    def __init__(self, obj: object, where: str) -> None:
        if not isinstance(obj, dict):
            raise FormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        self.obj = dict(obj)
        self.where = where
        #: The record's ``format_version`` (set by :func:`load_record`).
        self.format_version = 0

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


def load_record(data: bytes, where: str, cap: int, format_version: int | tuple[int, ...]) -> Fields:
    """Parse a record's bytes: checked size, format version (one, or any of several a reader
    accepts; ``Fields.format_version`` says which) and canonical form; its fields to pop."""
    accepted = (format_version,) if isinstance(format_version, int) else format_version
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise FormatError(f"{where}: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > cap:
        raise FormatError(f"{where}: {len(data)} bytes exceeds the {cap}-byte cap")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise FormatError(f"{where}: not valid UTF-8 JSON: {err}") from err
    fields = Fields(obj, where)
    got = fields.obj.get("format_version")
    if isinstance(got, bool) or got not in accepted:
        readable = " and ".join(str(v) for v in accepted)
        raise UnsupportedFormatVersion(f"{where}: format_version {got!r} is not supported (this build reads {readable})")
    fields.obj.pop("format_version")
    fields.format_version = got
    if canonical_json(obj) != data:
        raise FormatError(f"{where}: bytes are not canonical JSON (sorted keys, no spaces, UTF-8)")
    return fields
