"""One writer per run: a leased writer claim (``<run>/WRITER``) moved only by compare-and-swap.

Safety never rests on the lease; it rests on conditional writes:

* a manifest is created with ``put_if_absent`` at a fixed key per version, so two writers can never
  both commit version ``v`` (the loser gets ``ObjectExists`` and raises :class:`WriterConflict`);
* HEAD moves by CAS on the ETag this writer last saw, so a writer that lost track fails;
* the claim is renewed by CAS on the ETag this writer last wrote, so a writer whose claim was taken
  over (after its lease expired, by ``takeover=True``, or by ``gc`` fencing an abandoned publish)
  learns it at its next renewal and stops before committing anything.

The lease decides *liveness*: a publisher with another ``writer_id`` may take the claim only when
the lease has expired (or with ``takeover=True``); one with the same ``writer_id`` (a restarted
trainer) resumes at once. A writer renews before every publish and again before committing if its
lease is close to running out, and never commits past its own (monotonic-clock) lease.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass

from deltarl.errors import (
    FormatError,
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    UnsupportedFormatVersion,
    WriterConflict,
)
from deltarl.pipeline.canonical import canonical_json, load_record
from deltarl.pipeline.layout import RunLayout
from deltarl.storage.store import ObjectStore

logger = logging.getLogger(__name__)

CLAIM_FORMAT_VERSION = 3
MAX_CLAIM_BYTES = 4096


def new_writer_id() -> str:
    """A fresh writer id: host, pid and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class WriterClaim:
    """The content of ``<run>/WRITER``. Times are Unix milliseconds.

    ``epoch`` is 1 on the first acquire of a run and the previous epoch + 1 on every acquire
    after it (restart or takeover); every object key the holder writes carries it.
    """

    writer_id: str
    acquired_at_ms: int
    expires_at_ms: int
    host: str
    pid: int
    epoch: int = 1
    format_version: int = CLAIM_FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.format_version != CLAIM_FORMAT_VERSION:
            raise UnsupportedFormatVersion(f"WRITER: format_version {self.format_version} is not supported")
        if self.epoch < 1:
            raise FormatError("WRITER: epoch must be >= 1")

    def to_bytes(self) -> bytes:
        obj: dict[str, object] = {
            "format_version": self.format_version,
            "writer_id": self.writer_id,
            "acquired_at_ms": self.acquired_at_ms,
            "expires_at_ms": self.expires_at_ms,
            "host": self.host,
            "pid": self.pid,
            "epoch": self.epoch,
        }
        return canonical_json(obj)

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "WRITER") -> WriterClaim:
        f = load_record(data, where, MAX_CLAIM_BYTES, CLAIM_FORMAT_VERSION)
        claim = cls(
            writer_id=f.str_("writer_id"),
            acquired_at_ms=f.int_("acquired_at_ms"),
            expires_at_ms=f.int_("expires_at_ms"),
            host=f.str_("host"),
            pid=f.int_("pid"),
            epoch=f.int_("epoch", minimum=1),
        )
        f.done()
        return claim

    def describe(self) -> str:
        expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.expires_at_ms / 1000))
        return f"writer {self.writer_id!r} (epoch {self.epoch}, host {self.host}, pid {self.pid}, lease until {expires})"


def read_claim(store: ObjectStore, key: str) -> tuple[WriterClaim, str] | None:
    """The current claim and its ETag, or ``None`` if there is none. Consistent across a concurrent swap."""
    for _ in range(10):
        try:
            before = store.head(key).etag
            data = store.get(key)
            after = store.head(key).etag
        except ObjectNotFound:
            return None
        if before == after:
            try:
                return WriterClaim.from_bytes(data, where=key), after
            except FormatError as err:
                raise WriterConflict(f"{key}: unreadable writer claim ({err}); remove it only if no writer is alive") from err
    raise WriterConflict(f"{key}: writer claim keeps changing; another writer is active")


