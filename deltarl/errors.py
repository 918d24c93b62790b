"""The exception hierarchy: one base, specific subclasses that also inherit the matching builtin."""

from __future__ import annotations

import enum


class DeltaRLError(Exception):
    """Base class of every error deltarl raises on purpose."""


# --- formats (pipeline) -------------------------------------------------------------------------


class FormatError(DeltaRLError, ValueError):
    """Bytes that do not parse as the documented format: bad magic, truncation, checksum, bounds."""


class UnsupportedFormatVersion(FormatError):
    """A record or segment carries a format version this build does not read."""


class IntegrityError(FormatError):
    """Bytes whose checksum, piece hash or state digest differs from the one recorded for them."""


class NonFiniteValue(FormatError):
    """A NaN or an infinity where only finite numbers are allowed (a result, a record)."""


class NonFiniteTensor(DeltaRLError, ValueError):
    """A floating tensor holds NaN or Inf: publishing it would poison every actor."""


class NonFiniteChunk(NonFiniteTensor):
    """One chunk's changed values hold NaN or Inf; the encoder re-raises it as a
    :class:`NonFiniteTensor` that names the tensor and the range."""

    def __init__(self, bad: int, changed: int) -> None:
        super().__init__(f"{bad} of {changed} changed elements are NaN/Inf")
        self.bad, self.changed = bad, changed


class NonFiniteStep(DeltaRLError, ArithmeticError):
    """A training step's loss or gradient is NaN or Inf; the weights were left unchanged."""


class BaseMismatch(DeltaRLError, ValueError):
    """A delta was built on a different base version than the state it is applied to."""


class TensorMismatch(DeltaRLError, ValueError):
    """A tensor's name, shape or dtype differs from what a delta or snapshot expects."""


class StagingError(DeltaRLError, RuntimeError):
    """A staged update was committed, rolled back or reused out of order."""


# --- storage -------------------------------------------------------------------------------------


class StoreError(DeltaRLError, OSError):
    """An object-store operation failed (after retries, where retrying applies)."""


class ObjectNotFound(StoreError, FileNotFoundError):
    """The key does not exist in the store."""


class StoreNotFound(StoreError, FileNotFoundError):
    """The store itself does not exist (a local folder that is missing), and the caller only reads
    it, so it was not created."""


class ObjectExists(StoreError, FileExistsError):
    """A conditional create found the key already present."""


class PreconditionFailed(StoreError):
    """A compare-and-swap found a different current value than the one expected."""


class InvalidRange(StoreError, ValueError):
    """A byte range lies outside the object or is empty/inverted."""


class InvalidKey(StoreError, ValueError):
    """A key is outside the namespace: absolute, contains '..', empty parts, or bad characters."""


class ConditionalWriteUnsupported(StoreError):
    """The store cannot do an atomic conditional write (``put_if_absent``/``cas``), so it cannot be
    published to (e.g. most fsspec filesystems); reading it is fine."""


class TransientStoreError(StoreError):
    """A failure worth retrying: throttling (503 SlowDown), dropped connection, timeout."""


class CacheFull(StoreError):
    """A cache's disk has no room for an object (ENOSPC, or less free space than its size)."""


class RunError(DeltaRLError, RuntimeError):
    """The run namespace is inconsistent: broken parent chain, second writer, missing keyframe."""


class WriterConflict(RunError):
    """Another publisher owns this run (or moved HEAD underneath us)."""


class ChainBroken(RunError):
    """A version's parent is not the version a reader holds: the run's history changed under it
    (re-created under the same name) or a manifest was altered."""


class RunReplaced(ChainBroken):
    """The run was re-created under the same name with another tensor table: the weights a reader
    holds can never follow it; it stops."""


class ShardedPublishError(RunError):
    """A sharded publish failed on some rank; no rank committed it and every base is unchanged."""


class UnsupportedPlacement(DeltaRLError, ValueError):
    """A DTensor placement the sharded publisher cannot encode (only row shards and replicas)."""


