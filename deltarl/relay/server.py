"""The relay's HTTP face (aiohttp): objects at their store keys, ranges, long-poll, pushes, metrics.

* ``GET/HEAD /<key>`` — an object; ``Range: bytes=a-b`` → 206 with ``Content-Range`` (416 if
  unsatisfiable); ``?wait=S`` holds a request for an object that does not exist yet.
  Immutable objects carry ``Cache-Control: public, max-age=31536000, immutable``; mutable ones
  (``<run>/HEAD``) ``no-cache``, and a ``GET`` with ``If-None-Match`` and ``?wait=`` is answered
  when the ETag changes (304 if it did not within the wait).
  Segments and keyframe parts are served verified: only once a committed manifest names them
  (a plain GET of one not named yet is 404, or waits with ``?wait=``), and no byte before it was
  checked against the manifest's piece hashes. ``?unverified=1`` serves such objects at once and
  unchecked, for clients that verify themselves (deltarl's speculative prefetch, chained relays).
* ``PUT /<key>`` (bearer token) — forwarded upstream: ``If-None-Match: *`` → put-if-absent,
  ``If-Match: "etag"`` → compare-and-swap; 412 when the condition fails. ``DELETE`` likewise.
* ``GET /?prefix=P`` — ``{"keys": [...]}``; ``GET /metrics`` — Prometheus text; ``GET /healthz``.
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from deltarl.errors import (
    DeltaRLError,
    IntegrityError,
    InvalidKey,
    InvalidRange,
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    RangeNotSatisfiable,
    StoreError,
)
from deltarl.pipeline.layout import is_immutable
from deltarl.relay.bodies import CachedBody
from deltarl.relay.config import RelayConfig
from deltarl.relay.metrics import RelayMetrics
from deltarl.relay.objects import ObjectService
from deltarl.relay.ranges import parse_range
from deltarl.storage.aio import AsyncSource, make_async_source
from deltarl.storage.keys import strip_etag, validate_key, validate_prefix
from deltarl.storage.store import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

SERVICE = web.AppKey("service", ObjectService)
METRICS = web.AppKey("metrics", RelayMetrics)
CONFIG = web.AppKey("config", RelayConfig)

IMMUTABLE_CACHE_CONTROL = "public, max-age=31536000, immutable"
MUTABLE_CACHE_CONTROL = "no-cache"
RESERVED = frozenset({"metrics", "healthz"})
#: Top-level names a store keeps for itself (temp and lock files): never objects, never listed.
INTERNAL = ".deltarl-tmp"
#: Longest key served (S3's limit); longer paths get a short 400.
MAX_KEY_BYTES = 1024
_ENCODED_SEPARATORS = re.compile(r"%(2e|2f|5c|00)", re.IGNORECASE)


def is_internal(key: str) -> bool:
    """Whether ``key`` (or prefix) lies under a store's internal names."""
    return key == INTERNAL or key.startswith(INTERNAL + "/")


def key_of(request: web.Request) -> str:
    """The object key a request names, refusing anything outside the namespace (short 400s; an
    internal name is 404, as if it did not exist)."""
    raw = request.raw_path.split("?", 1)[0]
    if len(raw) > 3 * MAX_KEY_BYTES:
        raise web.HTTPBadRequest(text=f"key longer than {MAX_KEY_BYTES} bytes")
    if _ENCODED_SEPARATORS.search(raw):
        raise web.HTTPBadRequest(text="encoded '.', '/', '\\' or NUL in the key")
    if not raw.startswith("/") or any(part in ("", ".", "..") for part in raw[1:].split("/")):
        raise web.HTTPBadRequest(text="key has an empty, '.' or '..' part")
    try:
        key = unquote(raw[1:], errors="strict")
    except UnicodeDecodeError as err:
        raise web.HTTPBadRequest(text="key is not UTF-8 after percent-decoding") from err
    if len(key.encode()) > MAX_KEY_BYTES:
        raise web.HTTPBadRequest(text=f"key longer than {MAX_KEY_BYTES} bytes")
    try:
        validate_key(key)
    except InvalidKey as err:
        raise web.HTTPBadRequest(text=str(err)[:200]) from err
    if is_internal(key):
        raise web.HTTPNotFound(text="no such object")
    return key


def _wait_of(request: web.Request) -> float:
    raw = request.query.get("wait")
    if raw is None:
        return 0.0
    try:
        wait = float(raw)
    except ValueError as err:
        raise web.HTTPBadRequest(text=f"bad wait={raw!r}") from err
    if not 0 <= wait <= 3600:
        raise web.HTTPBadRequest(text=f"wait={raw!r} out of range")
    return wait


#: Response header of a 502 whose cause is not transient: the upstream's bytes fail their manifest.
INTEGRITY_HEADER = "X-Deltarl-Error"


