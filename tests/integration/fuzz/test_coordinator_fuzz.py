"""Random requests against the coordinator: never a 5xx, and it stays up and answers afterwards."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.coordinator.server import Coordinator, create_app
from deltarl.protocol.records import encode
from deltarl.storage.local import LocalStore
from tests.fixtures.coordinator import ACTOR_TOKEN, RUN, TRAINER_TOKEN, make_spec, service_config
from tests.integration.fuzz.http import TOKENS, request

JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**20), max_value=10**20),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=20,
)
FIELDS = ["format_version", "actor_id", "step", "lease_id", "samples", "prompts", "accepted_versions", "max_prompts",
          "region", "capabilities", "tokens", "gen_seconds", "version_id"]
RECORDS = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6).map(lambda d: {"format_version": 1, **d})
SPEC = json.loads(encode(make_spec(0, 2)))
SPECIAL = st.sampled_from([b"NaN", b"[" * 5000, b'{"format_version": true}', b'{"format_version":1,"step":1e999}',
                     json.dumps({**SPEC, "step": 10**15}).encode(), json.dumps(SPEC).encode(),
                     json.dumps({**SPEC, "step": 1.5}).encode(), b'{"format_version":1,"region":"' + b"x" * 70000 + b'"}'])
BODIES = st.one_of(RECORDS.map(lambda d: json.dumps(d).encode()), st.binary(max_size=80), SPECIAL, SPECIAL)
ROUTES = st.sampled_from(["/register", "/steps", "/lease", "/result", "/heartbeat", "/steps/0/results?timeout=0"])
PATHS = st.one_of(
    ROUTES,
    ROUTES,
    st.sampled_from(["/register", "/lease", "/result", "/heartbeat", "/steps", "/status", "/metrics",
                     "/steps/0/results?timeout=0", "/steps/-1/results", "/steps/99999999999999999999/results",
                     "/steps/0/results?timeout=nan", "/steps/0/results?timeout=1e309", "/steps/%ff/results", "/%ff"]),
    st.text(alphabet="/abcdefgst0123456789%?=", max_size=30).map(lambda p: "/" + p),
)


class _Server:
    def __init__(self, root: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(root), self.loop).result(30)
        status, _, payload = request(self.port, "POST", "/register", {"Authorization": f"Bearer {ACTOR_TOKEN}"},
                                     b'{"format_version":1}')
        assert status == 200
        self.secret = json.loads(payload).get("actor_secret", ACTOR_TOKEN)

    async def _start(self, root: Path) -> int:
        self.runner = web.AppRunner(create_app(Coordinator(LocalStore(str(root)), RUN, service_config())), access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return int(self.runner.addresses[0][1])

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Server]:
    srv = _Server(tmp_path_factory.mktemp("coordinator-fuzz"))
    yield srv
    srv.close()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["POST", "POST", "GET", "PUT"]), path=PATHS, body=BODIES,
       token=st.one_of(st.sampled_from([ACTOR_TOKEN, TRAINER_TOKEN, "<secret>"]), st.sampled_from([ACTOR_TOKEN, TRAINER_TOKEN]), TOKENS))
def test_coordinator_survives_random_requests(server: _Server, method: str, path: str, body: bytes, token: Any) -> None:
    headers = {"Content-Type": "application/json"}
    if token == "<secret>":
        token = server.secret
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    status, _, payload = request(server.port, method, path, headers, body)
    assert status < 500, (method, path, body[:100], status, payload[:300])


def test_coordinator_still_answers_after_the_fuzz(server: _Server) -> None:
    status, _, payload = request(server.port, "GET", "/status", {"Authorization": f"Bearer {TRAINER_TOKEN}"})
    assert status == 200
    assert json.loads(payload)["run"] == RUN
