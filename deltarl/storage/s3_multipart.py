"""Multipart upload for the S3 backend: part sizing, the parallel upload, and the ETag S3 will give.

A single S3 PUT is capped at 5 GiB and a keyframe of an 8B model is 16 GB, so large objects go
up in parts, several at once, each request under the caller's retry policy; the condition (``If-None-Match``/``If-Match``) rides on the completing call, so the object
appears whole or not at all. Any failure aborts the upload so no parts are left billed.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