class RegionError(DeltaRLError, ValueError):
    """A part of a tensor that a delta cannot be staged into alone: a view whose shape or strides do
    not match its region, or a chunk that needs base elements outside the region."""


# --- transfer / actors ---------------------------------------------------------------------------


class TransferError(DeltaRLError, OSError):
    """Every source (relays, then the origin) failed to deliver an object."""


class NotPublished(ObjectNotFound):
    """A version an engine was asked to take is not committed yet (it waits for it in the background)."""


class NotStaged(StagingError):
    """A version is published but not staged yet: an engine stages it in the background and answers
    at once instead of holding generation for the fetch; ask again."""


class RangeNotSatisfiable(DeltaRLError, ValueError):
    """An HTTP ``Range`` header is malformed or lies outside the object: answer 416."""


# --- processes -----------------------------------------------------------------------------------


class ChildError(DeltaRLError, RuntimeError):
    """A child process exited or did not become ready."""


# --- coordinator ---------------------------------------------------------------------------------


class CoordinatorError(DeltaRLError, RuntimeError):
    """A coordinator request was refused or failed."""


class AuthError(CoordinatorError, PermissionError):
    """An unknown or missing token."""


class UnknownActor(CoordinatorError, LookupError):
    """A request named an actor id the coordinator never registered (register again)."""


class UnknownStep(CoordinatorError, LookupError):
    """A step that was never opened."""


class RecordConflict(CoordinatorError):
    """A write-once key already holds a different record (a second coordinator, or a forged retry)."""


class InvariantViolation(CoordinatorError):
    """The scheduler's books do not add up: a prompt lost, duplicated or admitted twice.

    Raised by the invariant check that recovery runs on the state it rebuilt from the store (a bug,
    or records that contradict each other), so it is never stripped by ``python -O``."""


class AdmissionReason(str, enum.Enum):
    """Why a result was not admitted (the coordinator's reason codes, on the wire as their values)."""

    UNKNOWN_LEASE = "unknown_lease"
    WRONG_ACTOR = "wrong_actor"
    WRONG_STEP = "wrong_step"
    LEASE_EXPIRED = "lease_expired"
    LEASE_REVOKED = "lease_revoked"
    VERSION_NOT_ACCEPTED = "version_not_accepted"
    PROMPT_MISMATCH = "prompt_mismatch"
    ALREADY_ADMITTED = "already_admitted"
    IN_PROGRESS = "in_progress"


class AdmissionRejected(CoordinatorError):
    """A result was not admitted; ``reason`` says why."""

    def __init__(self, reason: AdmissionReason, message: str | None = None) -> None:
        super().__init__(message or reason.value)
        self.reason = reason


class ConfigError(DeltaRLError, ValueError):
    """A configuration file or flag is invalid."""


class PublishFailed(RunError):
    """A background publish failed; raised by the publisher's next call (chained to the cause)."""


# --- integrations --------------------------------------------------------------------------------


class IntegrationError(DeltaRLError, RuntimeError):
    """A training framework's model cannot be exported as published weights (e.g. an adapter type
    whose merge deltarl does not know), or a background publish of a training step failed."""


# --- naming things in messages -------------------------------------------------------------------


def short_pair(a: str | None, b: str | None, width: int = 16) -> tuple[str, str]:
    """Two ids (hex digests) shortened for a message so that they visibly differ: the first
    ``width`` characters, or, where those are equal, up to four characters past the first one that
    differs. ``None`` stays ``"None"``.

    >>> short_pair("0123456789abcdef" + "0" * 48, "0123456789abcdef" + "1" * 48)
    ('0123456789abcdef0000…', '0123456789abcdef1111…')
    """
    if a is None or b is None:
        return (f"{a[:width]}…" if a else str(a)), (f"{b[:width]}…" if b else str(b))
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    n = max(width, first + 4)
    return (a[:n] + "…" if len(a) > n else a), (b[:n] + "…" if len(b) > n else b)
