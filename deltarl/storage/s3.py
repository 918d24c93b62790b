"""S3 object store on boto3 (AWS, MinIO, SeaweedFS, moto: anything that speaks S3 at an endpoint URL).

Why boto3, synchronous: it is the reference S3 client, its client object is thread-safe and keeps a
connection pool (``max_pool_connections``), and conditional writes (``IfNoneMatch``/``IfMatch`` on
``PutObject``) are first-class parameters. Parallel uploads use threads (the publisher's pipeline,
``ThreadPoolExecutor``); the async relay calls the store through ``asyncio.to_thread``. aiobotocore
(s3fs) would add an event-loop-bound client and a version lock-step with botocore for no gain here.

Semantics (see :mod:`deltarl.storage.store` for the contract):

* ``put_if_absent`` is ``PutObject`` with ``If-None-Match: *``; 412 (or a 409
  ``ConditionalRequestConflict`` that outlives the retries) → ``ObjectExists``.
* ``cas`` is ``PutObject`` with ``If-Match: "<etag>"`` (or ``If-None-Match: *`` for ``None``);
  412 → ``PreconditionFailed``; a missing key → ``ObjectNotFound`` (AWS and moto answer 404,
  SeaweedFS 412, so a 412 is followed by a ``HEAD`` to tell the two apart).
* A conditional write retried after a dropped connection is ambiguous: the first attempt may have
  landed. If the retry then hits the precondition, the store checks whether the object holds
  exactly our bytes (size and predicted ETag from ``HEAD``; a full read only for an ETag it cannot
  predict, e.g. SSE-KMS) and if so reports success.
* Ranged reads send ``Range: bytes=a-(b-1)``; S3 answers 416 for a start at or past the end,
  which the contract allows when ``start == size`` (empty result), so a 416 is followed by ``HEAD``.
* Objects above ``multipart_threshold`` (64 MiB) go up as a parallel multipart upload (S3 caps a
  single PUT at 5 GiB; a keyframe of an 8B model is 16 GB); the condition then rides on
  ``CompleteMultipartUpload``, so the object still appears whole or not at all. The uploads a
  killed writer left (its parts still billed) are ``pending_writes``; ``abort_pending`` aborts one.
* ETags are returned without quotes.
* Retries: boto3's own are off (``total_max_attempts=1``); :class:`~deltarl.storage.retry.RetryPolicy`
  is the only policy. Payload checksums are sent only when an operation requires them
  (``request_checksum_calculation="when_required"``; boto3 >= 1.36 otherwise computes a CRC over
  every byte uploaded and validates one over every byte read, a second pass that deltarl's own
  piece hashes make redundant), so S3-compatible servers without the newer checksum trailers work.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import boto3
import botocore.config
import botocore.exceptions

from deltarl import defaults
from deltarl.errors import (
    ConfigError,
    InvalidKey,
    InvalidRange,
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    StoreError,
)
from deltarl.storage import s3_multipart
from deltarl.storage.keys import check_range_args, strip_etag, validate_key, validate_prefix
from deltarl.storage.retry import RetryPolicy
from deltarl.storage.s3_errors import is_code, is_precondition, translate
from deltarl.storage.store import ObjectInfo, ObjectStore, PendingWrite

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Environment variables consulted, in order, when no ``endpoint_url`` is given.
ENDPOINT_ENV_VARS = defaults.S3_ENDPOINT_ENVS

class S3Store(ObjectStore):
    """Objects under ``s3://bucket/prefix``; keys are relative to the prefix.

    ``endpoint_url`` defaults to the first of ``DELTARL_S3_ENDPOINT``, ``AWS_ENDPOINT_URL_S3``,
    ``AWS_ENDPOINT_URL`` that is set (else AWS). Credentials come from the arguments or boto3's
    usual chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, instance roles).
    With a custom endpoint, path-style addressing is used (MinIO, SeaweedFS). Pass a shared
    ``session`` to create many stores cheaply (a fresh boto3 session loads the service model again:
    ~0.2 s per store); boto3 sessions are not thread-safe, so share one only within a thread.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        profile: str | None = None,
        session: boto3.session.Session | None = None,
        addressing_style: str | None = None,
        max_pool_connections: int = 64,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        list_page_size: int = 1000,
        multipart_threshold: int = 64 << 20,
        part_size: int = 32 << 20,
        multipart_concurrency: int = 8,
        retry: RetryPolicy | None = None,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ConfigError(f"bad S3 bucket name {bucket!r}")
        prefix = prefix.strip("/")
        try:
            if prefix:
                validate_key(prefix)
        except InvalidKey as err:
            raise ConfigError(f"bad S3 prefix {prefix!r}: {err}") from err
        if not 1 <= list_page_size <= 1000:
            raise ConfigError(f"list_page_size must be in [1, 1000], got {list_page_size}")
        self.bucket = bucket
        self.prefix = prefix
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.retry = retry if retry is not None else RetryPolicy()
        self.list_page_size = list_page_size
        if part_size < s3_multipart.MIN_PART or multipart_threshold < part_size or multipart_concurrency < 1:
            raise ConfigError(
                f"need part_size >= 5 MiB <= multipart_threshold and multipart_concurrency >= 1, got "
                f"{part_size}, {multipart_threshold}, {multipart_concurrency}"
            )
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.multipart_concurrency = multipart_concurrency
        if endpoint_url is None:
            endpoint_url = defaults.first_env(ENDPOINT_ENV_VARS)
        self.endpoint_url = endpoint_url
        config = botocore.config.Config(
            max_pool_connections=max_pool_connections,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"mode": "standard", "total_max_attempts": 1},
            s3={"addressing_style": addressing_style or ("path" if endpoint_url else "auto")},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        try:
            if session is None:
                session = boto3.session.Session(profile_name=profile)
            self._client: Any = session.client(
                "s3",
                endpoint_url=endpoint_url,
                region_name=region or session.region_name or "us-east-1",
                aws_access_key_id=access_key_id,
                aws_secret_access_key=secret_access_key,
                aws_session_token=session_token,
                config=config,
            )
        except (botocore.exceptions.BotoCoreError, ValueError) as err:
            raise ConfigError(f"cannot configure S3 client for {self.url}: {err}") from err

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint_url={self.endpoint_url!r})"

    # --- plumbing ---------------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        try:
            return self.retry.call(fn, f"S3 {op} {self.url}/{key}")
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as err:
            raise translate(err, f"{self.url}: {op} {key!r}", self.bucket) from err
        except OSError as err:  # urllib3/builtin connection errors that botocore did not wrap
            if isinstance(err, StoreError):
                raise
            raise translate(err, f"{self.url}: {op} {key!r}", self.bucket) from err

    def _write(self, key: str, data: bytes, op: str, **condition: str) -> tuple[str | None, bool]:
        """Write the object, under an optional S3 condition (``IfNoneMatch``/``IfMatch``).

        Return ``(etag, retried)``: ``etag`` is None if the precondition failed, ``retried`` says
        whether the committing request was sent more than once (so its outcome was ambiguous).
        """
        if len(data) > self.multipart_threshold:
            return self._write_multipart(key, data, op, condition)
        full = self._full(key)
        attempts = 0

        def put() -> Any:
            nonlocal attempts
            attempts += 1
            return self._client.put_object(Bucket=self.bucket, Key=full, Body=data, **condition)

        try:
            return strip_etag(self._call(op, key, put)["ETag"]), attempts > 1
        except StoreError as err:
            if is_precondition(err):
                return None, attempts > 1
            raise

    def _write_multipart(
        self, key: str, data: bytes, op: str, condition: dict[str, str]
    ) -> tuple[str | None, bool]:
        attempts = 0

        def counted(fn: Callable[[], Any]) -> Any:
            def once() -> Any:
                nonlocal attempts
                attempts += 1
                return fn()

            return self._call(op, key, once)

        try:
            resp = s3_multipart.upload(
                self._client,
                self.bucket,
                self._full(key),
                data,
                condition=condition,
                part_size=self.part_size,
                concurrency=self.multipart_concurrency,
                call=functools.partial(self._call, op, key),
                call_complete=counted,
            )
        except StoreError as err:
            if is_precondition(err):
                return None, attempts > 1
            if attempts > 1 and is_code(err, "NoSuchUpload"):  # an earlier attempt completed it
                return None, True
            raise
        return strip_etag(resp["ETag"]), attempts > 1

    def _holds(self, key: str, data: bytes) -> str | None:
        """The object's ETag if it exists and holds exactly ``data``, else None.

        Decided from ``HEAD`` when the size differs or the ETag is the one S3 computes for these
        bytes (MD5, or MD5 of part MD5s); only an unrecognised ETag (e.g. SSE-KMS) costs a read.
        """
        try:
            info = self.head(key)
        except ObjectNotFound:
            return None
        if info.size != len(data):
            return None
        if info.etag == self.predicted_etag(data):
            return info.etag
        full = self._full(key)

        def read() -> tuple[bytes, str]:
            resp = self._client.get_object(Bucket=self.bucket, Key=full)
            return resp["Body"].read(), strip_etag(resp["ETag"])

        try:
            body, etag = self._call("get", key, read)
        except ObjectNotFound:
            return None
        return etag if body == data else None

    def predicted_etag(self, data: bytes) -> str:
        """The ETag this store's upload of ``data`` gets from S3 (without SSE-KMS)."""
        return s3_multipart.predicted_etag(data, self.multipart_threshold, self.part_size)

    # --- ObjectStore ------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        full = self._full(key)

        def read() -> bytes:
            resp = self._client.get_object(Bucket=self.bucket, Key=full)
            body: bytes = resp["Body"].read()
            return body

        return self._call("get", key, read)

    def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        full = self._full(key)
        check_range_args(key, start, end)
        if end == start:
            size = self.head(key).size
            if start > size:
                raise InvalidRange(f"{self.url}: {key!r}: range start {start} beyond size {size}")
            return b""
        header = f"bytes={start}-" if end is None else f"bytes={start}-{end - 1}"

        def read() -> bytes:
            resp = self._client.get_object(Bucket=self.bucket, Key=full, Range=header)
            body: bytes = resp["Body"].read()
            if "ContentRange" not in resp:  # a server that ignored Range sent the whole object
                return body[start:end]
            return body

        try:
            return self._call("get_range", key, read)
        except InvalidRange:
            size = self.head(key).size
            if start == size:
                return b""
            raise InvalidRange(f"{self.url}: {key!r}: range start {start} beyond size {size}") from None

    def head(self, key: str) -> ObjectInfo:
        full = self._full(key)
        resp = self._call("head", key, lambda: self._client.head_object(Bucket=self.bucket, Key=full))
        return ObjectInfo(key=key, size=int(resp["ContentLength"]), etag=strip_etag(resp["ETag"]))

    def put(self, key: str, data: bytes) -> str:
        etag, _ = self._write(key, data, "put")
        assert etag is not None  # no condition, so no precondition to fail
        return etag

    def put_if_absent(self, key: str, data: bytes) -> str:
        etag, retried = self._write(key, data, "put_if_absent", IfNoneMatch="*")
        if etag is None and retried:
            etag = self._holds(key, data)  # our earlier, unacknowledged attempt may have landed
            if etag is not None:
                log.info("%s/%s: conditional create landed on an earlier attempt", self.url, key)
        if etag is None:
            raise ObjectExists(f"{self.url}: object {key!r} already exists")
        return etag

    def put_stream_if_absent(self, key: str, chunks: Iterable[Any]) -> str:
        """Stream ``chunks`` up as a conditional (``If-None-Match: *``) multipart upload, parts going
        up while the producer continues; a short object is one conditional PUT. ``ObjectExists``
        if the key is taken (a retried, unacknowledged completion is not re-checked byte for byte:
        the caller's keys carry its writer epoch, so a taken key is its own earlier attempt or a
        conflict it reports)."""
        full = self._full(key)

        def put_small(data: bytes) -> Any:
            return self._call("put_if_absent", key, lambda: self._client.put_object(Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*"))

        try:
            resp = s3_multipart.upload_stream(
                self._client, self.bucket, full, chunks, condition={"IfNoneMatch": "*"}, part_size=self.part_size,
                concurrency=self.multipart_concurrency, call=functools.partial(self._call, "put_if_absent", key),
                call_complete=functools.partial(self._call, "put_if_absent", key), put_small=put_small,
            )  # fmt: skip
        except StoreError as err:
            if is_precondition(err):
                raise ObjectExists(f"{self.url}: object {key!r} already exists") from err
            raise
        return strip_etag(resp["ETag"])

    def cas(self, key: str, data: bytes, expected_etag: str | None) -> str:
        if expected_etag is None:
            etag, retried = self._write(key, data, "cas", IfNoneMatch="*")
        else:
            etag, retried = self._write(key, data, "cas", IfMatch=f'"{strip_etag(expected_etag)}"')
        if etag is not None:
            return etag
        if retried:
            etag = self._holds(key, data)
            if etag is not None:
                log.info("%s/%s: compare-and-swap landed on an earlier attempt", self.url, key)
                return etag
        if expected_etag is not None and not self.exists(key):
            raise ObjectNotFound(f"{self.url}: no object {key!r} to compare-and-swap")
        want = "absent" if expected_etag is None else f"ETag {expected_etag}"
        raise PreconditionFailed(f"{self.url}: {key!r} changed (expected {want})")

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except ObjectNotFound:
            return False
        return True

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_prefix(prefix)
        root = f"{self.prefix}/" if self.prefix else ""
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {
                "Bucket": self.bucket,
                "Prefix": root + prefix,
                "MaxKeys": self.list_page_size,
            }
            if token:
                kwargs["ContinuationToken"] = token
            page: dict[str, Any] = self._call(
                "list", prefix, functools.partial(self._client.list_objects_v2, **kwargs)
            )
            for obj in page.get("Contents", ()):
                yield obj["Key"][len(root) :]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def delete(self, key: str) -> None:
        full = self._full(key)
        self._call("delete", key, lambda: self._client.delete_object(Bucket=self.bucket, Key=full))

    def pending_writes(self, prefix: str = "") -> Iterator[PendingWrite]:
        validate_prefix(prefix)
        root = f"{self.prefix}/" if self.prefix else ""

        def call(fn: Callable[[], Any]) -> Any:
            return self._call("list uploads", prefix, fn)

        for key, upload_id, initiated, size in s3_multipart.pending_uploads(self._client, self.bucket, root + prefix, call):
            yield PendingWrite(key=key[len(root) :], size=size, touched_at=initiated, handle=upload_id)

    def abort_pending(self, write: PendingWrite) -> None:
        full = self._full(write.key)
        try:
            self._call("abort upload", write.key, lambda: self._client.abort_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=write.handle))  # fmt: skip
        except StoreError as err:
            if not is_code(err, "NoSuchUpload", "404"):
                raise

    def close(self) -> None:
        self._client.close()

    # --- administration (tests, setup scripts) ----------------------------------------------------

    def create_bucket(self) -> None:
        """Create the bucket if it does not exist (for tests and first-time setup)."""
        try:
            self._call("create_bucket", "", lambda: self._client.create_bucket(Bucket=self.bucket))
        except StoreError as err:
            if not is_code(err, "BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
