"""A relay under operator mistakes and bad upstreams: its cache folder or files removed under it, an
upstream whose bytes fail their manifest, a full cache disk, and what its 404s and unverified reads
give away."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from deltarl.errors import IntegrityError
from deltarl.storage import LocalStore, MemoryStore
from deltarl.storage.open import open_store
from tests.fixtures.relays import StartRelay, until
from tests.fixtures.runs import manifest_naming

SEG = "r/versions/000000000001/e000001-seg-r000-00000.bin"
OTHER = "r/versions/000000000001/e000001-seg-r000-00001.bin"
MANIFEST = "r/versions/000000000001/manifest.json"
PIECE = 256 << 10


def _origin(*keys: str, size: int = 3 * PIECE + 1000) -> tuple[MemoryStore, dict[str, bytes]]:
    origin = MemoryStore()
    data = {key: os.urandom(size) for key in keys}
    for key, value in data.items():
        origin.put(key, value)
    origin.put(MANIFEST, manifest_naming(data, piece_size=PIECE)[1])
    return origin, data


async def _partial(url: str, **params: str) -> tuple[int, bytes, bool]:
    """Status, every body byte that arrived, and whether the body was complete."""
    got = bytearray()
    async with aiohttp.ClientSession() as s, s.get(url, params=params) as r:
        try:
            async for chunk in r.content.iter_chunked(1 << 14):
                got += chunk
            return r.status, bytes(got), r.content_length is None or len(got) == r.content_length
        except aiohttp.ClientPayloadError:
            return r.status, bytes(got), False


async def _get(url: str, **params: str) -> tuple[int, bytes, dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.get(url, params=params) as r:
        try:
            body = await r.read()
        except aiohttp.ClientPayloadError:
            body = b"<cut>"
        return r.status, body, dict(r.headers)


async def test_a_removed_cache_folder_or_file_is_a_cache_miss(start_relay: StartRelay, tmp_path: Path) -> None:
    origin, data = _origin(SEG, OTHER)
    relay = await start_relay(origin, piece_bytes=PIECE, cache_dir=str(tmp_path / "cache"))
    assert (await _get(f"{relay.url}/{SEG}"))[:2] == (200, data[SEG])
    await until(lambda: relay.service.cache.get(SEG) is not None, "the first pull never reached the cache")
    entry = relay.service.cache.get(SEG)
    assert entry is not None
    os.unlink(entry.path)  # one data file gone
    assert (await _get(f"{relay.url}/{SEG}"))[:2] == (200, data[SEG])
    await until(lambda: (e := relay.service.cache.get(SEG)) is not None and os.path.exists(e.path),
                "the second pull never reached the cache")
    entry = relay.service.cache.get(SEG)
    assert entry is not None
    with open(entry.path, "r+b") as f:  # cut short
        f.truncate(100)
    assert (await _get(f"{relay.url}/{SEG}"))[:2] == (200, data[SEG])
    shutil.rmtree(tmp_path / "cache")  # the whole folder gone
    assert (await _get(f"{relay.url}/{SEG}"))[:2] == (200, data[SEG])  # a cached key: pulled again
    assert (await _get(f"{relay.url}/{OTHER}"))[:2] == (200, data[OTHER])  # a new key: cached afresh
    await until(lambda: relay.service.cache.get(OTHER) is not None, "the new key was never cached")


class _GatedOrigin(MemoryStore):
    """Ranged reads wait for ``gate`` (so a pull stays in flight as long as the test wants)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        self.gate.wait(30)
        return super().get_range(key, start, end)


async def test_a_cache_folder_removed_under_a_pull_in_flight_is_served_uncached(start_relay: StartRelay, tmp_path: Path) -> None:
    origin = _GatedOrigin()
    data = os.urandom(3 * PIECE + 1000)
    origin.put(SEG, data)
    origin.put(MANIFEST, manifest_naming({SEG: data}, piece_size=PIECE)[1])
    relay = await start_relay(origin, piece_bytes=PIECE, cache_dir=str(tmp_path / "cache"))
    first = asyncio.ensure_future(_get(f"{relay.url}/{SEG}"))
    deadline = time.monotonic() + 10
    while SEG not in relay.service._pulls and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert SEG in relay.service._pulls, "the first read never started a pull"
    shutil.rmtree(tmp_path / "cache")  # the pull's temporary file goes with it
    second = asyncio.ensure_future(_get(f"{relay.url}/{SEG}"))
    await asyncio.sleep(0.2)
    origin.gate.set()
    assert (await second)[:2] == (200, data)  # before: 500, FileNotFoundError opening the pull's file
    status, body, _ = await first
    assert status == 200
    assert data.startswith(body.replace(b"<cut>", b""))
    assert (await _get(f"{relay.url}/{SEG}"))[:2] == (200, data)


