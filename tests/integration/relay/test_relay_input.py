"""Hostile and careless input to a relay, and a cache disk too small for an object: short 4xx,
whole objects, never a 5xx or a cut body."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from deltarl.storage import LocalStore, MemoryStore
from tests.fixtures.relays import StartRelay
from tests.fixtures.runs import manifest_naming

SEG = "r/versions/000000000001/e000001-seg-r000-00000.bin"
MANIFEST = "r/versions/000000000001/manifest.json"


async def _raw_get(url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """GET a raw (unnormalised) path: aiohttp's client would re-encode it."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}\r\n".encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_bad_paths_are_short_4xx(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    origin.put(SEG, b"x" * 10)
    relay = await start_relay(origin)
    deep = "/" + "/".join(["a"] * 3000)
    for path, want in (("/%ff%fe", 400), ("/r/%c3%28", 400), (deep, 400), ("/" + "k" * 5000, 400)):
        status, body = await _raw_get(relay.url, path)
        assert status == want, path
        assert len(body) < 600, path  # no echo of an 18 KB path


async def test_internal_keys_are_never_listed_or_served(tmp_path: Path, start_relay: StartRelay) -> None:
    store = LocalStore(str(tmp_path / "store"))
    store.put(SEG, b"x" * 10)
    lock_dir = tmp_path / "store" / ".deltarl-tmp" / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    (lock_dir / "12.lock").write_bytes(b"")
    assert list(store.list(".deltarl-tmp/")) == []
    relay = await start_relay(store)
    async with aiohttp.ClientSession() as s:
        for prefix in ("", ".deltarl-tmp/", ".deltarl-tmp", ".del"):
            async with s.get(relay.url + "/", params={"prefix": prefix}) as r:
                assert r.status == 200
                keys = (await r.json())["keys"]
                assert not any(k.startswith(".deltarl-tmp") for k in keys), (prefix, keys)
        for path in ("/.deltarl-tmp/locks/12.lock", "/.deltarl-tmp"):
            async with s.get(relay.url + path) as r:
                assert r.status == 404, path
            async with s.head(relay.url + path) as r:
                assert r.status == 404, path


async def test_unsupported_ranges_get_the_whole_object(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    data = os.urandom(5000)
    origin.put(SEG, data)
    relay = await start_relay(origin)
    async with aiohttp.ClientSession() as s:
        for rng in ("bytes=0-5,10-20", "items=0-5", "bytes=x-y", "bytes=0-" + "9" * 5000):
            async with s.get(f"{relay.url}/{SEG}?unverified=1", headers={"Range": rng}) as r:
                body = await r.read()
                if rng.startswith("bytes=0-9"):
                    assert (r.status, body) == (206, data), rng  # huge end: clamped to the object
                else:
                    assert (r.status, body) == (200, data), rng
        async with s.get(f"{relay.url}/{SEG}?unverified=1", headers={"Range": "bytes=" + "9" * 5000 + "-"}) as r:
            assert r.status == 416


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs for the relay's cache (skipped where mounting is not permitted)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True,
                       capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"cannot mount a small tmpfs here: {err}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=10)


async def test_object_larger_than_the_cache_disk_passes_through_in_full(start_relay: StartRelay, tiny_disk: Path) -> None:
    origin = MemoryStore()
    data = os.urandom(3_000_000)
    origin.put(SEG, data)
    origin.put(*manifest_naming({SEG: data}))
    relay = await start_relay(origin, cache_dir=str(tiny_disk / "cache"), cache_bytes=1 << 30)
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.get(f"{relay.url}/{SEG}") as r:
                assert r.status == 200
                assert await r.read() == data
        async with s.get(f"{relay.url}/{SEG}", headers={"Range": "bytes=2500000-2500009"}) as r:
            assert (r.status, await r.read()) == (206, data[2_500_000:2_500_010])
        async with s.get(f"{relay.url}/metrics") as r:
            text = await r.text()
    assert "deltarl_relay_passthrough_total 3.0" in text
