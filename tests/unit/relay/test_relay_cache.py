"""The relay's disk cache: LRU within a byte budget, atomic files, recovery after a restart."""

from __future__ import annotations

from pathlib import Path

from deltarl.pipeline.manifest import ObjectRef
from deltarl.relay.cache import DiskCache


def _add(cache: DiskCache, key: str, data: bytes) -> None:
    tmp = cache.temp_path()
    Path(tmp).write_bytes(data)
    cache.commit(key, tmp, size=len(data), etag="e", ref=None, verified=False)


def test_lru_eviction_within_budget(tmp_path: Path) -> None:
    evicted: list[str] = []
    cache = DiskCache(tmp_path, 300, on_evict=lambda e: evicted.append(e.key))
    for k in ("a", "b", "c"):
        _add(cache, k, b"x" * 100)
    assert cache.get("a") is not None  # a is now the most recent
    _add(cache, "d", b"y" * 100)
    assert evicted == ["b"]
    assert sorted(cache.keys()) == ["a", "c", "d"]
    assert cache.bytes == 300
    _add(cache, "huge", b"z" * 301)  # larger than the whole budget: not cached, nothing evicted
    assert "huge" not in cache
    assert cache.bytes == 300


def test_survives_restart_and_drops_debris(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, 1000)
    _add(cache, "run/versions/000000000001/seg-00000.bin", b"hello")
    ref = ObjectRef.of("run/versions/000000000001/seg-00000.bin", b"hello")
    cache.mark_verified(ref.key, ref)
    (tmp_path / ".tmp-crashed").write_bytes(b"partial")
    (tmp_path / ("0" * 64 + ".data")).write_bytes(b"orphan")  # data without metadata
    again = DiskCache(tmp_path, 1000)
    entry = again.get("run/versions/000000000001/seg-00000.bin")
    assert entry is not None
    assert entry.verified
    assert entry.ref == ref  # its pieces survive the restart
    assert Path(entry.path).read_bytes() == b"hello"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith((".data", ".json"))) == []
    assert len(list(tmp_path.glob("*.data"))) == 1
    assert again.remove("run/versions/000000000001/seg-00000.bin")
    assert list(tmp_path.iterdir()) == []
