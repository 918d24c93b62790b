"""The coordinator's HTTP service (aiohttp): the scheduler behind a JSON API, its records in the store.

Routes (JSON bodies are the models in :mod:`deltarl.protocol.records`)::

    POST /register            actor    RegisterRequest  -> Registered (with the actor's secret)
    POST /lease               secret   LeaseRequest     -> LeaseResponse
    POST /result              secret   RolloutResult    -> Ack (409 with the Ack's reason if rejected)
    POST /heartbeat           secret   HeartbeatRequest -> {}
    POST /steps               trainer  StepSpec         -> StepOpened
    GET  /steps/{n}/results   trainer  ?timeout=S       -> StepResults (long-poll until complete or S)
    GET  /status              any      fleet view: actors, EMA speeds, shares, leases, steps, counters
    GET  /metrics             any      the same as Prometheus text

Every request carries ``Authorization: Bearer <token>``; an unknown token gets 401, a token of the
wrong role 403. The shared actor token only registers: ``/register`` answers with a per-actor
secret, and ``/lease``, ``/result`` and ``/heartbeat`` need that secret (403 with the shared token,
or when the body names another actor). Only the secret's sha256 is stored, in the actor's record.

Input: bodies over ``service.max_body_bytes`` get 413 (a declared Content-Length at once); bad JSON,
JSON nested too deep, booleans for integers and numbers out of range get 400 ``malformed``; a NaN or
infinity anywhere gets 400 ``non_finite``. Store I/O runs in worker threads; the scheduler is touched only on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from deltarl.coordinator.config import CoordinatorConfig
from deltarl.coordinator.metrics import CoordinatorMetrics
from deltarl.coordinator.persistence import CoordinatorStore, build_manifest, recover
from deltarl.coordinator.scheduler import Reason, Scheduler
from deltarl.coordinator.views import fleet_status
from deltarl.errors import (
    CoordinatorError,
    DeltaRLError,
    FormatError,
    NonFiniteValue,
    RecordConflict,
    StoreError,
    UnknownActor,
    UnknownStep,
)
from deltarl.protocol.records import (
    MAX_STEP,
    Ack,
    AdmittedRecord,
    HeartbeatRequest,
    LeaseGrant,
    LeaseRequest,
    LeaseResponse,
    Record,
    Registered,
    RegisterRequest,
    RolloutResult,
    StepManifest,
    StepOpened,
    StepResults,
    StepSpec,
    decode,
    sha256_of,
)
from deltarl.storage.store import ObjectStore

log = logging.getLogger(__name__)

Results = dict[str, tuple[str, AdmittedRecord]]
T = TypeVar("T")


class Coordinator:
    """Scheduler + durable records: the service's logic, independent of HTTP (async)."""

    def __init__(self, store: ObjectStore, run: str, config: CoordinatorConfig | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config or CoordinatorConfig()
        self.cstore = CoordinatorStore(store, run)
        self.run = self.cstore.run
        self._clock = clock
        self.scheduler = Scheduler(self.config.scheduler, clock=clock)
        self._results: dict[int, Results] = {}
        self._closed: OrderedDict[int, tuple[StepManifest, Results]] = OrderedDict()  # the last few closed steps
        self._done: dict[int, asyncio.Event] = {}
        self._pending: dict[str, asyncio.Task[Ack]] = {}
        self._closing: set[int] = set()
        self._tick_task: asyncio.Task[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._secrets: dict[str, str] = {}  # sha256 of an actor's secret -> its actor id
        self.started_at = clock()

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking store I/O on the coordinator's thread pool."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.service.io_threads, thread_name_prefix="coordinator-io")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def start(self) -> None:
        """Rebuild state from the store, close steps left complete, start the expiry ticker."""
        rec = await self._io(recover, self.cstore.store, self.run, self.config.scheduler, self._clock)
        self.scheduler = rec.scheduler
        self._results = rec.results
        self._secrets = {a.record.secret_sha256: aid for aid, a in self.scheduler.actors.items()
                         if a.record.secret_sha256 is not None}
        for step in rec.to_close:
            await self._close_step(step)
        self._tick_task = asyncio.create_task(self._ticker(), name="coordinator-ticker")

    async def stop(self) -> None:
        if self._tick_task is not None:
            self._tick_task.cancel()
            await asyncio.gather(self._tick_task, return_exceptions=True)
            self._tick_task = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.config.service.tick_interval_s)
            self.scheduler.tick()
            for step in self.scheduler.open_steps():  # a manifest write that failed is retried here
                if self.scheduler.steps[step].complete and step not in self._closing:
                    try:
                        await self._close_step(step)
                    except DeltaRLError as err:
                        log.warning("closing step %d failed, will retry: %s", step, err)

    # --- actors -----------------------------------------------------------------------------------

    async def register(self, req: RegisterRequest) -> Registered:
        secret = secrets.token_urlsafe(32)
        digest = _secret_digest(secret)
        record = self.scheduler.new_actor(req.region, req.backend, req.capabilities)
        record = record.model_copy(update={"secret_sha256": digest})
        await self._io(self.cstore.put_actor, record)
        self.scheduler.add_actor(record)
        self._secrets[digest] = record.actor_id
        log.info("registered actor %s (%s, %s)", record.actor_id, req.region, req.backend)
        return Registered(actor_id=record.actor_id, heartbeat_interval_s=self.config.scheduler.heartbeat_interval_s,
                          actor_secret=secret)

    def actor_of_secret(self, secret: str) -> str | None:
        """The actor a per-actor secret belongs to, or ``None``."""
        return self._secrets.get(_secret_digest(secret))

    async def heartbeat(self, req: HeartbeatRequest) -> None:
        self.scheduler.heartbeat(req.actor_id)

    async def leave(self, req: HeartbeatRequest) -> None:
        """The actor stopped cleanly (SIGTERM, Ctrl-C): counted as left, not died."""
        self.scheduler.leave(req.actor_id)

    async def lease(self, req: LeaseRequest) -> LeaseResponse:
        rec = self.scheduler.request_lease(req.actor_id, req.max_prompts)
        if rec is None:
            return LeaseResponse(grant=None, retry_after_s=min(1.0, self.config.scheduler.heartbeat_interval_s))
        try:
            await self._io(self.cstore.put_lease, rec)
        except BaseException:
            self.scheduler.cancel_lease(rec.lease_id)
            raise
        spec = self.scheduler.steps[rec.step].spec
        prompts = self.scheduler.prompts_of(rec)
        return LeaseResponse(grant=LeaseGrant(lease=rec, prompts=prompts, accepted_versions=spec.accepted_versions))

    async def report(self, result: RolloutResult) -> Ack:
        """Admit a result (durably, then acknowledge) or say why not."""
        pending = self._pending.get(result.lease_id)
        if pending is not None:  # the same lease is being written: wait, then answer as a retry
            await asyncio.wait([pending])
        digest = sha256_of(result)
        d = self.scheduler.begin_admission(result, digest)
        if d.kind == "reject":
            assert d.reason is not None
            log.info("rejected result of lease %s from %s: %s", result.lease_id, result.actor_id, d.reason.value)
            return Ack(admitted=False, reason=d.reason.value, message=d.message)
        if d.kind == "duplicate":
            return Ack(admitted=True, duplicate=True, key=d.key)
        assert d.lease is not None
        record = AdmittedRecord(step=result.step, result=result, lease=d.lease, admitted_at=d.at,
                                result_sha256=digest)
        # The admission runs as its own task: a client that disconnects (cancelling this handler)
        # cannot leave a record in the store that the scheduler does not count.
        task = asyncio.create_task(self._admit(record), name=f"admit-{result.lease_id}")
        self._pending[result.lease_id] = task
        task.add_done_callback(lambda _: self._pending.pop(result.lease_id, None))
        return await asyncio.shield(task)

    async def _admit(self, record: AdmittedRecord) -> Ack:
        lease_id, step = record.lease.lease_id, record.step
        try:
            key = await self._io(self.cstore.put_admitted, record)
        except RecordConflict as err:
            self.scheduler.abort_admission(lease_id)
            return Ack(admitted=False, reason=Reason.ALREADY_ADMITTED.value, message=str(err))
        except BaseException:
            self.scheduler.abort_admission(lease_id)
            raise
        complete = self.scheduler.complete_admission(record, key)
        self._results.setdefault(step, {})[lease_id] = (key, record)
        if complete:
            await self._close_step(step)
        return Ack(admitted=True, key=key)

    # --- trainer ----------------------------------------------------------------------------------

    async def open_step(self, spec: StepSpec) -> StepOpened:
        if spec.opened_at is None:
            spec = spec.model_copy(update={"opened_at": self._clock()})
        self.scheduler.check_spec(spec)
        existing = self.scheduler.steps.get(spec.step)
        if existing is not None:
            if not existing.spec.same_request(spec):
                raise CoordinatorError(f"step {spec.step} is already open with other prompts or versions")
            return StepOpened(step=spec.step, created=False, closed=existing.closed)
        stored = await self._io(self.cstore.put_spec, spec)
        if await self._io(self.cstore.manifest, spec.step) is not None:
            return StepOpened(step=spec.step, created=False, closed=True)
        created = self.scheduler.open_step(stored)
        self._results.setdefault(spec.step, {})
        log.info("opened step %d: %d prompts, versions %s", spec.step, len(spec.prompts),
                 [v[:12] for v in spec.accepted_versions])
        return StepOpened(step=spec.step, created=created and stored is spec)

    async def _close_step(self, step: int) -> None:
        if step in self._closing:
            return
        self._closing.add(step)
        try:
            results = self._results.get(step, {})
            spec = self.scheduler.steps[step].spec
            manifest = await self._io(self.cstore.put_manifest, build_manifest(spec, results.values(), closed_at=self._clock()))
        finally:
            self._closing.discard(step)
        self._results.pop(step, None)
        self.scheduler.close_step(step)
        self._closed[step] = (manifest, results)
        while len(self._closed) > self.config.service.keep_closed_steps:
            old, _ = self._closed.popitem(last=False)
            self.scheduler.forget_step(old)
            self._done.pop(old, None)
        self._event(step).set()
        log.info("closed step %d: %d results, %d tokens", step, len(results), manifest.tokens)

    def _event(self, step: int) -> asyncio.Event:
        return self._done.setdefault(step, asyncio.Event())

    async def step_results(self, step: int, timeout: float) -> StepResults:
        """Wait up to ``timeout`` s for the step to complete; return its admitted results so far."""
        timeout = max(0.0, min(timeout, self.config.service.long_poll_max_s))
        st = self.scheduler.steps.get(step)
        if st is None or st.closed:
            return await self._closed_results(step)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._event(step).wait(), timeout)
        st = self.scheduler.steps.get(step)
        if st is None or st.closed:
            return await self._closed_results(step)
        records = [r for _, r in sorted(self._results.get(step, {}).values(), key=lambda kr: kr[0])]
        return StepResults(step=step, complete=False, results=records)

    async def _closed_results(self, step: int) -> StepResults:
        cached = self._closed.get(step)
        if cached is not None:  # closed here recently: no store reads
            manifest, results = cached
            records = [r for _, r in sorted(results.values(), key=lambda kr: kr[0])]
            return StepResults(step=step, complete=True, results=records, manifest=manifest)
        stored = await self._io(self.cstore.manifest, step)
        if stored is None:
            raise UnknownStep(f"step {step} is not open and has no manifest")
        records = await self._io(lambda: [decode(AdmittedRecord, self.cstore.store.get(k)) for k in stored.result_keys])
        return StepResults(step=step, complete=True, results=records, manifest=stored)

    def status(self) -> dict[str, Any]:
        out = fleet_status(self.scheduler)
        out.update(run=self.run, store=self.cstore.store.url, uptime_s=round(self._clock() - self.started_at, 3))
        return out