def _not_found(request: web.Request, err: ObjectNotFound) -> web.HTTPNotFound:
    """A 404 that says why, but never where the relay's upstream lives (a path or a host)."""
    upstream = request.app[SERVICE].upstream.url
    return web.HTTPNotFound(text=str(err).replace(upstream, "the relay's upstream")[:300])


def _object_headers(key: str, etag: str) -> dict[str, str]:
    return {
        "ETag": f'"{etag}"',
        "Accept-Ranges": "bytes",
        "Cache-Control": IMMUTABLE_CACHE_CONTROL if is_immutable(key) else MUTABLE_CACHE_CONTROL,
        "Content-Type": "application/octet-stream",
    }


# --- reads ----------------------------------------------------------------------------------------


async def handle_get(request: web.Request) -> web.StreamResponse:
    key = key_of(request)
    if not is_immutable(key):
        return await _get_mutable(request, key)
    service, metrics = request.app[SERVICE], request.app[METRICS]
    wait = _wait_of(request)
    if request.method == "HEAD":
        try:
            size, etag = await service.stat(key, wait=wait)
        except ObjectNotFound as err:
            raise _not_found(request, err) from err
        except InvalidKey as err:
            raise web.HTTPBadRequest(text=str(err)[:200]) from err
        except StoreError as err:
            raise web.HTTPBadGateway(text=str(err)[:200]) from err
        resp = web.StreamResponse(headers=_object_headers(key, etag))
        resp.content_length = size
        await resp.prepare(request)
        return resp
    unverified = request.query.get("unverified", "") in ("1", "true", "yes")
    try:
        body = await service.open(key, wait=wait, unverified=unverified)
    except IntegrityError as err:  # not transient: the client should fall back, not retry
        raise web.HTTPBadGateway(text=str(err)[:300], headers={INTEGRITY_HEADER: "integrity"}) from err
    except ObjectNotFound as err:
        raise _not_found(request, err) from err
    except InvalidKey as err:  # a key this upstream refuses
        raise web.HTTPBadRequest(text=str(err)[:200]) from err
    except StoreError as err:
        raise web.HTTPBadGateway(text=str(err)[:200]) from err
    try:
        try:
            rng = parse_range(request.headers.get("Range"), body.size)
        except RangeNotSatisfiable as err:
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{body.size}"}, text=str(err)) from err
        start, end = rng if rng is not None else (0, body.size)
        resp = web.StreamResponse(status=206 if rng else 200, headers=_object_headers(key, body.etag))
        if rng is not None:
            resp.headers["Content-Range"] = f"bytes {start}-{end - 1}/{body.size}"
        resp.content_length = end - start
        await resp.prepare(request)
        try:
            if isinstance(body, CachedBody) and not body.checks(start, end) and request.transport is not None and end > start:
                # a cached range the client checks by its pieces: from the file to the socket, no copy
                metrics.bytes_out.inc(await body.sendfile(request.transport, start, end))
            else:
                async for chunk in body.read(start, end):
                    await resp.write(chunk)
                    metrics.bytes_out.inc(len(chunk))
        except DeltaRLError as err:
            # Headers are out: the only honest signal left is to cut the connection short.
            log.warning("aborting response for %s: %s", key, err)
            if request.transport is not None:
                request.transport.abort()
            return resp
        except (ConnectionResetError, BrokenPipeError):  # the client went away (e.g. a cancelled long-poll): nothing to tell it
            log.debug("client left during %s", key)
            return resp
        await resp.write_eof()
        return resp
    finally:
        body.close()


async def _get_mutable(request: web.Request, key: str) -> web.StreamResponse:
    service = request.app[SERVICE]
    wait = _wait_of(request)
    inm = request.headers.get("If-None-Match")
    etag = strip_etag(inm) if inm else None
    try:
        if wait > 0:
            value = await service.mutable.wait(key, etag=etag, wait=wait)
        else:
            value = await service.mutable.get(key)
    except InvalidKey as err:
        raise web.HTTPBadRequest(text=str(err)[:200]) from err
    except StoreError as err:
        raise web.HTTPBadGateway(text=str(err)) from err
    if value.data is None:
        raise web.HTTPNotFound(text=f"{key} does not exist")
    headers = _object_headers(key, value.etag)
    if etag is not None and value.etag == etag:
        return web.Response(status=304, headers=headers)
    if request.method == "HEAD":
        resp = web.StreamResponse(headers=headers)
        resp.content_length = len(value.data)
        await resp.prepare(request)
        return resp
    request.app[METRICS].bytes_out.inc(len(value.data))
    return web.Response(body=value.data, headers=headers)


