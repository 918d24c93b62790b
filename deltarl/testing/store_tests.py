"""The ObjectStore conformance suite, as a class each backend's tests subclass.

The zarr ``StoreTests`` / fsspec abstract-tests pattern: a backend's test module defines::

    class TestMyStore(StoreTests):
        @pytest.fixture
        def store(self, tmp_path):          # a fresh, empty store per test
            return MyStore(tmp_path)

        def raw_get(self, store, key):      # the bytes as the backend holds them, or None
            ...

        def raw_put(self, store, key, data):  # write behind the store's back
            ...

and inherits every test below. The raw hooks read and write the backend directly (a dict, a file,
the S3 API, the origin behind a relay), so a store is not checked only through its own methods:
what ``put`` wrote must be there, and what another writer put there must be readable.

Needs pytest (a test dependency); nothing on a production path imports this module.
"""

from __future__ import annotations

import os
from typing import ClassVar

import pytest

from deltarl.errors import (
    InvalidKey,
    InvalidRange,
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    StoreError,
)
from deltarl.storage.store import ObjectStore


class StoreTests:
    """Every ObjectStore contract test; subclass it and provide ``store``, ``raw_get`` and ``raw_put``."""

    INVALID_KEYS: ClassVar[tuple[str, ...]] = ("", "/abs", "a/../b", "..", "a//b", "a/", "./a", "a\\b", "a\x00b")

    @pytest.fixture
    def store(self) -> ObjectStore:
        """A fresh, empty store of the backend under test (override in the subclass)."""
        raise NotImplementedError(f"{type(self).__name__} must define the 'store' fixture")

    def raw_get(self, store: ObjectStore, key: str) -> bytes | None:
        """The bytes stored under ``key``, read without ``store``'s own methods; ``None`` if absent."""
        raise NotImplementedError(f"{type(self).__name__} must define raw_get")

    def raw_put(self, store: ObjectStore, key: str, data: bytes) -> None:
        """Write ``data`` under ``key`` without ``store``'s own methods (as another writer would)."""
        raise NotImplementedError(f"{type(self).__name__} must define raw_put")

    # --- checked against the backend itself -------------------------------------------------------

    def test_writes_land_in_the_backend(self, store: ObjectStore) -> None:
        assert self.raw_get(store, "raw/missing") is None
        store.put("raw/a", b"plain")
        assert self.raw_get(store, "raw/a") == b"plain"
        store.put("raw/a", b"overwritten")
        assert self.raw_get(store, "raw/a") == b"overwritten"
        store.put_if_absent("raw/b", b"once")
        assert self.raw_get(store, "raw/b") == b"once"
        etag = store.cas("raw/HEAD", b"0", None)
        store.cas("raw/HEAD", b"1", etag)
        assert self.raw_get(store, "raw/HEAD") == b"1"
        store.delete("raw/a")
        assert self.raw_get(store, "raw/a") is None

    def test_backend_objects_are_read(self, store: ObjectStore) -> None:
        data = os.urandom(3000)
        self.raw_put(store, "raw/other/seg.bin", data)
        self.raw_put(store, "raw/other/HEAD", b"from another writer")
        assert store.exists("raw/other/seg.bin")
        assert store.get("raw/other/seg.bin") == data
        assert store.get_range("raw/other/seg.bin", 100, 200) == data[100:200]
        assert store.head("raw/other/seg.bin").size == len(data)
        assert list(store.list("raw/other/")) == ["raw/other/HEAD", "raw/other/seg.bin"]
        with pytest.raises(ObjectExists):
            store.put_if_absent("raw/other/seg.bin", b"x")
        etag = store.head("raw/other/HEAD").etag  # the ETag of bytes the store did not write
        store.cas("raw/other/HEAD", b"moved", etag)
        assert self.raw_get(store, "raw/other/HEAD") == b"moved"

    # --- the contract, through the store's own methods --------------------------------------------

    def test_put_get_overwrite_head(self, store: ObjectStore) -> None:
        etag1 = store.put("run/a.bin", b"hello")
        assert store.get("run/a.bin") == b"hello"
        info = store.head("run/a.bin")
        assert (info.key, info.size, info.etag) == ("run/a.bin", 5, etag1)
        etag2 = store.put("run/a.bin", b"world!")
        assert etag2 != etag1
        assert store.get("run/a.bin") == b"world!"
        assert store.head("run/a.bin").size == 6
        assert store.exists("run/a.bin")
        assert not store.exists("run/b.bin")

    def test_empty_object(self, store: ObjectStore) -> None:
        store.put("empty", b"")
        assert store.get("empty") == b""
        assert store.head("empty").size == 0
        assert store.get_range("empty", 0) == b""
        assert store.get_range("empty", 0, 10) == b""
        with pytest.raises(InvalidRange):
            store.get_range("empty", 1)

    def test_missing_key_errors(self, store: ObjectStore) -> None:
        for call in (
            lambda: store.get("nope"),
            lambda: store.get_range("nope", 0, 1),
            lambda: store.get_range("nope", 5, 5),
            lambda: store.head("nope"),
            lambda: store.cas("nope", b"x", "0123456789abcdef0123456789abcdef"),
        ):
            with pytest.raises(ObjectNotFound) as info:
                call()
            assert isinstance(info.value, FileNotFoundError)
            assert isinstance(info.value, StoreError)
            assert "nope" in str(info.value)

    def test_ranges(self, store: ObjectStore) -> None:
        data = bytes(range(256)) * 4
        store.put("r", data)
        assert store.get_range("r", 0, 10) == data[:10]
        assert store.get_range("r", 10, 20) == data[10:20]  # end is exclusive
        assert store.get_range("r", 1000) == data[1000:]
        assert store.get_range("r", 1000, 5000) == data[1000:]  # end clamped to the size
        assert store.get_range("r", 7, 7) == b""  # zero-length
        assert store.get_range("r", len(data)) == b""  # start == size: empty, not an error
        assert store.get_range("r", len(data), len(data) + 5) == b""
        for start, end in ((len(data) + 1, None), (len(data) + 1, len(data) + 9), (5, 4), (-1, 3)):
            with pytest.raises(InvalidRange):
                store.get_range("r", start, end)

    def test_put_if_absent(self, store: ObjectStore) -> None:
        etag = store.put_if_absent("once", b"first")
        assert store.head("once").etag == etag
        with pytest.raises(ObjectExists) as info:
            store.put_if_absent("once", b"second")
        assert isinstance(info.value, FileExistsError)
        assert store.get("once") == b"first"

    def test_cas(self, store: ObjectStore) -> None:
        etag0 = store.cas("HEAD", b"0", None)
        with pytest.raises(PreconditionFailed):
            store.cas("HEAD", b"x", None)  # must not exist
        etag1 = store.cas("HEAD", b"1", etag0)
        assert store.get("HEAD") == b"1"
        assert store.head("HEAD").etag == etag1
        with pytest.raises(PreconditionFailed):
            store.cas("HEAD", b"stale", etag0)
        assert store.get("HEAD") == b"1"
        etag2 = store.cas("HEAD", b"2", etag1)
        assert store.get("HEAD") == b"2"
        assert etag2 == store.head("HEAD").etag

    def test_list_sorted_by_prefix(self, store: ObjectStore) -> None:
        keys = ["b/2", "a/1", "a/10", "a/2", "ab", "a/sub/x", "c"]
        for k in keys:
            store.put(k, k.encode())
        assert list(store.list()) == sorted(keys)
        assert list(store.list("a/")) == ["a/1", "a/10", "a/2", "a/sub/x"]
        assert list(store.list("a")) == ["a/1", "a/10", "a/2", "a/sub/x", "ab"]
        assert list(store.list("a/1")) == ["a/1", "a/10"]
        assert list(store.list("a/sub/")) == ["a/sub/x"]
        assert list(store.list("zzz")) == []
        assert list(store.list("nodir/")) == []

    def test_delete_idempotent(self, store: ObjectStore) -> None:
        store.put("d/x", b"1")
        store.delete("d/x")
        assert not store.exists("d/x")
        store.delete("d/x")
        store.delete("never/was")
        with pytest.raises(ObjectNotFound):
            store.get("d/x")
        assert list(store.list("d/")) == []
        store.put_if_absent("d/x", b"again")  # a deleted key can be created again
        assert store.get("d/x") == b"again"

    def test_invalid_keys(self, store: ObjectStore) -> None:
        calls = [
            ("get", ()),
            ("put", (b"x",)),
            ("put_if_absent", (b"x",)),
            ("cas", (b"x", None)),
            ("exists", ()),
            ("delete", ()),
            ("head", ()),
            ("get_range", (0,)),
        ]
        for key in self.INVALID_KEYS:
            for name, args in calls:
                with pytest.raises(InvalidKey):
                    getattr(store, name)(key, *args)
        assert list(store.list()) == []  # nothing was written

    def test_large_object_round_trip(self, store: ObjectStore) -> None:
        data = os.urandom(20 << 20)
        store.put_if_absent("big/seg-00000.bin", data)
        assert store.head("big/seg-00000.bin").size == len(data)
        assert store.get("big/seg-00000.bin") == data
        assert store.get_range("big/seg-00000.bin", 5 << 20, (5 << 20) + 123) == data[5 << 20 : (5 << 20) + 123]

    def test_finished_writes_leave_nothing_pending(self, store: ObjectStore) -> None:
        store.put("p/a", b"1")
        store.put_if_absent("p/b", b"2")
        store.cas("p/a", b"3", store.head("p/a").etag)
        store.put_stream_if_absent("p/c", [b"x" * (1 << 20), b"y" * (1 << 20)])
        with pytest.raises(ObjectExists):
            store.put_stream_if_absent("p/c", [b"z"])
        store.delete("p/b")
        assert list(store.pending_writes("p/")) == []
        assert list(store.pending_writes("")) == []