def _secret_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


# --- HTTP ----------------------------------------------------------------------------------------------

COORDINATOR_KEY = web.AppKey("coordinator", Coordinator)
TOKENS_KEY = web.AppKey("tokens", dict)
METRICS_KEY = web.AppKey("metrics", CoordinatorMetrics)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(model: BaseModel | dict[str, Any], status: int = 200) -> web.Response:
    body = model.model_dump_json() if isinstance(model, BaseModel) else None
    if body is None:
        return web.json_response(model, status=status)
    return web.Response(text=body, status=status, content_type="application/json")


def _error(status: int, message: str, reason: str | None = None) -> web.Response:
    return web.json_response({"error": message, "reason": reason}, status=status)


ACTOR_ID_KEY = web.RequestKey("actor_id", str)  # request key: the actor a per-actor secret authenticated


async def _body(request: web.Request, cls: type[Record]) -> Any:
    record = decode(cls, await request.read())
    bound = request.get(ACTOR_ID_KEY)
    named = getattr(record, "actor_id", bound)
    if bound is not None and named != bound:
        raise web.HTTPForbidden(text=f"this secret belongs to actor {bound!r}, not {named!r}")
    return record


def _token_of(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _roles_for(request: web.Request, token: str) -> set[str]:
    """Roles of a token: ``actor``/``trainer`` for shared tokens, ``actor-session`` for an actor's secret."""
    if not token:
        return set()
    roles = set(request.app[TOKENS_KEY].get(token, set()))
    actor_id = request.app[COORDINATOR_KEY].actor_of_secret(token)
    if actor_id is not None:
        request[ACTOR_ID_KEY] = actor_id
        roles.add("actor-session")
    return roles


def _route(role: str | None, fn: Callable[[Coordinator, web.Request], Awaitable[web.StreamResponse]]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        roles = _roles_for(request, _token_of(request))
        if not roles:
            return _error(401, "unknown or missing bearer token", "auth")
        if role is not None and role not in roles:
            if role == "actor-session" and "actor" in roles:
                return _error(403, "the shared actor token only registers: use the secret /register returned", "auth")
            return _error(403, f"this token may not act as {role}", "auth")
        limit = request.app[COORDINATOR_KEY].config.service.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return _error(413, f"body of {request.content_length} bytes, the limit is {limit}", "too_large")
        try:
            return await fn(request.app[COORDINATOR_KEY], request)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"body over the limit of {limit} bytes", "too_large")
        except NonFiniteValue as err:
            return _error(400, str(err), "non_finite")
        except FormatError as err:
            return _error(400, str(err), "malformed")
        except (UnknownActor, UnknownStep) as err:
            return _error(404, str(err), "unknown")
        except CoordinatorError as err:
            return _error(409, str(err), "conflict")
        except StoreError as err:
            log.warning("%s %s: store failure: %s", request.method, request.path, err)
            return _error(503, f"store failure: {err}", "store")

    return handler


async def _register(c: Coordinator, r: web.Request) -> web.Response:
    return _json(await c.register(await _body(r, RegisterRequest)))


async def _lease(c: Coordinator, r: web.Request) -> web.Response:
    return _json(await c.lease(await _body(r, LeaseRequest)))


async def _result(c: Coordinator, r: web.Request) -> web.Response:
    ack = await c.report(await _body(r, RolloutResult))
    return _json(ack, status=200 if ack.admitted else 409)


async def _heartbeat(c: Coordinator, r: web.Request) -> web.Response:
    await c.heartbeat(await _body(r, HeartbeatRequest))
    return web.json_response({})


async def _leave(c: Coordinator, r: web.Request) -> web.Response:
    await c.leave(await _body(r, HeartbeatRequest))
    return web.json_response({})


async def _open_step(c: Coordinator, r: web.Request) -> web.Response:
    return _json(await c.open_step(await _body(r, StepSpec)))


async def _step_results(c: Coordinator, r: web.Request) -> web.Response:
    raw_step = r.match_info["step"]
    try:
        step = int(raw_step) if raw_step.isdigit() and len(raw_step) <= 12 else -1
        timeout = float(r.query.get("timeout", "0"))
    except ValueError as err:
        raise FormatError(f"bad step or timeout: {err}") from err
    if not 0 <= step <= MAX_STEP:
        raise FormatError(f"step {raw_step[:40]!r} is not an integer in [0, {MAX_STEP}]")
    if not math.isfinite(timeout) or timeout < 0:
        raise FormatError(f"timeout={timeout} is not a finite number >= 0")
    return _json(await c.step_results(step, timeout))


async def _status(c: Coordinator, r: web.Request) -> web.Response:
    return web.json_response(c.status())


async def _metrics(c: Coordinator, r: web.Request) -> web.Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    body = r.app[METRICS_KEY].render(c.scheduler)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(coordinator: Coordinator, *, start: bool = True) -> web.Application:
    """The aiohttp app; with ``start`` it recovers state on startup and stops the ticker on cleanup."""
    svc = coordinator.config.service
    tokens: dict[str, set[str]] = {}
    for t in svc.actor_tokens:
        tokens.setdefault(t, set()).add("actor")
    for t in svc.trainer_tokens:
        tokens.setdefault(t, set()).add("trainer")
    app = web.Application(client_max_size=svc.max_body_bytes)
    app[COORDINATOR_KEY] = coordinator
    app[TOKENS_KEY] = tokens
    app[METRICS_KEY] = CoordinatorMetrics()
    app.router.add_post("/register", _route("actor", _register))
    app.router.add_post("/lease", _route("actor-session", _lease))
    app.router.add_post("/result", _route("actor-session", _result))
    app.router.add_post("/heartbeat", _route("actor-session", _heartbeat))
    app.router.add_post("/leave", _route("actor-session", _leave))
    app.router.add_post("/steps", _route("trainer", _open_step))
    app.router.add_get("/steps/{step}/results", _route("trainer", _step_results))
    app.router.add_get("/status", _route(None, _status))
    app.router.add_get("/metrics", _route(None, _metrics))
    if start:
        async def _startup(_: web.Application) -> None:
            await coordinator.start()

        async def _cleanup(_: web.Application) -> None:
            await coordinator.stop()

        app.on_startup.append(_startup)
        app.on_cleanup.append(_cleanup)
    return app
