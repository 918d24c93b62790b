"""open_store: URL forms and errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltarl.errors import ConfigError
from deltarl.storage import LocalStore, MemoryStore
from deltarl.storage.open import open_store


def test_plain_path_and_file_url(tmp_path: Path) -> None:
    a = open_store(str(tmp_path / "a"))
    assert isinstance(a, LocalStore)
    assert a.root == tmp_path / "a"
    b = open_store(f"file://{tmp_path}/b")
    assert isinstance(b, LocalStore)
    assert b.root == tmp_path / "b"
    c = open_store(tmp_path / "c", fsync=False)
    assert isinstance(c, LocalStore)
    assert not c.fsync
    a.put("k", b"v")
    assert open_store(str(tmp_path / "a")).get("k") == b"v"


def test_memory_url_is_fresh_each_call() -> None:
    a = open_store("memory://x")
    b = open_store("memory://x")
    assert isinstance(a, MemoryStore)
    assert a.url == "memory://x"
    a.put("k", b"v")
    assert not b.exists("k")
    assert isinstance(open_store("memory://"), MemoryStore)


@pytest.mark.parametrize(
    "url",
    [
        "",
        "nosuchscheme://host/x",  # ftp:// and other fsspec schemes open through fsspec
        "file://otherhost/x",
        "file://",
        "s3://",
        "s3:///prefix",
        "memory://x?y=1",
        "s3://b/p#frag",
    ],
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(ConfigError):
        open_store(url)


def test_unknown_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="option"):
        open_store(str(tmp_path), colour="blue")
    with pytest.raises(ConfigError, match="option"):
        open_store("memory://", fsync=True)


def test_s3_url_without_network(monkeypatch: pytest.MonkeyPatch) -> None:
    from deltarl.storage import S3Store

    for var in ("DELTARL_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    store = open_store("s3://my-bucket/runs/exp1/", region="eu-west-1")
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.url) == ("my-bucket", "runs/exp1", "s3://my-bucket/runs/exp1")
    assert store.endpoint_url is None  # AWS itself
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("DELTARL_S3_ENDPOINT", "http://127.0.0.1:8")
    assert open_store("s3://b").endpoint_url == "http://127.0.0.1:8"  # type: ignore[attr-defined]
    assert open_store("s3://b", endpoint_url="http://h:1").endpoint_url == "http://h:1"  # type: ignore[attr-defined]
    with pytest.raises(ConfigError):
        open_store("s3://b", part_size=1)
    with pytest.raises(ConfigError):
        open_store("s3://b/../x")


def test_http_url_opens_a_relay_client() -> None:
    from deltarl.storage.http import HTTPStore

    store = open_store("http://127.0.0.1:9/")
    try:
        assert isinstance(store, HTTPStore)
        assert store.url == "http://127.0.0.1:9"
    finally:
        store.close()
    with pytest.raises(ConfigError, match="no host"):
        open_store("http:///x")
