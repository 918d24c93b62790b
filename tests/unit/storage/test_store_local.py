"""LocalStore specifics: on-disk layout, no partial objects, temp files hidden, ETags stable."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from deltarl.errors import InvalidKey, ObjectNotFound, StoreError
from deltarl.storage import LocalStore
from deltarl.storage.keys import etag_of
from deltarl.storage.local import TMP_DIR


def test_layout_is_plain_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_if_absent("run/versions/000000000001/manifest.json", b"{}")
    assert (tmp_path / "run/versions/000000000001/manifest.json").read_bytes() == b"{}"
    assert list(store.list()) == ["run/versions/000000000001/manifest.json"]
    assert not list((tmp_path / TMP_DIR).glob("*.tmp"))  # temp files cleaned up


def test_reserved_tmp_dir(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    with pytest.raises(InvalidKey):
        store.put(f"{TMP_DIR}/x", b"1")


def test_etag_stable_across_instances(tmp_path: Path) -> None:
    etag = LocalStore(tmp_path).put("HEAD", b"42")
    assert LocalStore(tmp_path).head("HEAD").etag == etag
    LocalStore(tmp_path).cas("HEAD", b"43", etag)
    assert LocalStore(tmp_path).get("HEAD") == b"43"


def test_file_directory_clash(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    store.put("a", b"1")
    with pytest.raises(StoreError, match="a/b"):
        store.put("a/b", b"2")
    store.put("d/x", b"1")
    with pytest.raises(StoreError):
        store.put("d", b"2")
    with pytest.raises(ObjectNotFound):
        store.get("d")  # a directory of keys is not an object
    assert not store.exists("d")


def test_delete_prunes_empty_dirs(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    store.put("r/v/1/seg", b"1")
    store.put("r/keep", b"1")
    store.delete("r/v/1/seg")
    assert not (tmp_path / "r/v").exists()
    assert (tmp_path / "r/keep").exists()


def test_crashed_writer_temp_files_are_swept(tmp_path: Path) -> None:
    LocalStore(tmp_path)
    stale = tmp_path / TMP_DIR / "dead.tmp"
    fresh = tmp_path / TMP_DIR / "inflight.tmp"
    stale.write_bytes(b"half a segment")
    fresh.write_bytes(b"being written")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    store = LocalStore(tmp_path)  # opening sweeps temp files older than an hour
    assert not stale.exists()
    assert fresh.exists()
    assert list(store.list()) == []
    assert store.sweep_temp(older_than_s=0) == 1


def test_etag_recorded_at_write_and_invalidated_by_edits(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, fsync=False)
    etag = store.put("k", b"hello")
    try:
        recorded = os.getxattr(tmp_path / "k", "user.deltarl.md5").decode()
    except OSError:
        pytest.skip("no user xattrs on this file system: head() hashes every time")
    assert recorded.split()[0] == etag == etag_of(b"hello")
    assert store.head("k").etag == etag
    time.sleep(0.01)
    (tmp_path / "k").write_bytes(b"jello")  # an edit behind the store's back: same size, new mtime
    assert store.head("k").etag == etag_of(b"jello")
    (tmp_path / "copied").write_bytes(b"no xattr")  # a file the store did not write is hashed
    assert store.head("copied").etag == etag_of(b"no xattr")


def test_sweep_survives_temp_files_vanishing_under_it(tmp_path: Path) -> None:
    """Writers in other processes rename their temp files away while a new store sweeps."""
    import threading

    store = LocalStore(tmp_path)
    stop = threading.Event()

    def write_forever() -> None:
        i = 0
        while not stop.is_set():
            store.put(f"k/{i % 50}", b"x" * 64)
            i += 1

    writer = threading.Thread(target=write_forever)
    writer.start()
    try:
        for _ in range(300):
            assert LocalStore(tmp_path).sweep_temp() == 0  # nothing is an hour old
    finally:
        stop.set()
        writer.join()
    assert store.get("k/0") == b"x" * 64
