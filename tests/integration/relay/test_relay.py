"""The relay over HTTP: ranges, caching headers, namespace checks, long-poll, coalescing, cut-through,
integrity, pushes, metrics, restarts and chaining. Real relays on loopback, real stores."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import aiohttp
import pytest

from deltarl.errors import PreconditionFailed, StoreError, TransientStoreError
from deltarl.storage import LocalStore, MemoryStore
from deltarl.storage.aio import StoreSource
from deltarl.storage.http_client import RelayClient
from tests.fixtures.relays import RelayChain, StartRelay, until
from tests.fixtures.runs import manifest_naming

SEG = "r/versions/000000000001/e000001-seg-r000-00000.bin"
MANIFEST = "r/versions/000000000001/manifest.json"


async def test_get_range_head_and_cache_headers(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    data = os.urandom(100_000)
    origin.put(SEG, data)
    origin.put("r/HEAD", b"1")
    relay = await start_relay(origin)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{relay.url}/{SEG}?unverified=1") as resp:
            assert resp.status == 200
            assert await resp.read() == data
            assert "immutable" in resp.headers["Cache-Control"]
            assert resp.headers["ETag"] == f'"{origin.head(SEG).etag}"'
        async with s.get(f"{relay.url}/{SEG}?unverified=1", headers={"Range": "bytes=10-19"}) as resp:
            assert resp.status == 206
            assert resp.headers["Content-Range"] == f"bytes 10-19/{len(data)}"
            assert await resp.read() == data[10:20]
        async with s.get(f"{relay.url}/{SEG}?unverified=1", headers={"Range": "bytes=-5"}) as resp:
            assert (resp.status, await resp.read()) == (206, data[-5:])
        async with s.get(f"{relay.url}/{SEG}?unverified=1", headers={"Range": f"bytes={len(data)}-"}) as resp:
            assert resp.status == 416
            assert resp.headers["Content-Range"] == f"bytes */{len(data)}"
        async with s.head(f"{relay.url}/{SEG}?unverified=1") as resp:
            assert (resp.status, resp.headers["Content-Length"]) == (200, str(len(data)))
        async with s.get(f"{relay.url}/r/versions/000000000001/seg-00009.bin") as resp:
            assert resp.status == 404
        async with s.get(f"{relay.url}/r/HEAD") as resp:
            assert (resp.status, await resp.read()) == (200, b"1")
            assert resp.headers["Cache-Control"] == "no-cache"
        async with s.get(f"{relay.url}/metrics") as resp:
            text = await resp.text()
    assert "deltarl_relay_served_bytes_total" in text
    assert relay.counters()["deltarl_relay_cache_hits_total"] >= 2


async def _raw_status(port: int, target: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    status_line = await reader.readline()
    await reader.read()
    writer.close()
    await writer.wait_closed()
    return int(status_line.split()[1])


@pytest.mark.parametrize(
    "target",
    ["/r/../etc/passwd", "/../secret", "/r/%2e%2e/x", "/r%2F..%2Fx", "//etc/passwd", "/r/./x", "/r/a%5cb", "/r/a%00b"],
)
async def test_refuses_keys_outside_the_namespace(start_relay: StartRelay, target: str) -> None:
    relay = await start_relay(MemoryStore())
    assert await _raw_status(relay.port, target) == 400


async def test_long_poll_answers_when_the_object_lands(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    relay = await start_relay(origin)

    async def upload_later() -> None:
        await asyncio.sleep(0.3)
        await asyncio.to_thread(origin.put_if_absent, SEG, b"late")

    async with RelayClient(relay.url) as client:
        with pytest.raises(FileNotFoundError):
            await client.get(SEG, unverified=True)
        t0 = time.monotonic()
        with pytest.raises(FileNotFoundError):
            await client.get(SEG, unverified=True, wait=0.2)
        assert time.monotonic() - t0 >= 0.19
        task = asyncio.ensure_future(upload_later())
        t0 = time.monotonic()
        got = await asyncio.gather(*(client.get(SEG, unverified=True, wait=10) for _ in range(5)))
        elapsed = time.monotonic() - t0
        await task
    assert got == [b"late"] * 5
    assert elapsed < 2.0
    # the handler leaves the long-poll (the gauge's finally) around when it answers, maybe after the client has the body
    await until(lambda: relay.counters()["deltarl_relay_waiters"] == 0, "the relay still counts long-poll waiters")


async def test_push_wakes_long_polls_and_needs_the_token(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    relay = await start_relay(origin, token="tok", poll_interval_s=5.0)  # polling alone would be slow
    async with RelayClient(relay.url) as anon, RelayClient(relay.url, token="tok") as pusher:
        with pytest.raises(StoreError, match="401"):
            await anon.put(SEG, b"x")
        waiter = asyncio.ensure_future(anon.get(SEG, unverified=True, wait=10))
        await until(lambda: relay.counters()["deltarl_relay_waiters"] >= 1, "the GET never entered its long-poll")
        t0 = time.monotonic()
        etag = await pusher.put(SEG, b"pushed", if_none_match=True)
        assert await waiter == b"pushed"
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(PreconditionFailed):
            await pusher.put(SEG, b"other", if_none_match=True)
        assert etag == origin.head(SEG).etag
        head_etag = await pusher.put("r/HEAD", b"1", if_none_match=True)
        with pytest.raises(PreconditionFailed):
            await pusher.put("r/HEAD", b"2", if_match="0" * 32)
        await pusher.put("r/HEAD", b"2", if_match=head_etag)
    assert origin.get("r/HEAD") == b"2"


async def test_head_polls_are_coalesced_and_long_polled(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    origin.put("r/HEAD", b"1")
    relay = await start_relay(origin, head_ttl_s=0.5)
    async with RelayClient(relay.url, connections=50) as client:
        values = await asyncio.gather(*(client.get_mutable("r/HEAD") for _ in range(200)))
        assert {v for v in values if v is not None} == {(b"1", origin.head("r/HEAD").etag)}
        ups = relay.counters()["deltarl_relay_upstream_requests_total{op=get}"]
        assert ups <= 2
        etag = origin.head("r/HEAD").etag
        assert await client.get_mutable("r/HEAD", etag=etag, wait=0.3) is None  # unchanged: 304

        async def move_head() -> None:
            await asyncio.sleep(0.2)
            origin.cas("r/HEAD", b"2", etag)

        task = asyncio.ensure_future(move_head())
        got = await client.get_mutable("r/HEAD", etag=etag, wait=10)
        await task
    assert got is not None
    assert got[0] == b"2"


class SlowUpstream(StoreSource):
    """A store upstream whose ranged reads each take ``delay`` seconds (a slow WAN pull)."""

    def __init__(self, store: MemoryStore, delay: float) -> None:
        super().__init__(store, poll_interval_s=0.02)
        self.delay = delay

    async def get_range(self, key: str, start: int, end: int | None, *, wait: float = 0.0, unverified: bool = False) -> bytes:
        await asyncio.sleep(self.delay)
        return await super().get_range(key, start, end, wait=wait)


async def test_cut_through_serves_bytes_before_the_pull_completes(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    data = os.urandom(1 << 20)
    origin.put(SEG, data)
    relay = await start_relay(SlowUpstream(origin, 0.1), piece_bytes=64 << 10, pull_streams=1)  # 16 pieces: ~1.6 s

    async def read(first_byte_at: list[float]) -> bytes:
        async with aiohttp.ClientSession() as s, s.get(f"{relay.url}/{SEG}?unverified=1") as resp:
            chunks = []
            async for chunk in resp.content.iter_any():
                if not chunks:
                    first_byte_at.append(time.monotonic())
                chunks.append(chunk)
            return b"".join(chunks)

    t0 = time.monotonic()
    firsts: list[float] = []
    results = await asyncio.gather(*(read(firsts) for _ in range(5)))
    total = time.monotonic() - t0
    assert results == [data] * 5
    assert total > 1.4  # the upstream pull takes >= 1.6 s
    assert max(firsts) - t0 < min(1.0, total - 0.5)  # every reader had bytes long before the last piece landed
    c = relay.counters()
    assert c["deltarl_relay_upstream_pulls_total"] == 1  # five readers, one upstream pull
    assert c["deltarl_relay_upstream_bytes_total"] == len(data)


async def test_integrity_mismatch_is_never_served_and_refetched(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    good = os.urandom(300_000)
    bad = bytearray(good)
    bad[-1] ^= 1
    origin.put(SEG, bytes(bad))
    origin.put(*manifest_naming({SEG: good}))
    relay = await start_relay(origin)
    async with RelayClient(relay.url) as client:
        with pytest.raises(TransientStoreError):  # cut short (payload error) or 502: never the whole bad object
            await client.get(SEG, unverified=True)
        assert relay.counters()["deltarl_relay_integrity_failures_total"] == 1
        assert SEG not in relay.service.cache
        origin.put(SEG, good)  # the origin is repaired: the relay fetches again
        assert await client.get(SEG, unverified=True) == good
    # the pull commits the object to the cache once its last piece is checked, maybe after the client has its bytes
    await until(lambda: relay.service.cache.get(SEG) is not None, "the repaired object never reached the cache")
    entry = relay.service.cache.get(SEG)
    assert entry is not None
    assert entry.verified


async def test_cache_is_bounded_and_survives_restart(start_relay: StartRelay, tmp_path: Path) -> None:
    origin = LocalStore(str(tmp_path / "origin"))
    blobs = {f"r/versions/{v:012d}/e000001-seg-r000-00000.bin": os.urandom(400_000) for v in range(1, 5)}
    for key, blob in blobs.items():
        origin.put(key, blob)
    cache_dir = str(tmp_path / "cache")
    relay = await start_relay(origin, cache_dir=cache_dir, cache_bytes=1_000_000)
    async with RelayClient(relay.url) as client:
        for key, blob in blobs.items():
            assert await client.get(key, unverified=True) == blob
    # each pull commits (and evicts) after its client may have the bytes: wait for the last commit
    await until(lambda: list(blobs)[-1] in relay.service.cache and relay.counters()["deltarl_relay_evictions_total"] >= 2,
                 "the last object never reached the cache, evicting two")
    assert relay.counters()["deltarl_relay_evictions_total"] == 2
    assert relay.service.cache.bytes <= 1_000_000
    await relay.stop()
    for key in blobs:
        origin.delete(key)  # only the cache can answer now
    again = await start_relay(origin, cache_dir=cache_dir, cache_bytes=1_000_000)
    keys = list(blobs)
    async with RelayClient(again.url) as client:
        for key in keys[2:]:
            assert await client.get(key, unverified=True) == blobs[key]
        with pytest.raises(FileNotFoundError):
            await client.get(keys[0], unverified=True)
    assert again.counters()["deltarl_relay_upstream_pulls_total"] == 0


async def test_chained_relays_carry_one_copy_per_hop(relay_chain: RelayChain) -> None:
    data = os.urandom(700_000)
    relay_chain.origin.put(SEG, data)
    async with RelayClient(relay_chain.b.url, connections=8) as client:
        got = await asyncio.gather(*(client.get(SEG, unverified=True) for _ in range(8)))
    assert got == [data] * 8

    def served() -> tuple[float, float]:
        return relay_chain.a.counters()["deltarl_relay_served_bytes_total"], relay_chain.b.counters()["deltarl_relay_served_bytes_total"]

    # a handler counts a chunk after writing it, so maybe after the client (or the next hop) has it
    await until(lambda: served() == (len(data), 8 * len(data)), "served bytes never reached one copy at A, eight at B")
    a, b = relay_chain.a.counters(), relay_chain.b.counters()
    assert b["deltarl_relay_served_bytes_total"] == 8 * len(data)
    assert b["deltarl_relay_upstream_bytes_total"] == len(data)
    assert a["deltarl_relay_served_bytes_total"] == len(data)
    assert a["deltarl_relay_upstream_bytes_total"] == len(data)


async def test_long_poll_through_a_chain(relay_chain: RelayChain) -> None:
    data = os.urandom(500_000)

    async def upload_later() -> None:
        await asyncio.sleep(0.3)
        await asyncio.to_thread(relay_chain.origin.put_if_absent, SEG, data)

    async with RelayClient(relay_chain.b.url) as client:
        task = asyncio.ensure_future(upload_later())
        info, got = await asyncio.gather(client.head(SEG, wait=10), client.get(SEG, unverified=True, wait=10))
        await task
    assert (info.size, got) == (len(data), data)
    assert relay_chain.a.counters()["deltarl_relay_upstream_pulls_total"] == 1
    assert relay_chain.b.counters()["deltarl_relay_upstream_pulls_total"] == 1


async def test_a_long_poll_starts_the_pull_at_every_hop_without_a_plain_head(relay_chain: RelayChain) -> None:
    data = os.urandom(500_000)
    relay_chain.origin.put(SEG, data)  # already there: the long-poll is answered at once
    async with RelayClient(relay_chain.b.url) as client:
        info = await client.head(SEG, wait=10)
        assert info.size == len(data)
        await until(lambda: SEG in relay_chain.a.service.cache and SEG in relay_chain.b.service.cache,
                    "a long-poll HEAD did not prefetch the object along the chain")
        assert await client.get(SEG, unverified=True) == data
    a, b = relay_chain.a.counters(), relay_chain.b.counters()
    assert a["deltarl_relay_upstream_pulls_total"] == b["deltarl_relay_upstream_pulls_total"] == 1
    assert b.get("deltarl_relay_upstream_requests_total{op=head}", 0) == 0  # the long-poll itself asked A


async def test_a_client_leaving_a_long_poll_releases_it_along_the_chain(relay_chain: RelayChain) -> None:
    async with RelayClient(relay_chain.b.url) as client:
        task = asyncio.ensure_future(client.get(SEG, unverified=True, wait=30))
        # B asks A to wait too
        await until(lambda: relay_chain.a.counters()["deltarl_relay_waiters"] >= 1, "B never held a long-poll at A")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await until(lambda: not relay_chain.a.counters()["deltarl_relay_waiters"] and not relay_chain.b.counters()["deltarl_relay_waiters"],
                "long-poll still held upstream after the client left")
    assert not relay_chain.a.service.polls
    assert not relay_chain.b.service.polls


async def test_cached_ranges_are_served_and_a_short_file_is_caught(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    data = os.urandom(3_000_000)
    origin.put(SEG, data)
    relay = await start_relay(origin)
    url = f"{relay.url}/{SEG}?unverified=1"
    ranges = [(0, 999), (1_000_000, 2_999_999), (5, 2_999_999), (2_999_999, 2_999_999)]
    async with aiohttp.ClientSession() as s:
        async with s.get(url) as resp:  # a whole read: fills the cache
            assert await resp.read() == data
        served = relay.counters()["deltarl_relay_served_bytes_total"]
        for a, b in ranges:  # from the cached file, on one reused connection
            async with s.get(url, headers={"Range": f"bytes={a}-{b}"}) as resp:
                assert resp.status == 206
                assert await resp.read() == data[a : b + 1]
        want = served + sum(b + 1 - a for a, b in ranges)
        # the handler counts a chunk after writing it, so maybe after the client has it
        await until(lambda: relay.counters()["deltarl_relay_served_bytes_total"] >= want, "served bytes never reached the ranges' sum")
        assert relay.counters()["deltarl_relay_served_bytes_total"] == want
        entry = relay.service.cache.get(SEG)
        assert entry is not None
        os.truncate(entry.path, 2_000_000)  # the cached file lost its tail: a cache miss, fetched again
        async with s.get(url, headers={"Range": "bytes=1500000-2499999"}) as resp:
            assert resp.status == 206
            assert await resp.read() == data[1_500_000:2_500_000]
    deadline = time.monotonic() + 10  # the pull behind that range commits the whole object after the client has its bytes
    while (entry := relay.service.cache.get(SEG)) is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert entry is not None
    assert os.path.getsize(entry.path) == len(data)
