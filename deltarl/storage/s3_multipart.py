"""Multipart upload for the S3 backend: part sizing, the parallel upload, and the ETag S3 will give.

A single S3 PUT is capped at 5 GiB and a keyframe of an 8B model is 16 GB, so large objects go
up in parts, several at once, each request under the caller's retry policy; the condition (``If-None-Match``/``If-Match``) rides on the completing call, so the object
appears whole or not at all. Any failure aborts the upload so no parts are left billed; a process
that is killed cannot abort, so :func:`pending_uploads` lists what such writers left (gc aborts
them once the run's writer is known dead).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from deltarl.errors import StoreError

log = logging.getLogger(__name__)

MAX_PARTS = 10_000
MIN_PART = 5 << 20  # S3's minimum for every part but the last


def part_size_for(total: int, part_size: int) -> int:
    """``part_size``, grown if needed so ``total`` bytes fit in ``MAX_PARTS`` parts."""
    return max(part_size, -(-total // MAX_PARTS))


def predicted_etag(data: bytes, multipart_threshold: int, part_size: int) -> str:
    """The ETag S3 gives ``data`` uploaded by these rules (without SSE-KMS): the MD5 hex for a
    single PUT, else the MD5 of the parts' MD5s followed by ``-<parts>``."""
    if len(data) <= multipart_threshold:
        return hashlib.md5(data, usedforsecurity=False).hexdigest()
    size, view = part_size_for(len(data), part_size), memoryview(data)
    digests = [
        hashlib.md5(view[i : i + size], usedforsecurity=False).digest() for i in range(0, len(data), size)
    ]
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"


def upload(
    client: Any,
    bucket: str,
    key: str,
    data: bytes,
    *,
    condition: dict[str, str],
    part_size: int,
    concurrency: int,
    call: Callable[[Callable[[], Any]], Any],
    call_complete: Callable[[Callable[[], Any]], Any],
) -> Any:
    """Upload ``data`` to ``bucket/key`` in parts, ``concurrency`` at a time; return the response
    of ``CompleteMultipartUpload`` (sent with ``condition``).

    ``call(fn)`` runs one S3 request under the caller's retry policy and error translation;
    ``call_complete`` does the same for the completing request (so the caller can count attempts).
    """
    size = part_size_for(len(data), part_size)
    view = memoryview(data)
    count = -(-len(data) // size)
    upload_id = call(lambda: client.create_multipart_upload(Bucket=bucket, Key=key))["UploadId"]

    def put_part(i: int) -> dict[str, Any]:
        chunk = bytes(view[i * size : (i + 1) * size])
        resp = call(
            lambda: client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=i + 1, Body=chunk
            )
        )
        return {"PartNumber": i + 1, "ETag": resp["ETag"]}

    try:
        with ThreadPoolExecutor(min(count, concurrency), thread_name_prefix="s3-part") as pool:
            parts = list(pool.map(put_part, range(count)))
        return call_complete(
            lambda: client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}, **condition
            )
        )
    except BaseException:
        try:
            call(lambda: client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id))
        except StoreError as err:  # an earlier attempt completed it, or lifecycle rules must reclaim it
            log.info("multipart upload of %s/%s not aborted: %s", bucket, key, err)
        raise


def upload_stream(
    client: Any,
    bucket: str,
    key: str,
    chunks: Iterable[Any],
    *,
    condition: dict[str, str],
    part_size: int,
    concurrency: int,
    call: Callable[[Callable[[], Any]], Any],
    call_complete: Callable[[Callable[[], Any]], Any],
    put_small: Callable[[bytes], Any],
) -> Any:
    """Upload an object produced as ``chunks`` (buffers, in order), without holding it whole: the
    bytes fill ``part_size`` parts that go up ``concurrency`` at a time while the producer goes on
    (so serialization and upload overlap); at most ``concurrency + 1`` parts are in memory. An
    object that ends before its first part is full goes up with one ``put_small(data)``. Return
    the completing response; any failure aborts the upload."""
    slots = threading.BoundedSemaphore(concurrency)
    buf = bytearray()
    upload_id: str | None = None
    futures: list[Future[dict[str, Any]]] = []
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="s3-part")

    def put_part(number: int, body: bytes) -> dict[str, Any]:
        try:
            resp = call(lambda: client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body))
            return {"PartNumber": number, "ETag": resp["ETag"]}
        finally:
            slots.release()

    def flush(body: bytes) -> None:
        nonlocal upload_id
        if upload_id is None:
            upload_id = call(lambda: client.create_multipart_upload(Bucket=bucket, Key=key))["UploadId"]
        if len(futures) >= MAX_PARTS:
            raise StoreError(f"{bucket}/{key}: more than {MAX_PARTS} parts of {part_size} bytes")
        slots.acquire()
        for f in futures:  # fail fast
            if f.done() and f.exception() is not None:
                slots.release()
                f.result()
        futures.append(pool.submit(put_part, len(futures) + 1, body))

    try:
        for chunk in chunks:
            mv = memoryview(chunk).cast("B")
            while mv:
                take = min(len(mv), part_size - len(buf))
                buf += mv[:take]
                mv = mv[take:]
                if len(buf) == part_size:
                    flush(bytes(buf))
                    buf = bytearray()
        if upload_id is None:
            return put_small(bytes(buf))
        if buf:
            flush(bytes(buf))
        parts = [f.result() for f in futures]
        return call_complete(
            lambda: client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}, **condition)
        )
    except BaseException:
        for f in futures:
            f.cancel()
        if upload_id is not None:
            try:
                call(lambda: client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id))
            except StoreError as err:
                log.info("multipart upload of %s/%s not aborted: %s", bucket, key, err)
        raise
    finally:
        pool.shutdown(wait=True)


def pending_uploads(
    client: Any, bucket: str, prefix: str, call: Callable[[Callable[[], Any]], Any]
) -> Iterator[tuple[str, str, float, int]]:
    """``(key, upload_id, initiated, size)`` of every multipart upload under ``prefix`` (full keys)
    not yet completed or aborted: ``initiated`` in Unix seconds, ``size`` the bytes of the parts
    received so far (``ListParts``). Pages through both listings; ``call`` as in :func:`upload`."""
    markers: dict[str, str] = {}
    while True:
        page = call(functools.partial(client.list_multipart_uploads, Bucket=bucket, Prefix=prefix, **markers))
        for up in page.get("Uploads", ()):
            key, upload_id = up["Key"], up["UploadId"]
            yield key, upload_id, up["Initiated"].timestamp(), _parts_size(client, bucket, key, upload_id, call)
        if not page.get("IsTruncated"):
            return
        markers = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}


def _parts_size(client: Any, bucket: str, key: str, upload_id: str, call: Callable[[Callable[[], Any]], Any]) -> int:
    total, marker = 0, 0
    while True:
        page = call(functools.partial(client.list_parts, Bucket=bucket, Key=key, UploadId=upload_id, PartNumberMarker=marker))
        total += sum(int(part["Size"]) for part in page.get("Parts", ()))
        if not page.get("IsTruncated"):
            return total
        marker = int(page.get("NextPartNumberMarker", 0))
