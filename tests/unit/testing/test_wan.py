"""The emulated WAN link: delay, window-bound single streams, shared rate, faults."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from deltarl.testing.wan import EmulatedLink

PAYLOAD = 1 << 20


@pytest.fixture
async def source() -> AsyncIterator[int]:
    """A TCP server that answers any line with PAYLOAD bytes (or echoes 'ping')."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                writer.write(b"pong\n" if line == b"ping\n" else b"x" * PAYLOAD)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def _download(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"get\n")
        await writer.drain()
        data = await reader.readexactly(PAYLOAD)
        return len(data)
    finally:
        writer.close()
        await writer.wait_closed()


async def test_delay_is_one_rtt(source: int) -> None:
    async with EmulatedLink("127.0.0.1", source, rtt_s=0.1) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        t0 = time.monotonic()
        writer.write(b"ping\n")
        assert await reader.readline() == b"pong\n"
        elapsed = time.monotonic() - t0
        writer.close()
        await writer.wait_closed()
    assert 0.09 <= elapsed < 0.5


async def test_window_bounds_one_stream_and_streams_share_the_rate(source: int) -> None:
    rate = 40e6  # 5 MB/s shared; one stream: 64 KiB per 40 ms = 1.6 MB/s (~33%)
    async with EmulatedLink("127.0.0.1", source, rate_bps=rate, rtt_s=0.04, window_bytes=64 << 10) as link:
        t0 = time.monotonic()
        await _download(link.port)
        one = PAYLOAD * 8 / (time.monotonic() - t0)
        t0 = time.monotonic()
        await asyncio.gather(*(_download(link.port) for _ in range(6)))
        many = 6 * PAYLOAD * 8 / (time.monotonic() - t0)
        assert link.stats.down >= 7 * PAYLOAD
    assert one <= 0.45 * rate, one
    assert many >= 0.6 * rate, many  # ~0.95 measured; slack for a loaded CI box
    assert many <= 1.1 * rate, many


async def test_kill_drops_connections_and_refuses_new_ones(source: int) -> None:
    async with EmulatedLink("127.0.0.1", source, rate_bps=8e6) as link:
        task = asyncio.ensure_future(_download(link.port))
        await asyncio.sleep(0.2)
        link.kill()
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await task
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await _download(link.port)
        link.revive()
        assert await _download(link.port) == PAYLOAD


async def test_truncate_after_cuts_one_connection(source: int) -> None:
    async with EmulatedLink("127.0.0.1", source) as link:
        link.truncate_after = 100_000
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(b"get\n")
        with pytest.raises(asyncio.IncompleteReadError) as info:
            await reader.readexactly(PAYLOAD)
        assert len(info.value.partial) == 100_000
        writer.close()
        assert await _download(link.port) == PAYLOAD  # one-shot


async def test_stall_pauses_forwarding(source: int) -> None:
    async with EmulatedLink("127.0.0.1", source) as link:
        link.stall(0.3)
        t0 = time.monotonic()
        assert await _download(link.port) == PAYLOAD
        assert time.monotonic() - t0 >= 0.25
