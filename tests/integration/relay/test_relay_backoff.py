"""A relay in front of an upstream that answers 404 at once (nginx, a bucket endpoint) does not
busy-poll it while it holds a client's long-poll."""

from __future__ import annotations

from typing import Any

import pytest

from deltarl.errors import ObjectNotFound
from deltarl.storage import MemoryStore
from deltarl.storage.http_client import RelayClient
from tests.fixtures.relays import StartRelay


async def test_relay_over_a_404_at_once_upstream_backs_off(plain_http: Any, start_relay: StartRelay) -> None:
    """A relay whose upstream answers 404 at once (nginx, a bucket endpoint) holding a long-poll:
    it asks its upstream about once a second, not in a loop."""
    origin = MemoryStore()
    server = await plain_http(origin)
    relay = await start_relay(server.url)
    async with RelayClient(relay.url) as client:
        with pytest.raises(ObjectNotFound):
            await client.head("r/versions/000000000001/manifest.json", wait=3.0)
    asked = server.requests["r/versions/000000000001/manifest.json"]
    assert 2 <= asked <= 10, f"{asked} upstream requests during one 3 s long-poll"
