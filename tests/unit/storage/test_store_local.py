"""LocalStore specifics: on-disk layout, no partial objects, temp files hidden, ETags stable."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltarl.errors import InvalidKey, ObjectNotFound, StoreError, StoreNotFound
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
    LocalStore(tmp_path).put("k", b"a first write makes the temp folder")
    stale = tmp_path / TMP_DIR / "dead.tmp"
    fresh = tmp_path / TMP_DIR / "inflight.tmp"
    stale.write_bytes(b"half a segment")
    fresh.write_bytes(b"being written")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    store = LocalStore(tmp_path)  # opening sweeps temp files older than an hour
    assert not stale.exists()
    assert fresh.exists()
    assert list(store.list()) == ["k"]
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
    time.sleep(0.05)  # past a coarse file-time tick (10 ms at HZ=100), so the edit's mtime differs
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


def _resident(path: Path, length: int | None = None) -> int:
    """Bytes of ``path``'s first ``length`` (default: all) in the page cache (mincore over a mapping)."""
    import ctypes
    import mmap

    size = path.stat().st_size if length is None else length
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        pytest.skip(f"mmap: errno {ctypes.get_errno()}")
    try:
        vec = (ctypes.c_ubyte * (-(-size // page)))()
        if libc.mincore(addr, size, vec) != 0:
            pytest.skip(f"mincore: errno {ctypes.get_errno()}")
        return sum(1 for v in vec if v & 1) * page
    finally:
        libc.munmap(addr, size)


def _drops_pages(directory: Path) -> bool:
    """Whether this file system lets a flushed file's pages go on request (tmpfs keeps them)."""
    probe = directory / "probe"
    with open(probe, "wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    dropped = _resident(probe) < (1 << 20)
    probe.unlink()
    return dropped


def test_a_streamed_write_and_big_reads_leave_the_page_cache_as_they_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import deltarl.storage.pagecache as pagecache

    if not _drops_pages(tmp_path):
        pytest.skip("this file system keeps pages cached regardless")
    monkeypatch.setattr(pagecache, "FLUSH_WINDOW_BYTES", 1 << 20)
    store = LocalStore(tmp_path / "store")
    data = os.urandom(8 << 20)
    store.put_stream_if_absent("big", (data[i : i + (256 << 10)] for i in range(0, len(data), 256 << 10)))
    path = tmp_path / "store" / "big"
    assert path.read_bytes() == data
    with open(path, "rb") as f:  # read_bytes above cached it all again: drop it, then read as a reader does
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    buf = bytearray(4 << 20)
    assert store.get_range_into("big", 0, buf) == len(buf)
    assert buf == data[: 4 << 20]
    assert store.get_range("big", 4 << 20, 5 << 20) == data[4 << 20 : 5 << 20]
    assert _resident(path, 5 << 20) == 0  # the megabyte-sized reads let their pages go (read-ahead past them stays)
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert store.get_range("big", 0, 4096) == data[:4096]
    assert _resident(path, 4096) == 4096  # a small read (a manifest, a header) stays cached


def test_a_streamed_write_holds_at_most_a_window_of_dirty_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import deltarl.storage.pagecache as pagecache

    if not _drops_pages(tmp_path):
        pytest.skip("this file system keeps pages cached regardless")
    monkeypatch.setattr(pagecache, "FLUSH_WINDOW_BYTES", 1 << 20)
    store = LocalStore(tmp_path / "store")
    cached: list[int] = []

    def chunks() -> Iterator[bytes]:
        for _ in range(8):
            yield os.urandom(1 << 20)
            temp = [p for p in (tmp_path / "store" / TMP_DIR).iterdir() if p.suffix == ".tmp"]
            if temp:
                cached.append(_resident(temp[0]))

    store.put_stream_if_absent("big", chunks())
    assert max(cached) <= 2 << 20  # a window being written and, at most, the one before it


def test_a_store_another_process_creates_meanwhile_is_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks open one new store at once: the folder made by another between the check and the
    mkdir is opened, not refused (a spawned rank of the sharded FP8 test hit this on CI)."""
    root = tmp_path / "store"
    real_is_dir = Path.is_dir
    seen: list[Path] = []

    def is_dir_then_another_creates(self: Path) -> bool:
        if self == root and not seen:
            seen.append(self)
            root.mkdir()  # the other rank wins the race right after this process looked
            return False
        return real_is_dir(self)

    monkeypatch.setattr(Path, "is_dir", is_dir_then_another_creates)
    store = LocalStore(root)
    assert seen
    store.put("HEAD", b"1")
    assert store.get("HEAD") == b"1"


def test_a_file_where_the_store_should_be_is_refused(tmp_path: Path) -> None:
    (tmp_path / "store").write_bytes(b"x")
    with pytest.raises(StoreNotFound, match="not a directory"):
        LocalStore(tmp_path / "store")
    with pytest.raises(StoreNotFound, match="no store at"):
        LocalStore(tmp_path / "missing", create=False)
    assert not (tmp_path / "missing").exists()
