"""How the S3 backend reads botocore's errors: structured error codes, and their translation into
deltarl's hierarchy (:mod:`deltarl.errors`) once :class:`~deltarl.storage.retry.RetryPolicy` has
given up. Decided by type and structured code, never by message text.
"""

from __future__ import annotations

import botocore.exceptions

from deltarl.errors import InvalidRange, ObjectNotFound, StoreError, TransientStoreError
from deltarl.storage.retry import is_transient

NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
PRECONDITION_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})
RANGE_CODES = frozenset({"InvalidRange", "416"})


def code_of(err: botocore.exceptions.ClientError) -> str:
    """The S3 error code of a ``ClientError`` (``""`` if it has none)."""
    return str(err.response.get("Error", {}).get("Code", ""))


def is_code(err: StoreError, *codes: str) -> bool:
    """Whether ``err`` was translated from a ``ClientError`` with one of ``codes``."""
    cause = err.__cause__
    return isinstance(cause, botocore.exceptions.ClientError) and code_of(cause) in codes


def is_precondition(err: StoreError) -> bool:
    """Whether ``err`` is a failed ``If-None-Match``/``If-Match`` condition (412, or a lasting 409)."""
    return is_code(err, *PRECONDITION_CODES)


def translate(err: Exception, where: str, bucket: str) -> StoreError:
    """Map a boto/urllib3 error to our hierarchy (called once retries are exhausted)."""
    if isinstance(err, botocore.exceptions.ClientError):
        code = code_of(err)
        if code in NOT_FOUND_CODES:
            return ObjectNotFound(f"{where}: no such object")
        if code == "NoSuchBucket":
            return StoreError(f"{where}: bucket {bucket!r} does not exist")
        if code in RANGE_CODES:
            return InvalidRange(f"{where}: range not satisfiable")
        if is_transient(err):
            return TransientStoreError(f"{where}: gave up after retries ({code})")
        return StoreError(f"{where}: {code or 'error'}: {err}")
    if isinstance(err, botocore.exceptions.NoCredentialsError):
        return StoreError(f"{where}: no AWS credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)")
    if is_transient(err):
        return TransientStoreError(f"{where}: gave up after retries ({type(err).__name__}: {err})")
    return StoreError(f"{where}: {type(err).__name__}: {err}")