class WriterLease:
    """This process's claim on a run. Thread-compatible (used by one publisher)."""

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        writer_id: str,
        *,
        lease_s: float = 300.0,
        takeover: bool = False,
    ) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self.store = store
        self.key = RunLayout(run).writer
        self.writer_id = writer_id
        self.lease_s = lease_s
        self.takeover = takeover
        self._etag: str | None = None
        self._valid_until = 0.0  # time.monotonic()
        self._acquired_at_ms = 0
        #: The claim epoch this writer holds (0 until acquired); every key it writes carries it.
        self.epoch = 0

    def _record(self, now_ms: int, expires_ms: int | None = None, epoch: int | None = None) -> bytes:
        return WriterClaim(
            writer_id=self.writer_id,
            acquired_at_ms=self._acquired_at_ms or now_ms,
            expires_at_ms=now_ms + int(self.lease_s * 1000) if expires_ms is None else expires_ms,
            host=socket.gethostname(),
            pid=os.getpid(),
            epoch=self.epoch if epoch is None else epoch,
        ).to_bytes()

    @property
    def held(self) -> bool:
        return self._etag is not None

    def acquire(self) -> None:
        """Take the claim, or raise WriterConflict naming the live writer that holds it."""
        for _ in range(10):
            start = time.monotonic()
            now_ms = int(time.time() * 1000)
            current = read_claim(self.store, self.key)
            epoch = 1 if current is None else current[0].epoch + 1
            self._acquired_at_ms = 0
            try:
                if current is None:
                    self._etag = self.store.cas(self.key, self._record(now_ms, epoch=epoch), None)
                else:
                    claim, etag = current
                    expired = claim.expires_at_ms <= now_ms
                    if claim.writer_id != self.writer_id and not expired and not self.takeover:
                        raise WriterConflict(
                            f"run {self.key.rsplit('/', 1)[0]!r} already has a publisher: {claim.describe()}. "
                            "One writer per run: stop it, wait for its lease to expire, pass the same "
                            "writer_id to resume it, or take over explicitly (takeover=True)."
                        )
                    if claim.writer_id != self.writer_id:
                        logger.warning("taking the writer claim of %s over from %s", self.key, claim.describe())
                    self._etag = self.store.cas(self.key, self._record(now_ms, epoch=epoch), etag)
            except (PreconditionFailed, ObjectExists, ObjectNotFound):
                logger.debug("writer claim %s changed while acquiring; retrying", self.key)
                continue
            self.epoch = epoch
            self._acquired_at_ms = now_ms
            self._valid_until = start + self.lease_s
            return
        raise WriterConflict(f"{self.key}: could not acquire the writer claim; another writer keeps changing it")

    def renew(self) -> None:
        """Extend the lease by CAS on the ETag last written; WriterConflict if it was taken over."""
        if self._etag is None:
            raise WriterConflict(f"{self.key}: the writer claim is not held by {self.writer_id!r}")
        start = time.monotonic()
        now_ms = int(time.time() * 1000)
        try:
            self._etag = self.store.cas(self.key, self._record(now_ms), self._etag)
        except (PreconditionFailed, ObjectNotFound) as err:
            self._etag = None
            current = read_claim(self.store, self.key)
            holder = current[0].describe() if current else "nobody"
            fenced = f", fenced by epoch {current[0].epoch}" if current and current[0].epoch > self.epoch else ""
            raise WriterConflict(
                f"lost the writer claim {self.key} ({self.writer_id!r}, epoch {self.epoch}{fenced}): it is now held by "
                f"{holder}; this publisher stops so history does not fork"
            ) from err
        self._valid_until = start + self.lease_s

    def release(self) -> None:
        """Mark the claim expired so another writer may take it at once. Best effort."""
        if self._etag is None:
            return
        now_ms = int(time.time() * 1000)
        try:
            self.store.cas(self.key, self._record(now_ms, expires_ms=now_ms), self._etag)
        except (PreconditionFailed, ObjectNotFound):
            logger.warning("writer claim %s was taken over before release", self.key)
        finally:
            self._etag = None


def fence_claim(store: ObjectStore, run: str, holder: str, *, force: bool = False) -> WriterClaim | None:
    """Take an expired (or, with ``force``, any) claim for ``holder`` with an already-expired lease.

    Used by ``gc`` before it sweeps the objects of an abandoned publish: the old writer, should it
    still be alive, fails its next renewal instead of committing a manifest that names swept
    objects. Returns the claim that was fenced, or ``None`` if there was none; raises WriterConflict
    if a live writer holds it and ``force`` is false.
    """
    key = RunLayout(run).writer
    current = read_claim(store, key)
    if current is None:
        return None
    claim, etag = current
    now_ms = int(time.time() * 1000)
    if claim.expires_at_ms > now_ms and not force:
        raise WriterConflict(f"{key}: a live publisher holds the run ({claim.describe()})")
    record = WriterClaim(holder, now_ms, now_ms, socket.gethostname(), os.getpid(), epoch=claim.epoch + 1).to_bytes()
    try:
        store.cas(key, record, etag)
    except (PreconditionFailed, ObjectNotFound) as err:
        raise WriterConflict(f"{key}: the writer claim changed while fencing it") from err
    return claim


__all__ = ["WriterClaim", "WriterLease", "fence_claim", "new_writer_id", "read_claim"]
