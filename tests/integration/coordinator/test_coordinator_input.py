"""Hostile and careless input to the coordinator: every refusal is a short 4xx, never a 5xx.

Non-finite numbers (400 ``non_finite``), oversized bodies (413, also a Content-Length that never
arrives), JSON nested too deep, out-of-range step numbers, booleans posing as integers.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from deltarl.errors import FormatError
from deltarl.protocol.client import CoordinatorClient
from deltarl.protocol.records import RolloutResult, Sample, decode, encode
from deltarl.storage.store import ObjectStore
from tests.fixtures.coordinator import (
    ACTOR_TOKEN,
    RUN,
    TRAINER_TOKEN,
    RunningCoordinator,
    make_result,
    make_spec,
    service_config,
    start_service,
)


async def _post(url: str, path: str, body: bytes, token: str) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as s, s.post(
        url + path, data=body, headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    ) as r:
        text = await r.text()
        return r.status, (json.loads(text) if text.startswith("{") else {"text": text})


@pytest.mark.parametrize("poison", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("where", ["reward", "logprob", "gen_seconds"])
async def test_non_finite_result_is_refused_with_a_reason(
    coordinator_service: RunningCoordinator, poison: str, where: str
) -> None:
    url = coordinator_service.url
    async with CoordinatorClient(url, TRAINER_TOKEN) as trainer, CoordinatorClient(url, ACTOR_TOKEN) as actor:
        spec = make_spec(0, 1)
        await trainer.open_step(0, spec.prompts, spec.accepted_versions)
        reg = await actor.register()
        grant = (await actor.lease(reg.actor_id)).grant
        assert grant is not None
        text = encode(make_result(grant)).decode()
        marker = {"reward": '"reward":1.0', "logprob": '"logprobs":[-0.25', "gen_seconds": '"gen_seconds":0.01'}[where]
        assert marker in text
        poisoned = text.replace(marker, marker.split(":")[0] + ":" + ("[" if where == "logprob" else "") + poison, 1)
        status, body = await _post(url, "/result", poisoned.encode(), reg.actor_secret)
        assert status == 400, body
        assert body["reason"] == "non_finite"
        # Nothing was stored; the honest result is still admitted.
        assert not list(coordinator_service.store.list(f"{RUN}/rollouts/step-000000000000/results/"))
        assert (await actor.report(make_result(grant))).admitted


def test_records_refuse_non_finite_numbers_built_in_python() -> None:
    for bad in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(ValueError, match="finite"):
            Sample(prompt_id="p", prompt_token_ids=[1], completion_token_ids=[2], completion_text="x",
                   logprobs=[-0.5], reward=bad)
        with pytest.raises(ValueError, match="finite"):
            RolloutResult(step=0, lease_id="l", actor_id="a", version_id="v", samples=[], gen_seconds=bad, tokens=0)


async def test_body_caps_give_413_without_waiting_for_the_body(coordinator_store: ObjectStore) -> None:
    cfg = service_config()
    cfg = cfg.model_copy(update={"service": cfg.service.model_copy(update={"max_body_bytes": 64 * 1024})})
    runner, running = await start_service(coordinator_store, cfg)
    try:
        big = json.dumps({"format_version": 1, "region": "x" * 200_000}).encode()
        status, body = await _post(running.url, "/register", big, ACTOR_TOKEN)
        assert status == 413
        assert body["reason"] == "too_large"
        # A declared 300 MB body that never comes: answered at once, not after a hang.
        host, port = running.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST /register HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ACTOR_TOKEN}\r\n"
                     f"Content-Length: {300 * 1024 * 1024}\r\n\r\n{{".encode())
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        assert b" 413 " in status_line
        writer.close()
        assert not list(coordinator_store.list(f"{RUN}/coordinator/actors/"))
    finally:
        await runner.cleanup()


async def test_deep_json_bad_numbers_and_booleans_are_400(coordinator_service: RunningCoordinator) -> None:
    url = coordinator_service.url
    deep = b'{"format_version":1,"capabilities":{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    status, body = await _post(url, "/register", deep, ACTOR_TOKEN)
    assert status == 400
    assert body["reason"] == "malformed"
    status, body = await _post(url, "/register", b'{"format_version": true}', ACTOR_TOKEN)
    assert status == 400
    spec = json.loads(encode(make_spec(0, 1)))
    for step in (10**15, -1, True, 1.5):
        spec["step"] = step
        status, body = await _post(url, "/steps", json.dumps(spec).encode(), TRAINER_TOKEN)
        assert status == 400, (step, body)
    async with aiohttp.ClientSession() as s:
        auth = {"Authorization": f"Bearer {TRAINER_TOKEN}"}
        for path in ("/steps/-1/results", "/steps/1000000000000000/results", "/steps/1/results?timeout=nan",
                     "/steps/x/results", "/steps/1/results?timeout=-5"):
            async with s.get(url + path, headers=auth) as r:
                assert r.status == 400, path
    with pytest.raises(FormatError, match="integer"):
        decode(RolloutResult, b'{"format_version":1,"step":true}')
