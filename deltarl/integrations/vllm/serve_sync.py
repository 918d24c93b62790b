"""Keep ``vllm serve`` endpoints on a run's HEAD over their HTTP routes (``deltarl serve-sync``).

Each server is started with deltarl's engine and vLLM's RLHF routes (``VLLM_SERVER_DEV_MODE=1``,
``--weight-transfer-config '{"backend": "deltarl"}'``, ``--worker-extension-cls
deltarl.integrations.vllm.worker.DeltaRLWorkerExtension``); :class:`ServeSync` then, for each one
on a thread of its own (a slow or dead server never holds the others):

* **attaches** it (``/init_weight_transfer_engine``: the workers load HEAD from the newest keyframe
  plus deltas) on start, and again whenever the server stops reporting a served version (it
  restarted) or refused an update;
* **stages** each version as soon as HEAD moves (``/start_weight_update``, ``/update_weights``:
  the workers fetch, verify and decode it while the server keeps generating);
* **commits** it with the chosen pause around ``/finish_weight_update`` (:data:`PAUSES`), then
  ``/reset_prefix_cache`` (KV cached under the old weights would give wrong logprobs) and
  ``/update_weight_version`` (so vLLM's ``/weight_info`` names the served deltarl version);
* reads the served version and state digest back (``/collective_rpc`` ``deltarl_status``);
* backs off exponentially on a server that does not answer, and retries it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from deltarl.errors import ConfigError, IntegrationError

log = logging.getLogger(__name__)

Pause = Literal["none", "wait", "abort"]
#: what each pause mode does to the requests in flight when a version is committed
PAUSES: dict[str, str] = {
    "wait": "POST /pause?mode=wait before the commit: new requests queue, the requests in flight run to "
            "their end on the old version, the commit runs on an idle engine, then /resume. No request "
            "spans two versions; the commit waits for the longest request in flight.",
    "abort": "POST /pause?mode=abort: the requests in flight end at once with finish_reason 'abort' "
             "(their partial output is returned), the commit runs, then /resume.",
    "none": "no pause: the commit runs between two engine steps; a request in flight continues on the new "
            "weights (its tokens before the commit came from the old version).",
}


@dataclass
class ServerState:
    """What serve-sync knows of one server."""

    url: str
    version: int | None = None
    version_id: str | None = None
    digest: str | None = None
    up: bool = False
    attached: bool = False
    attaches: int = 0
    updates: int = 0
    failures: int = 0
    last_error: str | None = None
    last_pause_s: float | None = None
    reinit: bool = False  # it refused an update: load HEAD afresh at the next attach


class ServerError(IntegrationError):
    """A server answered a route with an error (``status``: its HTTP status), or not at all (None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def call_route(url: str, route: str, body: dict[str, Any] | None = None, *, method: str = "POST",
               timeout_s: float = 300.0) -> Any:
    """One of a vLLM server's HTTP routes, its JSON answer (None for an empty body); raises
    :class:`ServerError` on an HTTP error or no answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}/{route}", data=data if method == "POST" else None, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as err:
        detail = err.read()[:2000].decode(errors="replace")
        if err.code == 404:
            detail += " (the RLHF routes need VLLM_SERVER_DEV_MODE=1 in the server's environment)"
        raise ServerError(f"{url}/{route}: HTTP {err.code}: {detail}", err.code) from err
    except (OSError, urllib.error.URLError) as err:
        raise ServerError(f"{url}/{route}: {err}") from err
    return json.loads(raw) if raw else None


def server_status(url: str, *, digest: bool = False, timeout_s: float = 300.0) -> dict[str, Any]:
    """The first worker's ``deltarl_status`` through vLLM's ``/collective_rpc`` route (the served
    version, its id, the last update's timings; ``digest``: the served weights' state digest)."""
    body: dict[str, Any] = {"method": "deltarl_status"}
    if digest:
        body["kwargs"] = {"digest": "1"}  # the route passes strings only; any non-empty one is true
    out = call_route(url, "collective_rpc", body, timeout_s=timeout_s)
    results = (out or {}).get("results") or [{}]
    first = results[0]
    if not isinstance(first, dict):
        raise ServerError(f"{url}: deltarl_status answered {first!r} (start the server with --worker-extension-cls "
                          "deltarl.integrations.vllm.worker.DeltaRLWorkerExtension)")
    return first


def attach(url: str, store: str, run: str, *, relays: Sequence[str] = (), version: int | None = None,
           timeout_s: float = 600.0) -> None:
    """``/init_weight_transfer_engine`` (the workers load ``version``, default HEAD), then
    ``/reset_prefix_cache``."""
    call_route(url, "init_weight_transfer_engine",
               {"init_info": {"store": store, "run": run, "relays": list(relays), "version": version}},
               timeout_s=timeout_s)
    call_route(url, "reset_prefix_cache", timeout_s=timeout_s)


def stage(url: str, version: int, *, timeout_s: float = 600.0) -> None:
    """``/start_weight_update`` and ``/update_weights``: the workers fetch, verify and decode ``version``
    (the next after the served one) in the background while the server keeps generating; the
    engine answers ``NotStaged`` at once until it has; this then polls ``deltarl_staged`` until every
    worker holds it, and asks again (``take_update``)."""
    from deltarl.actor.backends.vllm import take_update

    take_update(lambda: call_route(url, "start_weight_update", timeout_s=timeout_s),
                lambda info: call_route(url, "update_weights", {"update_info": info}, timeout_s=timeout_s),
                version, stage_timeout_s=timeout_s, staged=lambda: server_staged(url, timeout_s=timeout_s))


def server_staged(url: str, *, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Every worker's ``deltarl_staged`` (the version its background staging holds, and its last
    error) through ``/collective_rpc``: a poll that never fails in the server, so it logs nothing."""
    out = call_route(url, "collective_rpc", {"method": "deltarl_staged"}, timeout_s=timeout_s)
    return [r for r in (out or {}).get("results") or [] if isinstance(r, dict)]


def commit(url: str, version: int, *, timeout_s: float = 600.0) -> None:
    """``/finish_weight_update`` (the in-place commit; ``/weight_info`` then names ``version``), then
    ``/reset_prefix_cache``: KV cached under the old weights would give wrong logprobs."""
    call_route(url, "finish_weight_update", {"weight_version": str(version)}, timeout_s=timeout_s)
    call_route(url, "reset_prefix_cache", timeout_s=timeout_s)


class ServeSync:
    """Keeps ``servers`` on ``run``'s HEAD (see the module doc); :meth:`run` until ``stop``."""

    def __init__(
        self,
        servers: Sequence[str],
        store: str,
        run: str,
        *,
        relays: Sequence[str] = (),
        engine_store: str | None = None,
        pause: Pause = "wait",
        digest: bool = True,
        poll_s: float = 0.5,
        check_s: float = 5.0,
        backoff_s: tuple[float, float] = (1.0, 30.0),
        timeout_s: float = 600.0,
        metrics: Any = None,
    ) -> None:
        """``store``: where serve-sync watches HEAD (a store URL or a relay's); ``engine_store``: what
        the servers' workers read (default ``store``), relays first. ``check_s``: how often an up to
        date server is asked whether it still serves the run (a restart shows there)."""
        if pause not in PAUSES:
            raise ConfigError(f"pause must be one of {', '.join(PAUSES)}, not {pause!r}")
        if not servers:
            raise ConfigError("serve-sync needs at least one server URL")
        self.servers = [ServerState(u.rstrip("/")) for u in servers]
        self.store, self.run_name = store, run
        self.relays, self.engine_store = list(relays), engine_store or store
        self.pause, self.digest = pause, digest
        self.poll_s, self.check_s, self.backoff_s, self.timeout_s = poll_s, check_s, backoff_s, timeout_s
        self.metrics = metrics
        self.head: int | None = None
        self._moved = threading.Condition()

    # --- the run's HEAD -----------------------------------------------------------------------------
    def _watch(self, store: Any, stop: threading.Event) -> None:
        from deltarl.errors import DeltaRLError
        from deltarl.pipeline.reader import RunReader

        try:
            reader = RunReader(store, self.run_name)
            while not stop.is_set():
                try:
                    found = reader.head_with_etag()
                except (DeltaRLError, OSError) as err:
                    log.warning("serve-sync: reading HEAD of %s: %s", self.run_name, err)
                    found = None
                if found is not None and found[0].version != self.head:
                    with self._moved:
                        self.head = found[0].version
                        self._moved.notify_all()
                    if self.metrics is not None:
                        self.metrics.head.set(self.head)
                stop.wait(self.poll_s)
        finally:
            store.close()

    # --- one server -----------------------------------------------------------------------------------
    def _attach(self, srv: ServerState) -> None:
        """Adopt what the server serves, or init it at HEAD if it serves nothing (new or restarted)."""
        st = server_status(srv.url, timeout_s=self.timeout_s)
        srv.up = True
        if st.get("version") is None or srv.reinit:
            srv.reinit = False
            attach(srv.url, self.engine_store, self.run_name, relays=self.relays, timeout_s=self.timeout_s)
            srv.attaches += 1
            if self.metrics is not None:
                self.metrics.attaches.labels(srv.url).inc()
            log.info("serve-sync: %s attached to %s", srv.url, self.run_name)
        self._read_back(srv)
        srv.attached = True

    def _read_back(self, srv: ServerState) -> None:
        st = server_status(srv.url, digest=self.digest, timeout_s=self.timeout_s)
        if st.get("version") is None:
            raise ServerError(f"{srv.url}: serves no deltarl version after init")
        srv.version, srv.version_id, srv.digest = int(st["version"]), st.get("version_id"), st.get("digest")
        call_route(srv.url, "update_weight_version", {"new_version": str(srv.version)}, timeout_s=self.timeout_s)
        if self.metrics is not None:
            self.metrics.served.labels(srv.url).set(srv.version)

    def _advance(self, srv: ServerState) -> None:
        """Stage the version after the served one, commit it under the pause, reset the prefix cache."""
        assert srv.version is not None
        target = srv.version + 1
        t0 = time.perf_counter()
        stage(srv.url, target, timeout_s=self.timeout_s)
        t1 = time.perf_counter()
        if self.pause != "none":
            call_route(srv.url, f"pause?mode={self.pause}", timeout_s=self.timeout_s)
        try:
            commit(srv.url, target, timeout_s=self.timeout_s)
        finally:
            if self.pause != "none":
                call_route(srv.url, "resume", timeout_s=self.timeout_s)
        srv.last_pause_s = time.perf_counter() - t1
        self._read_back(srv)
        if srv.version != target:
            raise ServerError(f"{srv.url}: committed version {target} but serves {srv.version}")
        srv.updates += 1
        if self.metrics is not None:
            self.metrics.updates.labels(srv.url).inc()
            self.metrics.stage_s.labels(srv.url).set(t1 - t0)
            self.metrics.pause_s.labels(srv.url).set(srv.last_pause_s)
        log.info("serve-sync: %s serves version %d (stage %.3f s, pause %.3f s)", srv.url, target, t1 - t0,
                 srv.last_pause_s)

    def _step(self, srv: ServerState, last_check: float) -> float:
        """One round for ``srv``; returns when it last confirmed the server serves the run."""
        now = time.monotonic()
        if not srv.attached:
            self._attach(srv)
            return now
        head = self.head
        if head is not None and srv.version is not None and srv.version < head:
            try:
                self._advance(srv)
            except ServerError as err:
                srv.reinit = err.status is not None  # it answered, and refused: attach at HEAD afresh
                raise
            return now
        if now - last_check >= self.check_s:
            st = server_status(srv.url, timeout_s=self.timeout_s)
            if st.get("version") != srv.version:  # restarted (serves nothing) or moved by someone else
                srv.attached = False
            return now
        return last_check

    def _serve(self, srv: ServerState, stop: threading.Event) -> None:
        last_check = 0.0
        while not stop.is_set():
            try:
                last_check = self._step(srv, last_check)
                srv.failures = 0
                srv.last_error = None
            except ServerError as err:
                srv.failures += 1
                srv.up, srv.attached, srv.last_error = False, False, str(err)
                wait = min(self.backoff_s[1], self.backoff_s[0] * 2 ** (srv.failures - 1))
                log.warning("serve-sync: %s (retry in %.1f s)", err, wait)
                if self.metrics is not None:
                    self.metrics.failures.labels(srv.url).inc()
                    self.metrics.served.labels(srv.url).set(-1)
                stop.wait(wait)
                continue
            if self.metrics is not None:
                self.metrics.up.labels(srv.url).set(1 if srv.up else 0)
            with self._moved:
                if self.head is None or srv.version is None or srv.version >= self.head:
                    self._moved.wait(min(self.check_s, 1.0))

    # --- the process --------------------------------------------------------------------------------
    def run(self, stop: threading.Event, *, until_version: int | None = None) -> None:
        """Keep every server on HEAD until ``stop`` is set (or, with ``until_version``, until every
        server serves it)."""
        from deltarl.storage.open import open_store

        store = open_store(self.store, must_exist=True)  # a typo'd path is an error, not an empty run
        threads = [threading.Thread(target=self._watch, args=(store, stop), name="serve-sync-head", daemon=True)]
        threads += [threading.Thread(target=self._serve, args=(s, stop), name=f"serve-sync-{i}", daemon=True)
                    for i, s in enumerate(self.servers)]
        for t in threads:
            t.start()
        try:
            while not stop.wait(0.2):
                if until_version is not None and all(
                        s.attached and s.version is not None and s.version >= until_version for s in self.servers):
                    break
        finally:
            stop.set()
            with self._moved:
                self._moved.notify_all()
            for t in threads:
                t.join(timeout=self.timeout_s)

    def report(self) -> list[dict[str, Any]]:
        """Each server's state: served version, version id, digest, attaches, updates, last error."""
        return [{k: v for k, v in asdict(s).items() if k != "reinit"} for s in self.servers]


class ServeSyncMetrics:
    """Prometheus metrics of a serve-sync process (``deltarl_serve_sync_*``), on their own registry."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.head = Gauge("deltarl_serve_sync_head_version", "The run's HEAD version", registry=r)
        self.served = Gauge("deltarl_serve_sync_served_version", "Version each server serves (-1: unknown)",
                            ["server"], registry=r)
        self.up = Gauge("deltarl_serve_sync_server_up", "1 while the server answers", ["server"], registry=r)
        self.attaches = Counter("deltarl_serve_sync_attaches", "Inits at HEAD (start, restart, refusal)",
                                ["server"], registry=r)
        self.updates = Counter("deltarl_serve_sync_updates", "Versions committed", ["server"], registry=r)
        self.failures = Counter("deltarl_serve_sync_failures", "Rounds that failed (then backed off)",
                                ["server"], registry=r)
        self.stage_s = Gauge("deltarl_serve_sync_stage_seconds", "Last stage (fetch, verify, decode)",
                             ["server"], registry=r)
        self.pause_s = Gauge("deltarl_serve_sync_commit_seconds",
                             "Last commit with its pause, prefix-cache reset and resume", ["server"], registry=r)
