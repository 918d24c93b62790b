"""Verified cut-through: a relay sends no byte of a segment it has not checked against its
manifest's piece hashes, even when its upstream flips bytes; an object no committed manifest names
is held (plain GET) or served unchecked on request (``?unverified=1``)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp

from deltarl.storage import MemoryStore
from tests.fixtures.relays import StartRelay, until
from tests.fixtures.runs import manifest_naming

SEG = "r/versions/000000000001/e000001-seg-r000-00000.bin"
MANIFEST = "r/versions/000000000001/manifest.json"
PIECE = 256 << 10


def _manifest(key: str, data: bytes) -> bytes:
    return manifest_naming({key: data}, piece_size=PIECE)[1]


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, bool]:
    """Status, the body bytes that arrived, and whether the body was complete."""
    got = bytearray()
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers or {}) as r:
        try:
            async for chunk in r.content.iter_chunked(1 << 16):
                got += chunk
            complete = r.content_length is None or len(got) == r.content_length
        except aiohttp.ClientPayloadError:
            complete = False
        return r.status, bytes(got), complete


async def test_a_flipping_upstream_never_reaches_a_client(start_relay: StartRelay, tmp_path: Path) -> None:
    origin = MemoryStore()
    data = os.urandom(3 * PIECE + 1000)
    origin.put(SEG, data)
    origin.put(MANIFEST, _manifest(SEG, data))
    a = await start_relay(origin, piece_bytes=PIECE)
    assert (await _get(f"{a.url}/{SEG}"))[1] == data  # cached at A, checked
    await until(lambda: a.service.cache.get(SEG) is not None, "the object never reached A's cache")
    entry = a.service.cache.get(SEG)
    assert entry is not None
    bad_at = 2 * PIECE + 17
    with open(entry.path, "r+b") as f:  # A's disk flips a byte (same length) after the check
        f.seek(bad_at)
        f.write(bytes([data[bad_at] ^ 0x40]))
    b = await start_relay(a.url, piece_bytes=PIECE, pull_streams=1)
    status, body, complete = await _get(f"{b.url}/{SEG}")
    assert status == 200
    assert not complete
    assert body == data[: len(body)]  # every byte that went out is the origin's
    assert len(body) <= bad_at
    status, body, complete = await _get(f"{b.url}/{SEG}", {"Range": f"bytes={bad_at - 5}-{bad_at + 5}"})
    assert status == 502  # B knows A's bytes fail the manifest: refused at once, as an integrity error
    assert data[bad_at - 5 : bad_at + 5] not in body  # not one byte of the corrupt piece
    metrics = (await _get(f"{b.url}/metrics"))[1].decode()
    assert "deltarl_relay_integrity_failures_total 0.0" not in metrics


async def test_uncommitted_segments_wait_for_their_manifest(start_relay: StartRelay) -> None:
    origin = MemoryStore()
    data = os.urandom(PIECE + 10)
    origin.put(SEG, data)  # uploaded; its manifest is not committed yet
    relay = await start_relay(origin, piece_bytes=PIECE)
    status, body, _ = await _get(f"{relay.url}/{SEG}")
    assert status == 404
    assert b"not named by a committed manifest" in body
    status, body, _ = await _get(f"{relay.url}/{SEG}?unverified=1")  # a speculative fetch: unchecked, at once
    assert (status, body) == (200, data)
    waiting = asyncio.ensure_future(_get(f"{relay.url}/{SEG}?wait=20"))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    origin.put(MANIFEST, _manifest(SEG, data))
    status, body, complete = await waiting
    assert (status, body, complete) == (200, data, True)
    status, body, _ = await _get(f"{relay.url}/{SEG}", {"Range": f"bytes={PIECE - 3}-{PIECE + 3}"})
    assert (status, body) == (206, data[PIECE - 3 : PIECE + 4])