async def handle_list(request: web.Request) -> web.Response:
    prefix = request.query.get("prefix", "")
    if len(prefix.encode()) > MAX_KEY_BYTES:
        raise web.HTTPBadRequest(text=f"prefix longer than {MAX_KEY_BYTES} bytes")
    try:
        validate_prefix(prefix)
        keys = [] if is_internal(prefix) else await request.app[SERVICE].upstream.list(prefix)
    except InvalidKey as err:
        raise web.HTTPBadRequest(text=str(err)[:200]) from err
    except StoreError as err:
        raise web.HTTPBadGateway(text=str(err)[:200]) from err
    return web.json_response({"keys": [k for k in keys if not is_internal(k)]})


async def handle_metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), content_type="text/plain", charset="utf-8")


async def handle_health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True, "upstream": request.app[SERVICE].upstream.url})


# --- pushes ---------------------------------------------------------------------------------------


def _authorize(request: web.Request) -> None:
    config = request.app[CONFIG]
    if config.token is None:
        if config.allow_anonymous_push:
            return
        raise web.HTTPForbidden(text="this relay accepts no pushes (start it with --token)")
    got = request.headers.get("Authorization", "")
    if not hmac.compare_digest(got.encode(), f"Bearer {config.token}".encode()):
        raise web.HTTPUnauthorized(text="bad or missing bearer token")


async def handle_put(request: web.Request) -> web.Response:
    _authorize(request)
    key = key_of(request)
    if key in RESERVED:
        raise web.HTTPBadRequest(text=f"{key!r} is reserved")
    data = await request.read()
    inm = request.headers.get("If-None-Match")
    im = request.headers.get("If-Match")
    service = request.app[SERVICE]
    etag: str | None = None
    try:
        etag = await service.upstream.put(
            key, data, if_none_match=inm is not None and inm.strip() == "*", if_match=strip_etag(im) if im else None
        )
    except (ObjectExists, PreconditionFailed) as err:
        raise web.HTTPPreconditionFailed(text=str(err)) from err
    except ObjectNotFound as err:
        raise web.HTTPNotFound(text=str(err)) from err
    except (InvalidKey, InvalidRange) as err:
        raise web.HTTPBadRequest(text=str(err)) from err
    except StoreError as err:
        raise web.HTTPBadGateway(text=str(err)) from err
    finally:  # also after a failure: the key may have changed upstream all the same
        service.landed(key, None if etag is None else ObjectInfo(key=key, size=len(data), etag=etag))
    return web.Response(status=201, headers={"ETag": f'"{etag}"'})


async def handle_delete(request: web.Request) -> web.Response:
    _authorize(request)
    key = key_of(request)
    service = request.app[SERVICE]
    try:
        await service.upstream.delete(key)
    except StoreError as err:
        raise web.HTTPBadGateway(text=str(err)) from err
    finally:
        service.landed(key, None)
    return web.Response(status=204)


# --- the app --------------------------------------------------------------------------------------


class RequestLog(logging.LoggerAdapter):
    """aiohttp's server log, with a malformed request (the client's HTTP error, answered 400) as one
    INFO line instead of an ERROR traceback; anything else as aiohttp logs it."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            first = str(exc_info.message).strip().splitlines()[0] if exc_info.message else type(exc_info).__name__
            self.logger.info("%s: malformed request answered %s: %s", str(msg) % args, exc_info.code, first[:200])
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)


def request_log() -> RequestLog:
    """The logger a relay's aiohttp server is built with (``web.AppRunner(..., logger=request_log())``)."""
    return RequestLog(logging.getLogger("aiohttp.server"), {})



@web.middleware
async def _count(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    metrics = request.app[METRICS]
    try:
        resp = await handler(request)
    except web.HTTPException as exc:
        metrics.requests.labels(request.method, str(exc.status)).inc()
        raise
    metrics.requests.labels(request.method, str(resp.status)).inc()
    return resp


def create_app(upstream: str | ObjectStore | AsyncSource, config: RelayConfig) -> web.Application:
    """A relay application over ``upstream`` (a store, a store URL, or another relay's URL)."""
    up = make_async_source(
        upstream, token=config.upstream_token, poll_interval_s=config.poll_interval_s, connections=config.upstream_connections
    )
    metrics = RelayMetrics()
    app = web.Application(middlewares=[_count], client_max_size=1 << 40)
    app[CONFIG] = config
    app[METRICS] = metrics
    app[SERVICE] = ObjectService(up, config, metrics)

    async def cleanup(app: web.Application) -> None:
        await app[SERVICE].close()

    app.on_cleanup.append(cleanup)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/healthz", handle_health)
    app.router.add_get("/", handle_list)
    app.router.add_get("/{key:.+}", handle_get)  # also answers HEAD
    app.router.add_put("/{key:.+}", handle_put)
    app.router.add_delete("/{key:.+}", handle_delete)
    return app
