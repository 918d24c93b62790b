"""Random damage to a running relay's cache between random reads: files deleted, cut short or
overwritten, the whole cache folder removed. Whatever happens under it, the relay answers no 5xx,
never names its filesystem in a response, and never sends a whole object whose bytes differ from
the store; a vanished or short file is a cache miss (the exact bytes again), and a corrupted one
is caught on a whole read and fetched again on the next."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.storage import MemoryStore
from tests.fixtures.runs import manifest_naming
from tests.integration.fuzz.http import request

SEG = "r/versions/000000000001/e000001-seg-r000-00000.bin"
KEY = "r/versions/000000000001/e000001-seg-r000-00001.bin"
DATA = {SEG: os.urandom(300_000), KEY: os.urandom(70_000)}

DAMAGE = st.sampled_from(["delete", "truncate", "grow", "flip", "rmdir", "none"])
READS = st.tuples(st.sampled_from(sorted(DATA)), st.sampled_from(["", "?unverified=1"]),
                  st.one_of(st.none(), st.tuples(st.integers(0, 69_999), st.integers(0, 80_000))))


def _damage(cache_dir: Path, kind: str, which: int) -> bool:
    """Apply one kind of damage to one cached data file (or the folder); whether bytes were altered
    in place (a flip: the next whole read catches it, a range may not)."""
    files = sorted(cache_dir.glob("*.data")) if cache_dir.is_dir() else []
    if kind == "rmdir":
        shutil.rmtree(cache_dir, ignore_errors=True)
        return False
    if not files or kind == "none":
        return False
    path = files[which % len(files)]
    if kind == "delete":
        path.unlink()
    elif kind == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif kind == "grow":
        with open(path, "ab") as f:
            f.write(b"tail")
    elif kind == "flip":
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size // 3)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
        return True
    return False


def _read(port: int, key: str, query: str, rng: tuple[int, int] | None) -> tuple[int, bytes, dict[str, str]]:
    headers = {"Range": f"bytes={rng[0]}-{rng[1]}"} if rng is not None else {}
    status, resp_headers, body = request(port, "GET", f"/{key}{query}", headers)
    return status, body, resp_headers


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(DAMAGE, st.integers(0, 3), READS), min_size=1, max_size=6))
def test_a_damaged_cache_never_serves_wrong_bytes(background_relay: Callable[..., Any], tmp_path: Path,
                                                  steps: list[tuple[str, int, tuple[str, str, tuple[int, int] | None]]]) -> None:
    relay, cache_dir = _relay(background_relay)
    port = int(relay.url.rsplit(":", 1)[1])
    for key in DATA:  # every example starts from a filled cache (what the last one left may be caught first)
        _whole_read_is_exact_or_caught(port, key, "", "the last example")
    for kind, which, (key, query, rng) in steps:
        if _damage(cache_dir, kind, which):
            _FLIPPED.update(DATA)  # which key's file it was does not matter: both may now be bad in place
        status, body, headers = _read(port, key, query, rng)
        assert status < 500, (kind, key, status, body[:200])
        assert str(cache_dir).encode() not in body, body[:200]
        assert b".deltarl" not in body, body[:200]
        data = DATA[key]
        if rng is None:
            _check_whole(key, status, body, kind)
            again = _read(port, key, query, None)  # caught or not, the next whole read is exact
            assert again[:2] == (200, data), (kind, again[0])
            _FLIPPED.discard(key)
        elif status == 206 and key not in _FLIPPED:  # ranges are not checked on serve: the client checks pieces
            start = int(headers["content-range"].split()[1].split("-")[0])
            assert body == data[start : start + len(body)], f"a range of {key} with wrong bytes after {kind}"


def _check_whole(key: str, status: int, body: bytes, after: str) -> None:
    """A whole read is the exact object, or a response cut short (the relay caught a bad piece)
    whose bytes so far are right; never a complete body with wrong bytes."""
    data = DATA[key]
    if status == 200 and len(body) == len(data):
        assert body == data, f"a whole {key} with wrong bytes after {after}"
    else:
        assert data.startswith(body), f"a cut-short {key} whose prefix is wrong after {after}"


def _whole_read_is_exact_or_caught(port: int, key: str, query: str, after: str) -> None:
    status, body, _ = _read(port, key, query, None)
    _check_whole(key, status, body, after)
    if body != DATA[key]:
        assert _read(port, key, query, None)[:2] == (200, DATA[key]), f"{key} not exact on the read after it was caught"
    _FLIPPED.discard(key)


_RELAYS: dict[int, tuple[Any, Path]] = {}
#: keys whose cached file may hold a flipped byte: a whole read catches it, a range may serve it
_FLIPPED: set[str] = set()


def _relay(factory: Callable[..., Any]) -> tuple[Any, Path]:
    """One relay per test function (hypothesis reuses the function-scoped fixture across examples)."""
    key = id(factory)
    if key not in _RELAYS:
        _RELAYS.clear()
        _FLIPPED.clear()
        store = MemoryStore()
        for k, data in DATA.items():
            store.put(k, data)
        store.put(*manifest_naming(DATA, piece_size=64 << 10))
        relay = factory(store, piece_bytes=64 << 10)
        _RELAYS[key] = (relay, Path(relay.server.service.cache.directory))
    return _RELAYS[key]
