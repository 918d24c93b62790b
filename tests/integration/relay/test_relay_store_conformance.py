"""The ObjectStore conformance suite, run against ``HTTPStore`` → relay → ``MemoryStore``.

The test functions are the backends' own (imported, not copied); only the ``store`` fixture
differs. A second parametrisation runs them through two chained relays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from deltarl.relay import BackgroundRelay
from deltarl.storage import MemoryStore, ObjectStore
from deltarl.storage.http import HTTPStore
from deltarl.storage.retry import RetryPolicy
from tests.integration.storage.test_store_conformance import (  # noqa: F401 - collected here with our fixture
    test_cas,
    test_delete_idempotent,
    test_empty_object,
    test_invalid_keys,
    test_large_object_round_trip,
    test_list_sorted_by_prefix,
    test_missing_key_errors,
    test_put_get_overwrite_head,
    test_put_if_absent,
    test_ranges,
)


@pytest.fixture(params=["relay", "relay-chain"])
def store(request: pytest.FixtureRequest, background_relay: Callable[..., BackgroundRelay]) -> Iterator[ObjectStore]:
    """HTTPStore through one relay, or through two chained relays, over a fresh MemoryStore."""
    origin = MemoryStore()
    relay = background_relay(origin, token="secret")
    if request.param == "relay-chain":
        relay = background_relay(relay.url, token="secret", upstream_token="secret")
    client = HTTPStore(relay.url, token="secret", retry=RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05))
    yield client
    client.close()
