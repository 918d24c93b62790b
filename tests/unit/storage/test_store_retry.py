"""The retry policy: decided by exception type and structured S3 codes, capped jittered backoff."""

from __future__ import annotations

import http.client
import random

import pytest
import urllib3.exceptions
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
    SSLError,
)

from deltarl.errors import ConfigError, ObjectNotFound, TransientStoreError
from deltarl.storage.retry import RetryPolicy, is_transient

URL = "http://127.0.0.1:9/bucket/key"


def client_error(code: str, status: int, message: str = "") -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )


@pytest.mark.parametrize(
    "err",
    [
        client_error("SlowDown", 503),
        client_error("ServiceUnavailable", 503),
        client_error("InternalError", 500),
        client_error("RequestTimeout", 400),
        client_error("ConditionalRequestConflict", 409),
        client_error("TooManyRequestsException", 429),
        client_error("", 502),  # no code, but a gateway error status
        client_error("503", 503),  # HEAD responses carry the status as the code
        EndpointConnectionError(endpoint_url=URL),
        ConnectionClosedError(endpoint_url=URL),
        ConnectTimeoutError(endpoint_url=URL),
        ReadTimeoutError(endpoint_url=URL),
        ResponseStreamingError(error=urllib3.exceptions.ProtocolError("reset")),
        urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError(104, "reset")),
        urllib3.exceptions.ReadTimeoutError(None, URL, "read timed out"),  # type: ignore[arg-type]
        http.client.IncompleteRead(b"partial", 10),
        ConnectionResetError(104, "Connection reset by peer"),
        ConnectionRefusedError(111, "refused"),
        TimeoutError("timed out"),
        TransientStoreError("retry me"),
    ],
    ids=lambda e: (
        type(e).__name__ + ("-" + e.response["Error"]["Code"] if isinstance(e, ClientError) else "")
    ),
)
def test_transient(err: BaseException) -> None:
    assert is_transient(err)


@pytest.mark.parametrize(
    "err",
    [
        client_error("NoSuchKey", 404),
        client_error("AccessDenied", 403),
        client_error("PreconditionFailed", 412),
        client_error("InvalidRange", 416),
        client_error("AccessDenied", 403, message="SlowDown 503 please retry"),  # text is ignored
        SSLError(endpoint_url=URL, error=OSError("certificate verify failed")),
        NoCredentialsError(),
        ObjectNotFound("k"),
        ValueError("bad"),
        KeyError("k"),
    ],
    ids=lambda e: (
        type(e).__name__ + ("-" + e.response["Error"]["Code"] if isinstance(e, ClientError) else "")
    ),
)
def test_permanent(err: BaseException) -> None:
    assert not is_transient(err)


def policy(**kw: float) -> tuple[RetryPolicy, list[float]]:
    sleeps: list[float] = []
    return RetryPolicy(rng=random.Random(0), sleep=sleeps.append, **kw), sleeps  # type: ignore[arg-type]


def flaky(failures: list[BaseException]) -> tuple[list[int], object]:
    calls = [0]

    def fn() -> str:
        calls[0] += 1
        if failures:
            raise failures.pop(0)
        return "ok"

    return calls, fn


def test_retries_transient_then_succeeds() -> None:
    p, sleeps = policy(attempts=5, base_delay=0.1, max_delay=0.3)
    calls, fn = flaky([client_error("SlowDown", 503), EndpointConnectionError(endpoint_url=URL)] * 2)
    assert p.call(fn) == "ok"  # type: ignore[arg-type]
    assert calls[0] == 5
    caps = [0.1, 0.2, 0.3, 0.3]  # exponential, then capped
    assert len(sleeps) == 4
    for slept, cap in zip(sleeps, caps, strict=True):
        assert cap / 2 <= slept <= cap


def test_gives_up_after_attempts_with_last_error() -> None:
    p, sleeps = policy(attempts=3)
    errors: list[BaseException] = [ConnectionResetError(104, f"reset {i}") for i in range(5)]
    calls, fn = flaky(errors)
    with pytest.raises(ConnectionResetError, match="reset 2"):
        p.call(fn)  # type: ignore[arg-type]
    assert calls[0] == 3
    assert len(sleeps) == 2


def test_permanent_error_is_not_retried() -> None:
    p, sleeps = policy()
    calls, fn = flaky([client_error("AccessDenied", 403)])
    with pytest.raises(ClientError):
        p.call(fn)  # type: ignore[arg-type]
    assert calls[0] == 1
    assert sleeps == []


def test_jitter_spreads_delays() -> None:
    p, _ = policy(base_delay=1.0, max_delay=1.0)
    delays = {round(p.delay(3), 6) for _ in range(50)}
    assert len(delays) > 40
    assert all(0.5 <= d <= 1.0 for d in delays)
    assert p.delay(10_000) <= p.max_delay  # no overflow for absurd retry counts


@pytest.mark.parametrize(
    "kw", [{"attempts": 0}, {"base_delay": -1}, {"base_delay": 2, "max_delay": 1}, {"multiplier": 0.5}]
)
def test_bad_policy(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        RetryPolicy(**kw)  # type: ignore[arg-type]
