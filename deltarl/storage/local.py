"""Local-directory object store: one file per key, atomic writes by temp file + rename/link.

Layout: the object ``a/b/c`` is the file ``<root>/a/b/c``, so a run directory can be browsed,
copied or served as-is. Temp files and lock files live in ``<root>/.deltarl-tmp/`` (same file
system as the objects, so renames are atomic); keys under that name are refused. That folder is
made by the first write, so a store on a read-only mount opens and reads (every write then fails
with ``StoreError``). A temp file is named ``<first key component>~<random>.tmp`` (the component
only when it is a plain name of at most 128 characters, as every run name is), so
``pending_writes("<run>/")`` finds what a writer of that run left when it died mid-write, and gc
can sweep it once the run's writer is known dead. Temp files older than an hour are also swept when
a writable store is opened.

Atomicity:

* ``put`` writes a temp file, fsyncs it, and ``rename``\\ s it over the key (readers see old or new).
* ``put_if_absent`` writes a temp file and ``link``\\ s it to the key: ``link`` fails with
  ``EEXIST`` if the key exists, so creation is one atomic, conditional step and no partial
  object is ever visible.
* ``cas`` takes an ``fcntl.flock`` on the key's lock stripe, checks the current ETag, then
  renames (or links, for ``expected_etag=None``). ``put`` and ``delete`` take the same lock, so
  they linearise with ``cas``. The lock is an OS advisory lock: it holds across threads and
  processes on one host (and on NFS only where ``flock`` is honoured).

ETags are the MD5 hex of the content (what S3 gives a single-part PUT): stable across restarts,
and a swap between two equal contents is harmless. So that ``head`` of a 16 GB keyframe does not
hash 16 GB, the ETag is recorded at write time in an extended attribute (``user.deltarl.md5``,
stamped with size and mtime); files without it (copied in, or no xattr support) are hashed. A limit of the file system: a key cannot be
both an object and a "directory" of other keys (``a`` and ``a/b``); such a write raises
``StoreError``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from deltarl.errors import (
    InvalidKey,
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    StoreError,
    StoreNotFound,
)
from deltarl.storage.keys import clamp_range, etag_of, validate_key, validate_prefix
from deltarl.storage.pagecache import WriteBehind, drop_read
from deltarl.storage.store import ObjectInfo, ObjectStore, PendingWrite

log = logging.getLogger(__name__)

TMP_DIR = ".deltarl-tmp"
_LOCK_STRIPES = 64
_READ_CHUNK = 1 << 20
_ETAG_XATTR = "user.deltarl.md5"
#: A key's first component that a temp file's name may carry (every run name is one).
_TAGGABLE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _remember_etag(fd: int, etag: str) -> None:
    """Record ``etag`` on the file (xattr), stamped with its size and mtime so edits invalidate it."""
    st = os.fstat(fd)
    try:
        os.setxattr(fd, _ETAG_XATTR, f"{etag} {st.st_size} {st.st_mtime_ns}".encode())
    except OSError as err:  # no xattrs on this file system: head() hashes instead
        log.debug("cannot record ETag xattr: %s", err)


def _recall_etag(fd: int, st: os.stat_result) -> str | None:
    """The recorded ETag if it is there and the file's size and mtime still match, else None."""
    try:
        etag, size, mtime_ns = os.getxattr(fd, _ETAG_XATTR).decode().split()
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return etag if (int(size), int(mtime_ns)) == (st.st_size, st.st_mtime_ns) else None


def _discard(tmp: Path) -> None:
    """Remove a temp file if it is there (after its write failed, or once it is linked into place)."""
    with contextlib.suppress(OSError):  # missing, or a read-only file system
        tmp.unlink()


