"""The ObjectStore conformance suite (:class:`deltarl.testing.store_tests.StoreTests`) on every
backend: memory, local directory, moto S3 over HTTP, SeaweedFS S3. Each class gives the suite a
fresh store and raw access to what the backend holds."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deltarl.storage import LocalStore, MemoryStore
from deltarl.storage.keys import etag_of
from deltarl.storage.store import ObjectStore
from deltarl.testing.store_tests import StoreTests
from tests.fixtures.servers import S3Location


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self) -> MemoryStore:
        return MemoryStore()

    def raw_get(self, store: ObjectStore, key: str) -> bytes | None:
        assert isinstance(store, MemoryStore)
        entry = store._objects.get(key)
        return None if entry is None else entry[0]

    def raw_put(self, store: ObjectStore, key: str, data: bytes) -> None:
        assert isinstance(store, MemoryStore)
        store._objects[key] = (data, etag_of(data))


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[LocalStore]:
        store = LocalStore(tmp_path / "store")
        yield store
        store.close()

    def raw_get(self, store: ObjectStore, key: str) -> bytes | None:
        assert isinstance(store, LocalStore)
        path = store.root / key
        return path.read_bytes() if path.is_file() else None

    def raw_put(self, store: ObjectStore, key: str, data: bytes) -> None:
        assert isinstance(store, LocalStore)
        path = store.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)  # a plain file: no ETag recorded by a LocalStore


@functools.lru_cache(maxsize=4)
def _s3_client(endpoint_url: str) -> Any:
    """A boto3 client of its own (not the store's), one per server."""
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name="us-east-1")


class _S3StoreTests(StoreTests):
    """Raw access through the S3 API with a client of its own, under the store's bucket and prefix."""

    def _where(self, store: ObjectStore, key: str) -> tuple[Any, str, str]:
        from deltarl.storage.s3 import S3Store

        assert isinstance(store, S3Store)
        assert store.endpoint_url is not None
        return _s3_client(store.endpoint_url), store.bucket, f"{store.prefix}/{key}" if store.prefix else key

    def raw_get(self, store: ObjectStore, key: str) -> bytes | None:
        client, bucket, name = self._where(store, key)
        try:
            body: bytes = client.get_object(Bucket=bucket, Key=name)["Body"].read()
        except client.exceptions.NoSuchKey:
            return None
        return body

    def raw_put(self, store: ObjectStore, key: str, data: bytes) -> None:
        client, bucket, name = self._where(store, key)
        client.put_object(Bucket=bucket, Key=name, Body=data)


@pytest.mark.s3
class TestMotoStore(_S3StoreTests):
    @pytest.fixture
    def store(self, moto_s3: S3Location) -> Iterator[ObjectStore]:
        store = moto_s3.open(list_page_size=3)  # small pages: pagination is exercised
        yield store
        store.close()


@pytest.mark.s3
class TestSeaweedStore(_S3StoreTests):
    @pytest.fixture
    def store(self, seaweed_s3: S3Location) -> Iterator[ObjectStore]:
        store = seaweed_s3.open(list_page_size=3)
        yield store
        store.close()
