"""Random requests against a relay: never a 5xx, the relay stays up, and no response carries bytes
that differ from the store (whole objects and ranges alike)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.storage import MemoryStore
from tests.fixtures.runs import manifest_naming
from tests.integration.fuzz.http import PATHS, RANGES, TOKENS, request

SEG = "r/versions/000000000001/e000001-seg-r000-00000.bin"
LOOSE = "r/versions/000000000002/e000001-seg-r000-00000.bin"  # uploaded, no manifest names it yet
DATA = os.urandom(300_000)
OBJECTS = {SEG: DATA, LOOSE: os.urandom(5000), "r/HEAD": b'{"version":1}', "r/run.json": b"{}"}


def _origin() -> MemoryStore:
    store = MemoryStore()
    for key, data in OBJECTS.items():
        store.put(key, data)
    store.put(*manifest_naming({SEG: DATA}, piece_size=64 << 10))
    return store


KEY_PATHS = st.sampled_from([f"/{k}" for k in OBJECTS] + [f"/{SEG}?unverified=1", f"/{LOOSE}?unverified=1",
                                                           f"/{SEG}?wait=0.01", "/?prefix=r/", "/?prefix=.deltarl-tmp/"])
QUERIES = st.sampled_from(["", "?wait=0", "?wait=-1", "?wait=nan", "?wait=1e309", "?unverified=1", "?prefix=%ff", "?x=%zz"])


def _check_bytes(path: str, status: int, headers: dict[str, str], body: bytes) -> None:
    key = urlsplit(path).path.lstrip("/")
    data = OBJECTS.get(key)
    if data is None or status not in (200, 206) or not body:
        return
    if status == 200:
        assert data.startswith(body), f"{path}: 200 body differs from the store"
        return
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", headers.get("content-range", ""))
    assert m, headers
    start, end = int(m[1]), int(m[2]) + 1
    assert body == data[start:end][: len(body)], f"{path}: 206 body differs from the store"


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.sampled_from(["GET", "HEAD", "PUT", "DELETE", "POST", "OPTIONS"]),
    path=st.one_of(PATHS, KEY_PATHS, st.builds(lambda p, q: p + q, st.one_of(PATHS, KEY_PATHS), QUERIES)),
    rng=RANGES,
    token=TOKENS,
    body=st.binary(max_size=64),
    extra=st.dictionaries(st.sampled_from(["If-None-Match", "If-Match", "Accept-Encoding"]),
                          st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=20), max_size=2),
)
def test_relay_survives_random_requests(background_relay: Callable[..., Any], method: str, path: str, rng: str | None,
                                        token: str | None, body: bytes, extra: dict[str, str]) -> None:
    relay = _relay(background_relay)
    headers = dict(extra)
    if rng is not None:
        headers["Range"] = rng
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    status, resp_headers, payload = request(relay.port, method, path, headers, body if method in ("PUT", "POST") else b"")
    assert status < 500, (method, path, headers, status, payload[:200])
    if method == "GET":
        _check_bytes(path, status, resp_headers, payload)
    assert request(relay.port, "GET", "/healthz")[0] == 200


_RELAYS: dict[int, Any] = {}


class _Relay:
    def __init__(self, relay: Any) -> None:
        self.relay = relay
        self.port = int(urlsplit(relay.url).port or 0)


def _relay(factory: Callable[..., Any]) -> _Relay:
    """One relay per test function (hypothesis reuses the function-scoped fixture across examples)."""
    key = id(factory)
    if key not in _RELAYS:
        _RELAYS.clear()
        # pushes need a token the fuzzer cannot guess, so the store stays as generated
        _RELAYS[key] = _Relay(factory(_origin(), token="fuzz-" + os.urandom(8).hex(), allow_anonymous_push=False,
                                      piece_bytes=64 << 10))
    return _RELAYS[key]
