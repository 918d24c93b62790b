"""The one retry policy of the storage layer: capped, jittered exponential backoff, by error type.

:func:`is_transient` decides from the exception's *type* (and, for an S3 ``ClientError``, its
structured error code and HTTP status), never from message text:

* throttling and server faults: S3 codes ``SlowDown``, ``Throttling``, ``RequestTimeout``,
  ``InternalError``, ``ServiceUnavailable``, …, or HTTP 429/500/502/503/504;
* ``ConditionalRequestConflict`` (S3's 409 for two conditional writes racing on one key: the
  loser must retry to learn the outcome);
* dropped or stalled connections: botocore's ``ConnectionError`` family (``EndpointConnectionError``,
  ``ConnectTimeoutError``; not ``SSLError``), its ``HTTPClientError`` family
  (``ConnectionClosedError``, ``ReadTimeoutError``, ``ResponseStreamingError``),
  ``IncompleteReadError``, urllib3's ``ProtocolError``/``TimeoutError``/``IncompleteRead``, and
  the builtin ``ConnectionError``/``TimeoutError``/``http.client.IncompleteRead``;
* our own :class:`~deltarl.errors.TransientStoreError`.

boto3's own retries are switched off (``total_max_attempts=1``) by the S3 backend, so this is the
only policy in force. Retrying a *conditional* write after a dropped connection is ambiguous (the
first attempt may have landed); the S3 backend resolves that itself, see ``deltarl.storage.s3``.
"""

from __future__ import annotations

import http.client
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import botocore.exceptions as be
import urllib3.exceptions as u3

from deltarl.errors import ConfigError, TransientStoreError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: S3 error codes that mean "try again later" (structured codes, not message text).
TRANSIENT_S3_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "ServiceUnavailableException",
        "ConditionalRequestConflict",
        "500",
        "502",
        "503",
        "504",
    }
)

#: HTTP statuses worth retrying whatever the code says.
TRANSIENT_HTTP_STATUSES = frozenset({429, 500, 502, 503, 504})


_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    TransientStoreError,
    ConnectionError,  # builtin: reset, refused, aborted, broken pipe
    TimeoutError,
    http.client.IncompleteRead,
    u3.ProtocolError,
    u3.TimeoutError,
    u3.IncompleteRead,
    be.ConnectionError,
    be.HTTPClientError,
    be.IncompleteReadError,
)
_PERMANENT_TYPES: tuple[type[BaseException], ...] = (be.SSLError,)  # a bad certificate stays bad


def describe(err: BaseException) -> str:
    """A short label for logs: the exception type, plus the S3 error code if there is one."""
    response = getattr(err, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return f"{type(err).__name__} {code}" if code else type(err).__name__


def is_transient(err: BaseException) -> bool:
    """Whether ``err`` is worth retrying (decided by type and structured S3 error code)."""
    if isinstance(err, _PERMANENT_TYPES):
        return False
    if isinstance(err, _TRANSIENT_TYPES):
        return True
    response = getattr(err, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in TRANSIENT_S3_CODES or status in TRANSIENT_HTTP_STATUSES
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff with "equal jitter": try ``k`` (from 0) sleeps a random time in
    ``[c/2, c]`` where ``c = min(max_delay, base_delay * multiplier**k)``.

    The defaults (8 attempts, 0.1 s doubling to a 5 s cap) ride out ~15 s of throttling or a
    restarting endpoint, then give up.
    """

    attempts: int = 8
    base_delay: float = 0.1
    max_delay: float = 5.0
    multiplier: float = 2.0
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"retry attempts must be >= 1, got {self.attempts}")
        if not 0 <= self.base_delay <= self.max_delay:
            raise ConfigError(f"need 0 <= base_delay <= max_delay, got {self.base_delay}, {self.max_delay}")
        if self.multiplier < 1:
            raise ConfigError(f"retry multiplier must be >= 1, got {self.multiplier}")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0 = the first retry)."""
        cap = min(self.max_delay, self.base_delay * self.multiplier ** min(retry, 64))
        return cap / 2 + self.rng.uniform(0, cap / 2)

    def call(self, fn: Callable[[], T], what: str = "store operation") -> T:
        """Run ``fn``, retrying transient failures; the last failure (or a permanent one) escapes as is."""
        for attempt in range(self.attempts):
            try:
                return fn()
            except Exception as err:
                if not is_transient(err) or attempt == self.attempts - 1:
                    raise
                wait = self.delay(attempt)
                log.warning(
                    "%s failed (%s), retry %d/%d in %.2fs",
                    what,
                    describe(err),
                    attempt + 1,
                    self.attempts - 1,
                    wait,
                )
                self.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover


NO_RETRY = RetryPolicy(attempts=1)

#: Polling for an object that is not there yet, where the server answered "not found" sooner than
#: the wait asked for (nginx, plain S3): sleep 50 ms doubling to about 1 s (equal jitter) between
#: polls, so an idle reader asks about once a second per key and still sees a new object within
#: about a second. Used by actors, followers and relays alike.
POLL_BACKOFF = RetryPolicy(attempts=1, base_delay=0.05, max_delay=1.0)
