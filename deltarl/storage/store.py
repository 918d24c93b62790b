"""The object-store interface every backend implements, and its small value types.

Contract shared by all backends (memory, local directory, S3, relay client):

* Keys are ``str`` with ``/`` separators, relative to the store's root (never a ``Path``).
  A valid key is non-empty, has no leading ``/``, no empty, ``.`` or ``..`` parts and no
  backslashes or NULs; anything else raises :class:`~deltarl.errors.InvalidKey`.
* A missing key raises :class:`~deltarl.errors.ObjectNotFound` (also a ``FileNotFoundError``)
  from ``get``, ``get_range``, ``head`` and ``cas``-with-an-etag; ``delete`` of a missing key is
  a no-op; ``exists`` returns ``False``.
* Writes are atomic: a reader sees either the whole old object, the whole new one, or none.
* ``put_if_absent`` is a real conditional create (S3 ``If-None-Match: *``, ``O_EXCL`` or an atomic
  link locally); if the key exists it raises :class:`~deltarl.errors.ObjectExists` and writes
  nothing.
* ``cas`` is compare-and-swap on the object's ETag: ``expected_etag=None`` means "create only if
  absent" (present: ``PreconditionFailed``); otherwise the write happens only if the current ETag
  equals ``expected_etag``, else :class:`~deltarl.errors.PreconditionFailed`. It returns the new
  ETag. To read-modify-write, take the ETag with ``head`` *before* ``get``: a value newer than its
  ETag only makes the swap fail and retry, while get-then-head can pair an old value with a new
  ETag and lose an update.
* ETags are opaque strings without quotes. Memory and local stores use the content's MD5 hex (as
  S3 does for a single-part PUT), so equal bytes have equal ETags and ETags survive restarts; S3
  multipart objects have ``<hex>-<parts>``.
* A conditional write retried after a dropped connection is ambiguous (the first attempt may have
  landed): backends that retry report success if the object then holds exactly the bytes written.
* ``get_range(key, start, end)`` returns bytes ``[start, end)``: ``end`` is exclusive and is
  clamped to the object's size; ``start == size`` gives ``b""``; ``start`` beyond the size, a
  negative ``start`` or ``start > end`` raises :class:`~deltarl.errors.InvalidRange`.
  ``end=None`` means "to the end".
* ``list(prefix)`` yields every key that starts with ``prefix`` (a plain string prefix, not a
  directory), sorted lexicographically (by code point, which is UTF-8 byte order, as S3 sorts).
* Backends retry transient failures themselves (see :mod:`deltarl.storage.retry`); what escapes is
  final (:class:`~deltarl.errors.TransientStoreError` once retries are exhausted, another
  :class:`~deltarl.errors.StoreError` for a permanent failure).
* Backend limits: the local store cannot hold both ``a`` and ``a/b`` (a file is not a directory;
  ``StoreError``) and reserves the top-level name ``.deltarl-tmp``.
* ``pending_writes(prefix)`` lists writes that started and have not finished: what a writer killed
  mid-write leaves behind, never visible as objects but taking space (a local temp file, an S3
  multipart upload). It cannot tell a dead writer's from a live one's: callers decide by their own
  means (gc: the run's writer claim, and how long the write has been left untouched).
  ``abort_pending`` discards one; a live writer whose write is aborted fails that write.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ObjectInfo:
    """Metadata of one stored object."""

    key: str
    size: int
    etag: str


@dataclass(frozen=True)
class PendingWrite:
    """A write that started and has not finished (see ``ObjectStore.pending_writes``)."""

    #: The key being written; the local store records only the key's first path component, so
    #: there it is ``"<component>/…"``.
    key: str
    #: Bytes it holds (a temp file's size; the parts an upload has received).
    size: int
    #: Unix seconds: when it was last written to (local) or started (an S3 upload).
    touched_at: float
    #: What ``abort_pending`` removes: a temp file's name, an upload id.
    handle: str


class ObjectStore(abc.ABC):
    """A flat namespace of immutable-by-convention byte objects. Thread-safe."""

    #: Human-readable location, e.g. ``s3://bucket/prefix`` or ``/data/runs``.
    url: str

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Return the whole object. Missing key: ``ObjectNotFound``."""

    @abc.abstractmethod
    def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        """Return bytes ``[start, end)`` (end exclusive, clamped to the size; ``None`` = to the end)."""

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo:
        """Return size and ETag. Missing key: ``ObjectNotFound``."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> str:
        """Write (or overwrite) the object atomically; return its ETag."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> str:
        """Create the object only if absent (real conditional write); else ``ObjectExists``."""

    @abc.abstractmethod
    def cas(self, key: str, data: bytes, expected_etag: str | None) -> str:
        """Compare-and-swap on ETag (``None`` = must not exist); mismatch: ``PreconditionFailed``."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether the key exists."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield keys that start with ``prefix``, sorted."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing key is not an error."""

    def put_stream_if_absent(self, key: str, chunks: Iterable[Any]) -> str:
        """Create the object from ``chunks`` (buffers, in order) only if absent, like ``put_if_absent``:
        it appears whole or not at all. Backends override this to stream without holding the whole
        object (a temp file locally, a multipart upload on S3); this default joins the chunks."""
        return self.put_if_absent(key, b"".join(bytes(c) for c in chunks))

    def get_range_into(self, key: str, start: int, buf: Any) -> int:
        """Read bytes ``[start, start + len(buf))`` into the writable buffer ``buf``; return how many
        were read (fewer at the object's end). Backends override this to skip the intermediate bytes."""
        mv = memoryview(buf).cast("B")
        data = self.get_range(key, start, start + len(mv))
        mv[: len(data)] = data
        return len(data)

    def pending_writes(self, prefix: str = "") -> Iterator[PendingWrite]:
        """Yield the unfinished writes of keys that may start with ``prefix`` (a backend that knows
        less of the key, like the local store, yields every write that *may* be under it). This
        default yields none: a backend whose writes are single requests leaves nothing behind."""
        return iter(())

    def abort_pending(self, write: PendingWrite) -> None:  # noqa: B027 - optional hook, default does nothing
        """Discard one unfinished write from :meth:`pending_writes`; one already gone is no error."""

    def close(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Release connections or background resources."""

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