class LocalStore(ObjectStore):
    """Objects as files under ``root``.

    ``create``: make ``root`` if it is missing (writers); with ``create=False`` a missing ``root``
    raises :class:`~deltarl.errors.StoreNotFound` and nothing is created (readers). Opening never
    writes: the temp folder is made by the first write.
    """

    def __init__(
        self, root: str | os.PathLike[str], *, fsync: bool = True, sweep_after_s: float = 3600.0, create: bool = True
    ) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)
        self.fsync = fsync
        self._tmp = self.root / TMP_DIR
        self._tmp_ready = False
        if not self.root.is_dir():
            if not create:
                raise StoreNotFound(f"no store at {self.url!r} (not a directory)")
            # ranks of one job open the same new store at once: the folder another made between
            # the check above and this mkdir is theirs to share, only a file in its place is not
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except FileExistsError as err:
                raise StoreNotFound(f"no store at {self.url!r} (not a directory)") from err
            except OSError as err:
                raise StoreError(f"cannot create local store at {self.root}: {err}") from err
        if os.access(self._tmp, os.W_OK):  # a read-only store has nothing this process could sweep
            self.sweep_temp(sweep_after_s)

    def _tmp_dir(self) -> Path:
        """The temp folder (made on the first write); StoreError where the store cannot be written."""
        if not self._tmp_ready:
            try:
                (self._tmp / "locks").mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise StoreError(f"{self.url}: cannot write to this store: {err}") from err
            self._tmp_ready = True
        return self._tmp

    def sweep_temp(self, older_than_s: float = 3600.0) -> int:
        """Remove temp files a crashed writer left behind (never visible as objects); return how many.

        Only files older than ``older_than_s`` go, so a write in flight in another process is safe.
        """
        cutoff = time.time() - older_than_s
        removed = 0
        try:
            entries = list(os.scandir(self._tmp))
        except FileNotFoundError:
            return 0
        for entry in entries:
            if not entry.name.endswith(".tmp"):
                continue
            # A temp file may vanish at any moment: its writer renamed or linked it into place,
            # or another sweeper removed it. Either way there is nothing left to sweep.
            with contextlib.suppress(FileNotFoundError):
                if entry.is_file() and entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
                    removed += 1
        if removed:
            log.info("%s: swept %d stale temp files", self.url, removed)
        return removed

    # --- paths and helpers ------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        validate_key(key)
        if key == TMP_DIR or key.startswith(TMP_DIR + "/"):
            raise InvalidKey(f"{key!r} is reserved by the local store")
        return self.root / key

    @contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        stripe = zlib.crc32(key.encode()) % _LOCK_STRIPES
        try:
            fd = os.open(self._tmp_dir() / "locks" / f"{stripe:02d}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise StoreError(f"{self.url}: cannot write to this store: {err}") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def _temp_for(self, key: str) -> Path:
        """A fresh temp file name for a write of ``key``, tagged with the key's first component."""
        first = key.split("/", 1)[0]
        return self._tmp_dir() / f"{first if _TAGGABLE.match(first) else ''}~{uuid.uuid4().hex}.tmp"

    def _write_temp(self, key: str, data: bytes, etag: str) -> Path:
        tmp = self._temp_for(key)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
                _remember_etag(f.fileno(), etag)
        except OSError as err:
            _discard(tmp)
            raise StoreError(f"{self.url}: cannot write a temp file: {err}") from err
        return tmp

    def _install(self, key: str, data: bytes, how: Callable[[Path, Path], None]) -> str:
        """Write ``data`` to a temp file and move it to ``key`` with ``how`` (rename or link).

        Return the ETag. ``FileExistsError`` from ``how`` (a ``link`` onto an existing key)
        propagates as is.
        """
        path = self._path(key)
        etag = etag_of(data)
        tmp = self._write_temp(key, data, etag)
        try:
            for attempt in range(3):
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                except (FileExistsError, NotADirectoryError) as err:
                    raise StoreError(f"{self.url}: {key!r} lies under an existing object") from err
                try:
                    how(tmp, path)
                    break
                except FileNotFoundError:
                    # A concurrent delete pruned the empty parent between mkdir and install.
                    if attempt == 2:
                        raise
            if self.fsync:
                self._fsync_dir(path.parent)
        except (FileExistsError, StoreError):
            raise
        except IsADirectoryError as err:
            raise StoreError(f"{self.url}: {key!r} is a directory of other keys") from err
        except OSError as err:
            raise StoreError(f"{self.url}: cannot write {key!r}: {err}") from err
        finally:
            _discard(tmp)
        return etag

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _open(self, key: str) -> int:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError) as err:
            raise ObjectNotFound(f"{self.url}: no object {key!r}") from err
        except OSError as err:
            raise StoreError(f"{self.url}: cannot read {key!r}: {err}") from err
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ObjectNotFound(f"{self.url}: no object {key!r} (it is a directory of keys)")
        return fd

    def _current_etag(self, key: str) -> str | None:
        try:
            return self.head(key).etag
        except ObjectNotFound:
            return None

    # --- ObjectStore ------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        fd = self._open(key)
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        fd = self._open(key)
        with os.fdopen(fd, "rb") as f:
            lo, hi = clamp_range(key, start, end, os.fstat(f.fileno()).st_size)
            f.seek(lo)
            data = f.read(hi - lo)
            drop_read(f.fileno(), lo, len(data))
            return data

    def head(self, key: str) -> ObjectInfo:
        fd = self._open(key)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            etag = _recall_etag(f.fileno(), st)
            if etag is None:  # not written by a LocalStore, or no xattrs here: hash it
                md5 = hashlib.md5(usedforsecurity=False)
                while chunk := f.read(_READ_CHUNK):
                    md5.update(chunk)
                etag = md5.hexdigest()
        return ObjectInfo(key=key, size=st.st_size, etag=etag)

    def put(self, key: str, data: bytes) -> str:
        self._path(key)
        with self._locked(key):
            return self._install(key, data, os.replace)

    def put_if_absent(self, key: str, data: bytes) -> str:
        try:
            return self._install(key, data, os.link)
        except FileExistsError as err:
            raise ObjectExists(f"{self.url}: object {key!r} already exists") from err

    def cas(self, key: str, data: bytes, expected_etag: str | None) -> str:
        self._path(key)
        with self._locked(key):
            if expected_etag is None:
                try:
                    return self._install(key, data, os.link)
                except FileExistsError as err:
                    raise PreconditionFailed(f"{self.url}: {key!r} exists (expected absent)") from err
            current = self._current_etag(key)
            if current is None:
                raise ObjectNotFound(f"{self.url}: no object {key!r} to compare-and-swap")
            if current != expected_etag:
                raise PreconditionFailed(f"{self.url}: {key!r} has ETag {current}, expected {expected_etag}")
            return self._install(key, data, os.replace)

    def put_stream_if_absent(self, key: str, chunks: Iterable[Any]) -> str:
        """Stream ``chunks`` to a temp file (fsynced), then link it to ``key`` (``ObjectExists`` if
        taken). The ETag is a random token, as for an S3 multipart upload: nothing hashes the bytes
        a second time (the caller hashes them as it produces them)."""
        path = self._path(key)
        etag = uuid.uuid4().hex
        tmp = self._temp_for(key)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                behind = WriteBehind(fd) if self.fsync else None  # keyframes pass through the page cache
                for chunk in chunks:
                    mv = memoryview(chunk).cast("B")
                    while mv:
                        mv = mv[os.write(fd, mv) :]
                    if behind is not None:
                        behind.wrote(memoryview(chunk).nbytes)
                if self.fsync:
                    os.fsync(fd)
                _remember_etag(fd, etag)
            finally:
                os.close(fd)
            path.parent.mkdir(parents=True, exist_ok=True)
            os.link(tmp, path)
            if self.fsync:
                self._fsync_dir(path.parent)
        except FileExistsError as err:
            raise ObjectExists(f"{self.url}: object {key!r} already exists") from err
        except OSError as err:
            raise StoreError(f"{self.url}: cannot write {key!r}: {err}") from err
        finally:
            _discard(tmp)
        return etag

    def get_range_into(self, key: str, start: int, buf: Any) -> int:
        mv = memoryview(buf).cast("B")
        fd = self._open(key)
        try:
            done = 0
            while done < len(mv):
                n = os.preadv(fd, [mv[done:]], start + done)
                if n == 0:
                    break
                done += n
            drop_read(fd, start, done)
            return done
        finally:
            os.close(fd)

    def pending_writes(self, prefix: str = "") -> Iterator[PendingWrite]:
        """Temp files of writes that may be of keys under ``prefix``: those tagged with a first
        component that ``prefix`` falls under (or that falls under ``prefix``); untagged ones
        (an old name, or a key whose first component is not a plain name) only for ``prefix=""``."""
        validate_prefix(prefix)
        try:
            entries = sorted(os.scandir(self._tmp), key=lambda e: e.name)
        except FileNotFoundError:
            return
        for entry in entries:
            if not entry.name.endswith(".tmp"):
                continue
            tag, sep, _ = entry.name.partition("~")
            if prefix and not (sep and tag and ((tag + "/").startswith(prefix) or prefix.startswith(tag + "/"))):
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue  # linked into place or swept meanwhile
            if stat.S_ISREG(st.st_mode):
                yield PendingWrite(key=f"{tag}/…" if sep and tag else "…", size=st.st_size, touched_at=st.st_mtime,
                                   handle=entry.name)

    def abort_pending(self, write: PendingWrite) -> None:
        name = write.handle
        if "/" in name or not name.endswith(".tmp"):
            raise InvalidKey(f"{name!r} is not a temp file of {self.url}")
        try:
            (self._tmp / name).unlink()
        except FileNotFoundError:
            return
        except OSError as err:
            raise StoreError(f"{self.url}: cannot remove temp file {name!r}: {err}") from err

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_prefix(prefix)
        if prefix.startswith(TMP_DIR + "/"):
            return  # temp and lock files are not objects
        head, _, _ = prefix.rpartition("/")
        base = self.root / head if head else self.root
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            rel = "" if rel == "." else rel + "/"
            if not rel:
                dirnames[:] = [d for d in dirnames if d != TMP_DIR]
            dirnames[:] = [
                d for d in dirnames if (rel + d + "/").startswith(prefix) or prefix.startswith(rel + d + "/")
            ]
            keys.extend(rel + name for name in filenames if (rel + name).startswith(prefix))
        yield from sorted(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._locked(key):
            try:
                path.unlink()
            except FileNotFoundError:
                return
            except IsADirectoryError:
                return
            except OSError as err:
                raise StoreError(f"{self.url}: cannot delete {key!r}: {err}") from err
        self._prune(path.parent)

    def _prune(self, directory: Path) -> None:
        """Remove now-empty parent directories up to the root (best effort, racing writers retry)."""
        while directory != self.root and self.root in directory.parents:
            try:
                directory.rmdir()
            except OSError as err:
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    log.debug("not pruning %s: %s", directory, err)
                return
            directory = directory.parent
