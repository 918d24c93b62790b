"""The multi-stream fetcher: striping, long-poll, and failover when a relay dies, lies or cuts out."""

from __future__ import annotations

import asyncio
import itertools
import os

import pytest

from deltarl.actor.fetcher import Fetcher
from deltarl.errors import TransferError
from deltarl.pipeline.manifest import ObjectRef
from deltarl.storage import MemoryStore
from deltarl.testing.wan import EmulatedLink
from tests.fixtures.relays import StartRelay, until

RUN = "r"


def _put_segments(store: MemoryStore, sizes: list[int], version: int = 1) -> list[tuple[ObjectRef, bytes]]:
    out = []
    for i, size in enumerate(sizes):
        data = os.urandom(size)
        key = f"{RUN}/versions/{version:012d}/seg-{i:05d}.bin"
        store.put_if_absent(key, data)
        out.append((ObjectRef.of(key, data), data))
    return out


async def _fetch_all(fetcher: Fetcher, refs: list[ObjectRef], wait_s: float = 0.0) -> dict[str, bytes]:
    return {ref.key: data async for ref, data in fetcher.fetch_objects(refs, wait_s=wait_s)}


async def test_stripes_ranges_across_streams_and_verifies(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    objs = _put_segments(origin, [3 << 20, 100_000, 0, 1 << 20])
    relay = await start_relay(origin)
    async with Fetcher([relay.url, origin], streams=4, range_bytes=512 << 10) as fetcher:
        got = await _fetch_all(fetcher, [r for r, _ in objs])
    assert got == {r.key: d for r, d in objs}
    assert fetcher.stats.bytes_by_source == {relay.url: sum(len(d) for _, d in objs)}
    assert fetcher.stats.failovers == 0
    assert fetcher.stats.objects == 4


async def test_long_poll_gets_an_object_uploaded_later(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    relay = await start_relay(origin)
    data = os.urandom(300_000)
    ref = ObjectRef.of(f"{RUN}/versions/000000000002/seg-00000.bin", data)

    async def upload_later() -> None:
        await asyncio.sleep(0.3)
        await asyncio.to_thread(origin.put_if_absent, ref.key, data)

    task = asyncio.ensure_future(upload_later())
    async with Fetcher([relay.url, origin]) as fetcher:
        assert await fetcher.fetch(ref, wait_s=10) == data
    await task
    assert fetcher.stats.bytes_by_source == {relay.url: len(data)}


async def test_relay_killed_mid_transfer_fails_over_without_refetching(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    objs = _put_segments(origin, [1 << 20] * 4)
    relay1 = await start_relay(origin)
    relay2 = await start_relay(origin)
    async with EmulatedLink("127.0.0.1", relay1.port, rate_bps=16e6) as link:  # ~2 MB/s: 4 MB take ~2 s

        async def kill_soon() -> None:
            while link.stats.down < 1_500_000:
                await asyncio.sleep(0.02)
            link.kill()

        killer = asyncio.ensure_future(kill_soon())
        async with Fetcher([link.url, relay2.url, origin], streams=4, range_bytes=256 << 10, read_timeout_s=5) as fetcher:
            got = await _fetch_all(fetcher, [r for r, _ in objs])
        await killer
    assert got == {r.key: d for r, d in objs}
    by = fetcher.stats.bytes_by_source
    assert by[link.url] > 0
    assert by[relay2.url] > 0
    assert by[link.url] + by.get(relay2.url, 0) + by.get(origin.url, 0) == 4 << 20  # nothing fetched twice
    assert fetcher.stats.failovers >= 1


async def test_corrupt_byte_in_relay_cache_is_refetched_elsewhere(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    (ref, data), (ref2, data2) = _put_segments(origin, [600_000, 200_000])
    relay = await start_relay(origin)
    async with Fetcher([relay.url]) as warm:  # fill the relay's cache
        await _fetch_all(warm, [ref, ref2])
    for key in (ref.key, ref2.key):
        await until(lambda: relay.service.cache.get(key) is not None, f"{key} never reached the relay's cache")  # noqa: B023
        entry = relay.service.cache.get(key)
        assert entry is not None
        with open(entry.path, "r+b") as f:  # flip one byte on disk
            f.seek(1234)
            byte = f.read(1)
            f.seek(1234)
            f.write(bytes([byte[0] ^ 0xFF]))
    # ref is fetched in ranges (the relay cannot check a range; the fetcher's sha256 catches it),
    # ref2 whole (the relay checks while sending and cuts the response short).
    async with Fetcher([relay.url, origin], range_bytes=256 << 10) as fetcher:
        got = await _fetch_all(fetcher, [ref, ref2])
    assert got == {ref.key: data, ref2.key: data2}
    assert fetcher.stats.integrity_refetches >= 1
    assert fetcher.stats.bytes_by_source[origin.url] >= len(data)
    assert relay.counters()["deltarl_relay_integrity_failures_total"] >= 1


async def test_truncated_response_is_retried(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    (ref, data), = _put_segments(origin, [2 << 20])
    relay = await start_relay(origin)
    async with EmulatedLink("127.0.0.1", relay.port) as link:
        link.truncate_after = 300_000
        async with Fetcher([link.url, origin], range_bytes=1 << 20) as fetcher:
            assert await fetcher.fetch(ref) == data
    assert fetcher.stats.retries + fetcher.stats.failovers >= 1


async def test_every_source_failing_raises_transfer_error(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    (ref, _), = _put_segments(origin, [10_000])
    wrong = ObjectRef.of(ref.key, bytes(ref.size), piece_size=ref.piece_size)  # pieces no source's bytes match
    bad = ObjectRef(key=ref.key, root=wrong.root, size=ref.size, piece_size=wrong.piece_size, pieces=wrong.pieces)
    relay = await start_relay(origin)
    async with Fetcher([relay.url, origin]) as fetcher:
        with pytest.raises(TransferError):
            await fetcher.fetch(bad)
        with pytest.raises(FileNotFoundError):
            await fetcher.fetch(ObjectRef.of(f"{RUN}/versions/000000000009/e000001-seg-r000-00000.bin", b"x"))


def _views_of(buf: bytearray, cuts: list[int]) -> list[tuple[int, memoryview]]:
    """``buf`` as (offset, view) pairs cut at ``cuts``, as a keyframe part's header and tensors are."""
    bounds = [0, *cuts, len(buf)]
    return [(a, memoryview(buf)[a:b]) for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("range_bytes", [128 << 10, 100_000])  # whole pieces per range / ranges across pieces
async def test_fetch_into_checks_each_range_and_refetches_a_lying_source(range_bytes: int) -> None:
    data = os.urandom(1_000_003)
    key = f"{RUN}/keyframes/000000000000/e000001-part-r000-000.safetensors"
    ref = ObjectRef.of(key, data, piece_size=64 << 10)
    good, liar = MemoryStore(), MemoryStore()
    good.put(key, data)
    flipped = bytearray(data)
    flipped[700_000] ^= 0x10  # one byte in piece 10 of 16
    liar.put(key, bytes(flipped))
    dest = bytearray(len(data))
    async with Fetcher([liar, good], streams=3, range_bytes=range_bytes) as fetcher:
        await fetcher.fetch_into(ref, _views_of(dest, [40, 300_001, 300_002]))
    assert dest == data
    assert fetcher.stats.integrity_refetches == 1
    assert fetcher.stats.bytes_by_source[good.url] == len(data)


async def test_fetch_into_from_only_a_lying_source_fails_naming_the_object() -> None:
    data = os.urandom(300_000)
    key = f"{RUN}/keyframes/000000000000/e000001-part-r000-000.safetensors"
    ref = ObjectRef.of(key, data, piece_size=64 << 10)
    liar = MemoryStore()
    liar.put(key, data[:-1] + bytes([data[-1] ^ 1]))  # the last (short) piece differs
    dest = bytearray(len(data))
    async with Fetcher([liar], range_bytes=64 << 10) as fetcher:
        with pytest.raises(TransferError, match=key):
            await fetcher.fetch_into(ref, _views_of(dest, []))
    assert dest[-(300_000 % (64 << 10)) :] == bytes(300_000 % (64 << 10))  # the bad range never reached memory
