"""S3Store specifics against moto over HTTP: dropped connections, ambiguous conditional writes,
pagination past 1000 keys, and open_store with endpoints from options or the environment."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

from deltarl.errors import ObjectExists, PreconditionFailed, TransientStoreError
from deltarl.storage.open import open_store
from deltarl.storage.retry import RetryPolicy
from deltarl.storage.s3 import S3Store
from tests.fixtures.servers import S3Location

pytestmark = pytest.mark.s3
log = logging.getLogger(__name__)


SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
)


class FaultyProxy:
    """A loopback TCP proxy in front of an S3 server whose first connections misbehave.

    ``faults[i]`` says what happens to connection ``i`` (later ones are relayed faithfully):

    * ``"refuse"``: closed as soon as accepted (the request is lost);
    * ``"drop"``: forwarded upstream, but cut the moment the response starts (the request took
      effect, the client never hears so; an interim ``100 Continue`` still passes);
    * ``"throttle"``: answered ``503 SlowDown`` like S3 under load, without reaching upstream;
    * ``"stall"``: the request is read and never answered (the client's read timeout fires).
    """

    def __init__(self, upstream: str, faults: list[str]) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.faults = faults
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def __enter__(self) -> FaultyProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop
        ).result()
        return self

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        n, self.connections = self.connections, self.connections + 1
        fault = self.faults[n] if n < len(self.faults) else None
        try:
            if fault == "refuse":
                return
            if fault in ("throttle", "stall"):
                await reader.readuntil(b"\r\n\r\n")  # the request head (boto waits on 100-continue)
                if fault == "stall":
                    await reader.read()  # until the client times out and hangs up
                    return
                head = f"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {len(SLOW_DOWN)}\r\n"
                writer.write(head.encode() + b"Connection: close\r\n\r\n" + SLOW_DOWN)
                await writer.drain()
                return
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
            try:
                await asyncio.gather(
                    self._pipe(reader, up_writer, cut=False),
                    self._pipe(up_reader, writer, cut=fault == "drop"),
                )
            finally:
                up_writer.close()
        except (ConnectionError, asyncio.IncompleteReadError) as err:
            log.debug("proxy connection %d ended: %s", n, err)  # the cut, or a peer going away
        finally:
            writer.transport.abort()
            self._tasks.discard(task)

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, cut: bool) -> None:
        while data := await src.read(1 << 16):
            # boto sends "Expect: 100-continue": an interim 100 passes so the body still flows.
            interim = data.startswith(b"HTTP/1.1 100 ") and data.endswith(b"\r\n\r\n")
            if cut and not interim:
                raise ConnectionResetError("proxy cut the response")
            dst.write(data)
            await dst.drain()
        dst.close()


def fast_retry(attempts: int = 5) -> RetryPolicy:
    return RetryPolicy(attempts=attempts, base_delay=0.0, max_delay=0.0, rng=random.Random(0))


@pytest.fixture
def bucket(moto_s3: S3Location) -> S3Location:
    return moto_s3


def test_dropped_connections_are_retried(bucket: S3Location) -> None:
    bucket.open().put("k", b"value")
    with FaultyProxy(bucket.endpoint_url, ["refuse"] * 3) as proxy:
        store = S3Store(
            bucket.bucket, endpoint_url=proxy.url, session=bucket.server.session, retry=fast_retry()
        )
        assert store.get("k") == b"value"
        assert proxy.connections == 4  # three refused, the fourth served
        store.close()


def test_throttling_and_stalls_are_retried(bucket: S3Location, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="deltarl.storage")
    bucket.open().put("k", b"value")
    faults = ["throttle", "stall", "throttle"]
    with FaultyProxy(bucket.endpoint_url, faults) as proxy:
        store = S3Store(
            bucket.bucket,
            endpoint_url=proxy.url,
            session=bucket.server.session,
            retry=fast_retry(),
            read_timeout=3.0,  # a stall hangs until it fires; a real answer on a loaded box may take over 0.5 s
        )
        assert store.get("k") == b"value"
        assert store.put_if_absent("new", b"1")
        assert proxy.connections == 5  # three faults, then the get and the put
        store.close()
    retried = [r.getMessage() for r in caplog.records if r.name == "deltarl.storage.retry"]
    assert len(retried) == 3
    assert "ClientError SlowDown" in retried[0]
    assert "ReadTimeoutError" in retried[1]
    assert "ClientError SlowDown" in retried[2]


def test_gives_up_with_transient_error(bucket: S3Location) -> None:
    with FaultyProxy(bucket.endpoint_url, ["refuse"] * 100) as proxy:
        store = S3Store(
            bucket.bucket, endpoint_url=proxy.url, session=bucket.server.session, retry=fast_retry(attempts=3)
        )
        with pytest.raises(TransientStoreError, match="gave up"):
            store.get("k")
        assert proxy.connections == 3
        store.close()


def test_put_if_absent_whose_response_was_lost(bucket: S3Location, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="deltarl.storage")
    direct = bucket.open()
    with FaultyProxy(bucket.endpoint_url, ["drop"]) as proxy:
        store = S3Store(
            bucket.bucket, endpoint_url=proxy.url, session=bucket.server.session, retry=fast_retry()
        )
        etag = store.put_if_absent("seg", b"our bytes")  # landed; the retry sees 412 and reads back
        assert direct.get("seg") == b"our bytes"
        assert direct.head("seg").etag == etag
        assert "landed on an earlier attempt" in caplog.text
        with pytest.raises(ObjectExists):
            store.put_if_absent("seg", b"other bytes")
        store.close()


def test_put_if_absent_lost_response_but_someone_else_won(bucket: S3Location) -> None:
    direct = bucket.open()
    direct.put_if_absent("seg", b"theirs")
    with FaultyProxy(bucket.endpoint_url, ["refuse"]) as proxy:
        store = S3Store(
            bucket.bucket, endpoint_url=proxy.url, session=bucket.server.session, retry=fast_retry()
        )
        with pytest.raises(ObjectExists):
            store.put_if_absent("seg", b"ours")
        assert direct.get("seg") == b"theirs"
        store.close()


def test_cas_whose_response_was_lost(bucket: S3Location, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="deltarl.storage")
    direct = bucket.open()
    etag0 = direct.cas("HEAD", b"0", None)
    with FaultyProxy(bucket.endpoint_url, ["drop"]) as proxy:
        store = S3Store(
            bucket.bucket, endpoint_url=proxy.url, session=bucket.server.session, retry=fast_retry()
        )
        etag1 = store.cas("HEAD", b"1", etag0)
        assert direct.get("HEAD") == b"1"
        assert direct.head("HEAD").etag == etag1
        assert "landed on an earlier attempt" in caplog.text
        with pytest.raises(PreconditionFailed):
            store.cas("HEAD", b"2", etag0)
        store.close()


@pytest.mark.slow
def test_list_paginates_past_1000_keys(seaweed_s3: S3Location) -> None:
    store = seaweed_s3.open()  # default page size: 1000 (SeaweedFS: 2.2 s here, moto 4.3 s)
    keys = [f"run/versions/{i:012d}/manifest.json" for i in range(1100)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: store.put(k, b"{}"), keys))
    store.put("other/x", b"")
    assert list(store.list("run/")) == keys
    assert len(list(store.list())) == 1101


def test_prefix_scopes_keys(bucket: S3Location) -> None:
    a = bucket.server.store(bucket.bucket, "team/a")
    b = bucket.server.store(bucket.bucket, "team/b")
    a.put("HEAD", b"a")
    b.put("HEAD", b"b")
    assert a.url == f"s3://{bucket.bucket}/team/a"
    assert a.get("HEAD") == b"a"
    assert list(a.list()) == ["HEAD"]
    assert sorted(bucket.open().list()) == ["team/a/HEAD", "team/b/HEAD"]


def test_open_store_s3_endpoint_from_option_and_env(
    bucket: S3Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(f"{bucket.url}/runs", **bucket.options)
    assert isinstance(store, S3Store)
    store.put("x", b"1")
    monkeypatch.setenv("DELTARL_S3_ENDPOINT", bucket.endpoint_url)
    again = open_store(f"{bucket.url}/runs")
    assert isinstance(again, S3Store)
    assert again.endpoint_url == bucket.endpoint_url
    assert again.get("x") == b"1"
    monkeypatch.delenv("DELTARL_S3_ENDPOINT")
    monkeypatch.setenv("AWS_ENDPOINT_URL", bucket.endpoint_url)
    assert open_store(f"{bucket.url}/runs").get("x") == b"1"


@pytest.mark.parametrize("server", ["moto", "seaweed"])
def test_multipart_upload_is_conditional_and_cleans_up(server: str, request: pytest.FixtureRequest) -> None:
    location: S3Location = request.getfixturevalue(f"{server}_s3")
    store = location.open(multipart_threshold=5 << 20, part_size=5 << 20, multipart_concurrency=3)
    data = random.Random(0).randbytes((12 << 20) + 7)  # three parts, the last one short
    etag = store.put_if_absent("keyframes/000000000000.safetensors", data)
    assert etag.endswith("-3")  # a multipart ETag
    assert etag == store.predicted_etag(data)  # the ambiguity check can decide from HEAD alone
    assert store.get("keyframes/000000000000.safetensors") == data
    assert store.head("keyframes/000000000000.safetensors").etag == etag
    with pytest.raises(ObjectExists):
        store.put_if_absent("keyframes/000000000000.safetensors", data[::-1])
    assert store.get_range("keyframes/000000000000.safetensors", 0, 4) == data[:4]
    store.put("keyframes/000000000000.safetensors", data[:-7])  # unconditional overwrite
    assert store.head("keyframes/000000000000.safetensors").size == 12 << 20
    uploads = store._client.list_multipart_uploads(Bucket=location.bucket)
    assert not uploads.get("Uploads")  # the refused upload was aborted


def test_predicted_etag_matches_server(bucket: S3Location) -> None:
    """The ambiguity check trusts a HEAD whose ETag is the one we predict: it must match S3's
    (multipart ETags are checked in the multipart test)."""
    store = bucket.open()
    for data in (b"", b"12345", random.Random(0).randbytes(100_000)):
        assert store.put("obj", data) == store.predicted_etag(data)


@pytest.mark.parametrize("size", [3 << 20, (12 << 20) + 123])
def test_put_stream_if_absent_multipart_and_small(moto_s3, size):
    """A streamed object goes up in parts while it is produced (one PUT when short), conditionally."""
    store = moto_s3.open(part_size=5 << 20, multipart_threshold=5 << 20, multipart_concurrency=2)
    data = os.urandom(size)
    chunks = (memoryview(data)[i : i + (1 << 20) + 7] for i in range(0, size, (1 << 20) + 7))
    store.put_stream_if_absent("k/streamed", chunks)
    assert store.get("k/streamed") == data
    with pytest.raises(ObjectExists):
        store.put_stream_if_absent("k/streamed", iter([data]))
    assert store.get("k/streamed") == data