async def test_bad_upstream_bytes_are_answered_as_integrity_failures(start_relay: StartRelay) -> None:
    """After a pull finds the upstream's bytes do not match the manifest, the relay answers 502 with
    ``X-Deltarl-Error: integrity`` at once (no new pull), and a client raises IntegrityError instead
    of retrying; ``?unverified=1`` gets the same for a committed object."""
    origin, data = _origin(SEG)
    bad = bytearray(data[SEG])
    bad[PIECE + 5] ^= 0x01
    origin.put(SEG, bytes(bad))
    relay = await start_relay(origin, piece_bytes=PIECE, pull_streams=1)
    _, body, _ = await _get(f"{relay.url}/{SEG}")
    assert body != data[SEG]  # cut short (or refused): never the wrong object
    assert body != bytes(bad)
    status, body, headers = await _get(f"{relay.url}/{SEG}")
    assert status == 502
    assert headers.get("X-Deltarl-Error") == "integrity"
    status, _, headers = await _get(f"{relay.url}/{SEG}", unverified="1")
    assert (status, headers.get("X-Deltarl-Error")) == (502, "integrity")
    store = open_store(relay.url)
    t0 = time.monotonic()
    with pytest.raises(IntegrityError, match="do not match their manifest"):
        await __import__("asyncio").to_thread(store.get, SEG)
    assert time.monotonic() - t0 < 2.0  # refused at once, not after the client's retries


async def test_unverified_reads_of_committed_objects_are_checked(start_relay: StartRelay) -> None:
    """``?unverified=1`` is for objects no manifest names yet; once one does, the relay checks the
    bytes it sends against it: a client asking unverified gets none of a corrupt piece."""
    origin, data = _origin(SEG)
    bad = bytearray(data[SEG])
    bad[PIECE + 5] ^= 0x01
    origin.put(SEG, bytes(bad))
    relay = await start_relay(origin, piece_bytes=PIECE, pull_streams=1)
    _, body, complete = await _partial(f"{relay.url}/{SEG}", unverified="1")
    assert not complete
    assert len(body) <= PIECE  # nothing of the corrupt piece went out
    assert body == data[SEG][: len(body)]


async def test_a_404_does_not_reveal_the_upstream(start_relay: StartRelay, tmp_path: Path) -> None:
    root = tmp_path / "secret-location"
    store = LocalStore(str(root))
    store.put("r/run.json", b"{}")
    relay = await start_relay(str(root))
    status, body, _ = await _get(f"{relay.url}/r/nothing-here")
    assert status == 404
    assert str(root).encode() not in body
    assert b"secret-location" not in body


def _tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode == 0


async def test_a_cache_disk_that_fills_mid_pull_leaves_no_unaccounted_files(start_relay: StartRelay, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Two 2 MiB objects pulled at once into a 4 MiB disk: each has room when its pull starts, and
    their bytes fill the disk, leaving no room for their metadata. Both clients get every byte; the
    cache folder holds nothing its accounting does not know of; no task error is left unretrieved."""
    import asyncio

    cache = tmp_path / "small"
    if not _tmpfs(cache, "4m"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        origin, data = _origin(SEG, OTHER, size=2 << 20)  # together exactly the disk: no room left for metadata
        relay = await start_relay(origin, piece_bytes=PIECE, pull_streams=1, cache_dir=str(cache))
        with caplog.at_level("ERROR", logger="asyncio"):
            got = await asyncio.gather(_get(f"{relay.url}/{SEG}"), _get(f"{relay.url}/{OTHER}"))
            assert [g[:2] for g in got] == [(200, data[SEG]), (200, data[OTHER])]
            for key in (SEG, OTHER):  # and again, from the cache or upstream
                assert (await _get(f"{relay.url}/{key}"))[:2] == (200, data[key])
            import gc

            gc.collect()
        assert "never retrieved" not in caplog.text
        files = [p for p in cache.iterdir() if p.is_file()]
        assert sum(p.stat().st_size for p in files if p.suffix == ".data") == relay.service.cache.bytes
        assert not [p for p in files if p.suffix == ".data" and not p.with_suffix(".json").exists()]
        assert not [p for p in files if p.name.startswith(".tmp-")]
    finally:
        subprocess.run(["umount", "-l", str(cache)], capture_output=True)


async def test_malformed_requests_are_one_line_not_error_tracebacks(start_relay: StartRelay,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    import asyncio
    import logging

    relay = await start_relay(MemoryStore())
    with caplog.at_level(logging.DEBUG):
        for raw in (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: a\r\n\r\n",
                    b"GET /r/HEAD HTTP/1.1\r\nHost: a\r\nIf-None-Match: \x01\r\n\r\n", b"GARBAGE\r\n\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            writer.write(raw)
            await writer.drain()
            assert (await asyncio.wait_for(reader.read(100), 5)).startswith(b"HTTP/1.0 400")
            writer.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in caplog.records if r.exc_info and r.levelno >= logging.INFO]
