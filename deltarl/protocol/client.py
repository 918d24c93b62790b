"""Typed clients of the coordinator's HTTP API: :class:`CoordinatorClient` (async) and
:class:`SyncCoordinatorClient` (a blocking wrapper for actor/trainer loops that are not async).

Auth: the client is built with the shared actor token (or the trainer's); :meth:`register` keeps the
per-actor secret the coordinator returns, and every later call about that actor carries it.

Errors: 401/403 raise :class:`~deltarl.errors.AuthError`; a rejected result raises
:class:`~deltarl.errors.AdmissionRejected` with the coordinator's reason code; other refusals raise
:class:`~deltarl.errors.CoordinatorError` (``UnknownActor`` for a 404 on an actor call).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import aiohttp

from deltarl.errors import (
    AdmissionReason,
    AdmissionRejected,
    AuthError,
    CoordinatorError,
    FormatError,
    UnknownActor,
)
from deltarl.protocol.records import (
    Ack,
    HeartbeatRequest,
    LeaseGrant,
    LeaseRequest,
    LeaseResponse,
    PromptItem,
    Record,
    Registered,
    RegisterRequest,
    RolloutResult,
    StepOpened,
    StepResults,
    StepSpec,
    decode,
    encode,
)

T = TypeVar("T", bound=Record)
R = TypeVar("R")


class CoordinatorClient:
    """Async client. Use as ``async with CoordinatorClient(url, token) as c: ...`` (or call close)."""

    def __init__(self, base_url: str, token: str, *, session: aiohttp.ClientSession | None = None,
                 timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._secrets: dict[str, str] = {}  # actor id -> the per-actor secret /register returned
        self._own_session = session is None
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def actor_secrets(self) -> dict[str, str]:
        """``{actor_id: secret}`` of the actors this client registered (to hand to another client)."""
        return dict(self._secrets)

    def set_actor_secret(self, actor_id: str, secret: str) -> None:
        """Act as ``actor_id`` with the secret its registration returned (e.g. after a restart)."""
        self._secrets[actor_id] = secret

    def _headers_for(self, body: Record | None) -> dict[str, str]:
        secret = self._secrets.get(getattr(body, "actor_id", None) or "")
        if secret is None:
            return self._headers
        return {**self._headers, "Authorization": f"Bearer {secret}"}

    async def _call(self, method: str, path: str, body: Record | None = None,
                    timeout: aiohttp.ClientTimeout | None = None) -> tuple[int, bytes]:
        data = encode(body) if body is not None else None
        headers = self._headers_for(body)
        try:
            async with self._sess().request(method, self.base_url + path, data=data, headers=headers,
                                            timeout=timeout or self._timeout) as resp:
                payload = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise CoordinatorError(f"{method} {path}: {err!r}") from err
        if status == 401 and headers is not self._headers:  # our secret is unknown there: register again
            raise UnknownActor(f"{method} {path}: the coordinator does not know this actor's secret")
        if status in (401, 403):
            raise AuthError(f"{method} {path}: HTTP {status}: {_message(payload)}")
        return status, payload

    async def _typed(self, method: str, path: str, body: Record | None, cls: type[T],
                     timeout: aiohttp.ClientTimeout | None = None) -> T:
        status, payload = await self._call(method, path, body, timeout)
        if status == 404:
            err = UnknownActor if path in ("/lease", "/register") else CoordinatorError
            raise err(f"{method} {path}: {_message(payload)}")
        if status != 200:
            raise CoordinatorError(f"{method} {path}: HTTP {status}: {_message(payload)}")
        return decode(cls, payload)

    # --- actor ------------------------------------------------------------------------------------

    async def register(self, region: str = "", backend: str = "", capabilities: dict[str, Any] | None = None) -> Registered:
        req = RegisterRequest(region=region, backend=backend, capabilities=capabilities or {})
        reg = await self._typed("POST", "/register", req, Registered)
        self._secrets[reg.actor_id] = reg.actor_secret
        return reg

    async def lease(self, actor_id: str, max_prompts: int | None = None) -> LeaseResponse:
        """Ask for work: ``.grant`` is None when there is none now (ask again after ``.retry_after_s``)."""
        return await self._typed("POST", "/lease", LeaseRequest(actor_id=actor_id, max_prompts=max_prompts),
                                 LeaseResponse)

    async def report(self, result: RolloutResult) -> Ack:
        """Report a result; returns the Ack if admitted (or an idempotent duplicate), else raises
        ``AdmissionRejected(reason)``."""
        status, payload = await self._call("POST", "/result", result)
        if status in (200, 409):
            try:
                ack = decode(Ack, payload)
            except FormatError:
                ack = None
            if ack is not None and ack.admitted:
                return ack
            if ack is not None:
                try:
                    reason = AdmissionReason(ack.reason)
                except ValueError:
                    raise CoordinatorError(f"POST /result: rejected with unknown reason {ack.reason!r}: {ack.message}") from None
                raise AdmissionRejected(reason, ack.message)
        raise CoordinatorError(f"POST /result: HTTP {status}: {_message(payload)}")

    async def heartbeat(self, actor_id: str) -> None:
        status, payload = await self._call("POST", "/heartbeat", HeartbeatRequest(actor_id=actor_id))
        if status == 404:
            raise UnknownActor(_message(payload))
        if status != 200:
            raise CoordinatorError(f"POST /heartbeat: HTTP {status}: {_message(payload)}")

    async def leave(self, actor_id: str) -> None:
        """Tell the coordinator this actor stops cleanly (it is then counted as left, not died)."""
        status, payload = await self._call("POST", "/leave", HeartbeatRequest(actor_id=actor_id))
        if status == 404:
            raise UnknownActor(_message(payload))
        if status != 200:
            raise CoordinatorError(f"POST /leave: HTTP {status}: {_message(payload)}")

    # --- trainer ----------------------------------------------------------------------------------

    async def open_step(self, step: int, prompts: list[PromptItem], accepted_versions: list[str]) -> StepOpened:
        spec = StepSpec(step=step, prompts=prompts, accepted_versions=accepted_versions)
        return await self._typed("POST", "/steps", spec, StepOpened)

    async def step_results(self, step: int, timeout: float = 30.0) -> StepResults:
        """Long-poll: returns when the step is complete or after ``timeout`` s (``.complete`` says)."""
        http_timeout = aiohttp.ClientTimeout(total=timeout + self._timeout.total if self._timeout.total else None)
        return await self._typed("GET", f"/steps/{step}/results?timeout={timeout}", None, StepResults, http_timeout)

    async def wait_step(self, step: int, poll_s: float = 30.0, deadline_s: float | None = None) -> StepResults:
        """Long-poll until the step is complete (or ``deadline_s`` passes: ``CoordinatorError``)."""
        loop = asyncio.get_running_loop()
        end = None if deadline_s is None else loop.time() + deadline_s
        while True:
            left = poll_s if end is None else min(poll_s, max(0.0, end - loop.time()))
            res = await self.step_results(step, left)
            if res.complete:
                return res
            if end is not None and loop.time() >= end:
                raise CoordinatorError(f"step {step} not complete after {deadline_s}s")

    async def status(self) -> dict[str, Any]:
        status, payload = await self._call("GET", "/status")
        if status != 200:
            raise CoordinatorError(f"GET /status: HTTP {status}: {_message(payload)}")
        out: dict[str, Any] = json.loads(payload)
        return out


def _message(payload: bytes) -> str:
    text = payload.decode("utf-8", "replace")
    return text[:500]


class SyncCoordinatorClient:
    """Blocking wrapper: runs a :class:`CoordinatorClient` on a private event loop thread."""

    def __init__(self, base_url: str, token: str, timeout_s: float = 30.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="coordinator-client", daemon=True)
        self._thread.start()
        self._client = CoordinatorClient(base_url, token, timeout_s=timeout_s)

    def _run(self, coro: Coroutine[Any, Any, R]) -> R:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        if self._thread.is_alive():
            self._run(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> SyncCoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(self, region: str = "", backend: str = "", capabilities: dict[str, Any] | None = None) -> Registered:
        return self._run(self._client.register(region, backend, capabilities))

    def lease(self, actor_id: str, max_prompts: int | None = None) -> LeaseGrant | None:
        return self._run(self._client.lease(actor_id, max_prompts)).grant

    def report(self, result: RolloutResult) -> Ack:
        return self._run(self._client.report(result))

    def heartbeat(self, actor_id: str) -> None:
        self._run(self._client.heartbeat(actor_id))

    def leave(self, actor_id: str) -> None:
        self._run(self._client.leave(actor_id))

    def open_step(self, step: int, prompts: list[PromptItem], accepted_versions: list[str]) -> StepOpened:
        return self._run(self._client.open_step(step, prompts, accepted_versions))

    def step_results(self, step: int, timeout: float = 30.0) -> StepResults:
        return self._run(self._client.step_results(step, timeout))

    def wait_step(self, step: int, poll_s: float = 30.0, deadline_s: float | None = None) -> StepResults:
        return self._run(self._client.wait_step(step, poll_s, deadline_s))

    def status(self) -> dict[str, Any]:
        return self._run(self._client.status())
