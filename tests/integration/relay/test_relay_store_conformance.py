"""The ObjectStore conformance suite on ``HTTPStore`` → relay → ``MemoryStore``, and through two
chained relays. Raw access is the origin ``MemoryStore`` behind the relays."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from deltarl.relay.runner import BackgroundRelay
from deltarl.storage import MemoryStore
from deltarl.storage.http import HTTPStore
from deltarl.storage.keys import etag_of
from deltarl.storage.retry import RetryPolicy
from deltarl.storage.store import ObjectStore
from deltarl.testing.store_tests import StoreTests


class TestRelayStore(StoreTests):
    """HTTPStore through one relay over a fresh MemoryStore."""

    hops = 1

    @pytest.fixture
    def store(self, background_relay: Callable[..., BackgroundRelay]) -> Iterator[ObjectStore]:
        origin = MemoryStore()
        relay = background_relay(origin, token="secret")
        for _ in range(self.hops - 1):
            relay = background_relay(relay.url, token="secret", upstream_token="secret")
        client = HTTPStore(relay.url, token="secret", retry=RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05))
        self.origin = origin  # pytest binds class fixtures to the test's own instance
        yield client
        client.close()

    def raw_get(self, store: ObjectStore, key: str) -> bytes | None:
        entry = self.origin._objects.get(key)
        return None if entry is None else entry[0]

    def raw_put(self, store: ObjectStore, key: str, data: bytes) -> None:
        self.origin._objects[key] = (data, etag_of(data))


class TestRelayChainStore(TestRelayStore):
    """HTTPStore through two chained relays (B's upstream is A over HTTP)."""

    hops = 2
