"""The store contract on fsspec filesystems: fsspec's memory and local filesystems and s3fs against
SeaweedFS. Reads and plain writes follow the conformance suite; conditional writes run the suite's
tests where the filesystem has atomic ones (s3fs) and are refused elsewhere."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from deltarl.errors import ConditionalWriteUnsupported, ConfigError, ObjectNotFound
from deltarl.pipeline.publisher import Publisher
from deltarl.storage.fsspec_store import FsspecStore
from deltarl.storage.open import open_store
from deltarl.storage.store import ObjectStore
from deltarl.testing.store_tests import StoreTests
from tests.fixtures.runs import TinyTrainer, publish_run, states_equal

pytest.importorskip("fsspec")


@pytest.fixture(params=[pytest.param("memory", id="fsspec-memory"), pytest.param("local", id="fsspec-local"),
                        pytest.param("s3fs", id="s3fs-seaweed", marks=pytest.mark.s3)])
def fsspec_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FsspecStore]:
    if request.param == "memory":
        url = f"fsspec+memory://t-{uuid.uuid4().hex}"
        opened = open_store(url)
    elif request.param == "local":
        opened = open_store(f"fsspec+file://{tmp_path}/store")
    else:
        pytest.importorskip("s3fs")
        loc = request.getfixturevalue("seaweed_s3")
        opened = open_store(f"fsspec+s3://{loc.bucket}/pre", endpoint_url=loc.endpoint_url, skip_instance_cache=True)
    assert isinstance(opened, FsspecStore)
    yield opened
    if request.param == "memory" and opened.fs.exists(opened.root):
        opened.fs.rm(opened.root, recursive=True)


@pytest.fixture
def store(fsspec_store: FsspecStore) -> FsspecStore:
    return fsspec_store


class TestFsspecStore(StoreTests):
    """The conformance suite on fsspec filesystems; conditional writes only where the filesystem
    has them (s3fs), refused elsewhere (test_conditional_writes_or_a_clear_refusal)."""

    @pytest.fixture
    def store(self, fsspec_store: FsspecStore) -> ObjectStore:
        return fsspec_store

    def raw_get(self, store: ObjectStore, key: str) -> bytes | None:
        assert isinstance(store, FsspecStore)
        path = store._path(key)
        return bytes(store.fs.cat_file(path)) if store.fs.exists(path) else None

    def raw_put(self, store: ObjectStore, key: str, data: bytes) -> None:
        assert isinstance(store, FsspecStore)
        store.fs.pipe_file(store._path(key), data)

    #: suite tests that write with put_if_absent or cas: only where the filesystem has them
    CONDITIONAL: ClassVar[frozenset[str]] = frozenset({
        "test_put_if_absent", "test_cas", "test_delete_idempotent", "test_writes_land_in_the_backend",
        "test_backend_objects_are_read", "test_large_object_round_trip", "test_finished_writes_leave_nothing_pending",
    })

    @pytest.fixture(autouse=True)
    def _conditional_only_where_supported(self, request: pytest.FixtureRequest, fsspec_store: FsspecStore) -> None:
        if request.node.originalname in self.CONDITIONAL and not fsspec_store.conditional_writes:
            pytest.skip("no conditional writes on this filesystem: test_conditional_writes_or_a_clear_refusal")


def test_conditional_writes_or_a_clear_refusal(store: FsspecStore) -> None:
    if store.conditional_writes:
        return  # TestFsspecStore runs the suite's conditional-write tests on it
    store.put("k", b"v")
    with pytest.raises(ConditionalWriteUnsupported, match="refused"):
        store.put_if_absent("new", b"x")
    with pytest.raises(ConditionalWriteUnsupported):
        store.cas("k", b"w", store.head("k").etag)
    with pytest.raises(ObjectNotFound):
        store.cas("missing", b"w", "0" * 32)
    assert store.get("k") == b"v"
    assert not store.exists("new")


def test_s3fs_has_conditional_writes(request: pytest.FixtureRequest, store: FsspecStore) -> None:
    assert store.conditional_writes == (request.node.callspec.id == "s3fs-seaweed")


def test_s3fs_computes_no_checksum_of_its_own(request: pytest.FixtureRequest, store: FsspecStore) -> None:
    """boto's default CRC over every byte sent and received is a second pass that the objects'
    own piece hashes make redundant: s3fs is told to compute one only where S3 requires it."""
    if request.node.callspec.id != "s3fs-seaweed":
        pytest.skip("s3fs only")
    config = store.fs.config_kwargs
    assert config["request_checksum_calculation"] == config["response_checksum_validation"] == "when_required"
    store.put("checksums/k", b"v")  # and SeaweedFS takes the writes so made
    assert store.get("checksums/k") == b"v"


@pytest.mark.torch
def test_read_a_run_and_refuse_or_allow_publishing(store: FsspecStore) -> None:
    pytest.importorskip("torch")
    from deltarl.pipeline.replay import replay
    from deltarl.storage import MemoryStore

    if store.conditional_writes:  # publish straight through fsspec
        exports = publish_run(store, "r", 3, segment_bytes=4096)
    else:
        with pytest.raises(ConditionalWriteUnsupported), Publisher(store, "r") as pub:
            pub.publish(TinyTrainer(0).export(), step=0)
        src = MemoryStore()  # published elsewhere, copied in with plain writes: readable here
        exports = publish_run(src, "r", 3, segment_bytes=4096)
        for key in src.list("r/"):
            store.put(key, src.get(key))
    assert states_equal(replay(store, "r", 2), exports[2])


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(ConfigError, match="unsupported store URL scheme"):
        open_store("nosuchscheme://x")


def test_fsspec_schemes_route_to_fsspec(tmp_path: Path) -> None:
    opened: Any = open_store(f"fsspec+file://{tmp_path}")
    assert isinstance(opened, FsspecStore)
    assert type(open_store("memory://x")).__name__ == "MemoryStore"  # deltarl's own wins without the prefix


@pytest.mark.torch
def test_commands_read_an_fsspec_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """replay and inspect take an fsspec URL; the run was published with deltarl's own local store."""
    pytest.importorskip("torch")
    from safetensors.torch import load_file

    from deltarl.cli import main
    from deltarl.storage import LocalStore

    exports = publish_run(LocalStore(tmp_path / "runs"), "r", 3, segment_bytes=4096)
    url = f"fsspec+file://{tmp_path}/runs"
    assert main(["inspect", "r", "--store", url]) == 0
    assert "2" in capsys.readouterr().out
    out = tmp_path / "w.safetensors"
    assert main(["replay", "r", "--store", url, "--version", "2", "--out", str(out), "--no-progress"]) == 0
    assert states_equal(load_file(str(out)), exports[2])
