"""The relay's bounded on-disk cache: whole immutable objects, least-recently-used eviction.

Each object is two files named by a hash of its key: ``<h>.data`` (the bytes) and ``<h>.json``
(key, size, ETag, the object's piece hashes: the manifest's once its bytes matched them, else the
relay's own, taken as the bytes landed; whether they are the manifest's).
Both are written to a temporary name and renamed, data first, so a crash leaves either a whole
entry or an orphan that the next start removes. On start the directory is scanned and the
entries are ordered by modification time (touched on every hit), so LRU order survives restarts.

Readers open the data file before an eviction can unlink it; on POSIX the open descriptor keeps
the bytes readable, so eviction never tears a response in flight.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from deltarl.errors import FormatError, IntegrityError
from deltarl.pipeline.manifest import ObjectRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheEntry:
    """One cached object."""

    key: str
    size: int
    etag: str
    ref: ObjectRef | None  # the pieces the bytes are checked by (the manifest's where ``verified``)
    verified: bool
    path: str


class DiskCache:
    """Bounded LRU cache of whole objects in one directory. Use from one event-loop thread."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int, *, on_evict: Callable[[CacheEntry], None] | None = None) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._on_evict = on_evict
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self.bytes = 0
        self.directory.mkdir(parents=True, exist_ok=True)
        self._load()

    # --- startup ------------------------------------------------------------------------------

    def _load(self) -> None:
        found: list[tuple[float, CacheEntry]] = []
        for path in self.directory.iterdir():
            if path.name.startswith(".tmp-"):
                path.unlink(missing_ok=True)  # a write interrupted by a crash
                continue
            if path.suffix != ".json":
                continue
            data_path = path.with_suffix(".data")
            try:
                meta = json.loads(path.read_text())
                entry = CacheEntry(
                    key=str(meta["key"]), size=int(meta["size"]), etag=str(meta["etag"]),
                    ref=None if meta["ref"] is None else ObjectRef.from_obj(meta["ref"], str(path)),
                    verified=bool(meta["verified"]), path=str(data_path),
                )
                st = data_path.stat()
            except (OSError, ValueError, KeyError, TypeError, FormatError) as err:
                log.warning("dropping unreadable cache entry %s: %s", path, err)
                path.unlink(missing_ok=True)
                data_path.unlink(missing_ok=True)
                continue
            if st.st_size != entry.size or path.stem != _name(entry.key):
                log.warning("dropping inconsistent cache entry %s", path)
                path.unlink(missing_ok=True)
                data_path.unlink(missing_ok=True)
                continue
            found.append((st.st_mtime, entry))
        for path in self.directory.glob("*.data"):
            if not path.with_suffix(".json").exists():
                path.unlink(missing_ok=True)  # data renamed but meta never written
        for _, entry in sorted(found, key=lambda t: t[0]):
            self._entries[entry.key] = entry
            self.bytes += entry.size
        self._evict_to_fit(0)
        log.info("relay cache %s: %d objects, %d bytes", self.directory, len(self._entries), self.bytes)

    # --- lookups ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> CacheEntry | None:
        """The entry for ``key`` (marked most recently used), or ``None``."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            with contextlib.suppress(OSError):  # best effort: only the LRU order after a restart uses it
                os.utime(entry.path)
        return entry

    def keys(self) -> list[str]:
        return list(self._entries)

    # --- writes -------------------------------------------------------------------------------

    def temp_path(self) -> str:
        """A fresh temporary file in the cache directory (the caller writes it, then commits)."""
        fd, path = self._mkstemp()
        os.close(fd)
        return path

    def ensure_directory(self) -> None:
        """Make the cache directory again if someone removed it (the entries it held are then found
        missing when read, and fetched again)."""
        if not self.directory.is_dir():
            log.warning("relay cache directory %s vanished; making it again (its objects are fetched again)", self.directory)
            self.directory.mkdir(parents=True, exist_ok=True)

    def _mkstemp(self) -> tuple[int, str]:
        """A temporary file in the cache directory (made again first if it vanished)."""
        try:
            return tempfile.mkstemp(prefix=".tmp-", dir=self.directory)
        except FileNotFoundError:
            self.ensure_directory()
            return tempfile.mkstemp(prefix=".tmp-", dir=self.directory)

    def fits(self, size: int) -> bool:
        return size <= self.max_bytes

    def commit(self, key: str, tmp_path: str, *, size: int, etag: str, ref: ObjectRef | None, verified: bool) -> CacheEntry | None:
        """Move a fully written temporary file into the cache; ``None`` if it cannot fit."""
        if not self.fits(size):
            os.unlink(tmp_path)
            return None
        self.remove(key)
        self._evict_to_fit(size)
        name = _name(key)
        data_path = self.directory / f"{name}.data"
        entry = CacheEntry(key=key, size=size, etag=etag, ref=ref, verified=verified, path=str(data_path))
        meta_tmp: str | None = None
        try:  # the metadata first (a full disk fails here), then both renames: never a .data without its .json
            meta_tmp = self._meta_temp(entry)
            os.replace(tmp_path, data_path)
            os.replace(meta_tmp, data_path.with_suffix(".json"))
        except OSError:
            for path in (tmp_path, meta_tmp, str(data_path)):
                if path is not None:
                    Path(path).unlink(missing_ok=True)
            raise
        self._entries[key] = entry
        self.bytes += size
        return entry

    def mark_verified(self, key: str, ref: ObjectRef) -> None:
        entry = self._entries.get(key)
        if entry is not None and not entry.verified:
            entry = replace(entry, verified=True, ref=ref)
            self._entries[key] = entry
            try:
                self._write_meta(entry)
            except OSError as err:  # kept verified in memory; after a restart it is checked again
                log.warning("could not record %s as verified on disk: %s", key, err)

    def remove(self, key: str) -> bool:
        """Drop ``key`` from the cache; whether it was there."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        meta = Path(entry.path).with_suffix(".json")
        meta.unlink(missing_ok=True)
        Path(entry.path).unlink(missing_ok=True)
        return True

    def _meta_temp(self, entry: CacheEntry) -> str:
        """``entry``'s metadata written to a temporary file in the cache directory (removed on failure)."""
        meta = {"key": entry.key, "size": entry.size, "etag": entry.etag, "verified": entry.verified,
                "ref": None if entry.ref is None else entry.ref.to_obj()}  # fmt: skip
        fd, tmp = self._mkstemp()
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(meta, f)
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            raise
        return tmp

    def _write_meta(self, entry: CacheEntry) -> None:
        os.replace(self._meta_temp(entry), Path(entry.path).with_suffix(".json"))

    def _evict_to_fit(self, incoming: int) -> None:
        while self._entries and self.bytes + incoming > self.max_bytes:
            key, entry = next(iter(self._entries.items()))
            self.remove(key)
            log.debug("evicted %s (%d bytes)", key, entry.size)
            if self._on_evict is not None:
                self._on_evict(entry)


def _name(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()  # a file name, not a content hash


def file_matches(path: str, ref: ObjectRef, chunk: int = 4 << 20) -> bool:
    """Whether a cached file holds exactly ``ref``'s bytes, checked by its pieces in one pass
    (blocking: call it in a thread)."""
    verifier = ref.verifier("its manifest")
    try:
        with open(path, "rb") as f:
            while block := f.read(chunk):
                verifier.update(block)
        verifier.finish()
    except IntegrityError:
        return False
    return True
