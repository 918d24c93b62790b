"""A real nginx, configured by ``deltarl nginx-config``, in front of a deltarl relay and in front of
SeaweedFS's S3 endpoint: replay and follow bit-exact through it, no busy polling, and every caching
rule checked against the upstream's own request counts."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

pytest.importorskip("torch")

from deltarl.actor.follower import Follower
from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.replay import replay
from deltarl.relay.nginx import IMMUTABLE
from deltarl.storage import MemoryStore
from deltarl.storage.http import HTTPStore
from tests.fixtures.relays import StartRelay
from tests.fixtures.runs import TinyTrainer, states_equal

pytestmark = [pytest.mark.nginx, pytest.mark.torch]

RUN = "ngx"


class Trainer:
    def __init__(self, store: Any) -> None:
        self.tiny = TinyTrainer(2)
        self.pub = Publisher(store, RUN, segment_bytes=8 << 10, keyframe_interval=3, digest_interval=2)
        self.exports: list[dict[str, Any]] = []

    def publish(self, n: int = 1) -> None:
        for _ in range(n):
            if self.exports:
                self.tiny.step()
            export = self.tiny.export()
            self.pub.publish(export, step=len(self.exports))
            self.exports.append({k: t.clone() for k, t in export.items()})

    def close(self) -> None:
        self.pub.close()


def _upstream_requests(relay: Any) -> float:
    """Requests the relay has answered (its own Prometheus counter)."""
    return sum(v for k, v in relay.counters().items() if k.startswith("deltarl_relay_requests_total"))


def _replay_via(url: str, version: int) -> dict[str, Any]:
    store = HTTPStore(url)
    try:
        return replay(store, RUN, version)
    finally:
        store.close()


async def _follow_while_publishing(url: str, trainer: Trainer, until: int) -> Follower:
    follower = Follower(RUN, relays=[url], poll_wait_s=3.0)
    async with follower:
        task = asyncio.ensure_future(follower.follow(until_version=until))
        await asyncio.to_thread(trainer.publish, until + 1 - len(trainer.exports))
        last = await asyncio.wait_for(task, 90)
    assert last is not None
    assert last.version == until
    return follower


async def test_replay_and_follow_through_nginx_in_front_of_a_relay(start_relay: StartRelay, start_nginx: Any) -> None:
    origin = MemoryStore()
    trainer = Trainer(origin)
    relay = await start_relay(origin)
    nginx = start_nginx(relay.url)
    await asyncio.to_thread(trainer.publish, 4)
    assert states_equal(await asyncio.to_thread(_replay_via, nginx.url, 3), trainer.exports[3])
    follower = await _follow_while_publishing(nginx.url, trainer, 7)
    assert states_equal(follower.state, trainer.exports[7])
    assert set(follower.fetcher.stats.bytes_by_source) == {nginx.url}
    # idle behind nginx (404s at once, ?wait= dropped): the relay behind it sees a few requests a second
    async with Follower(RUN, relays=[nginx.url], poll_wait_s=5.0) as idle:
        assert (await idle.bootstrap()) is not None  # HEAD through the 1 s micro-cache: maybe not 7 yet
        await asyncio.sleep(3.0)  # past the backoff's ramp (50 ms doubling to ~1 s)
        before = _upstream_requests(relay)
        window = 5.0
        await asyncio.sleep(window)
        asked = _upstream_requests(relay) - before
        assert asked <= 5 * window, f"{asked} upstream requests in {window}s from one idle follower"
        await asyncio.to_thread(trainer.publish)
        info = await asyncio.wait_for(idle.follow(until_version=8), 60)
        assert info is not None
        assert info.version == 8
        assert states_equal(idle.state, trainer.exports[8])
    trainer.close()


async def test_nginx_caching_rules(start_relay: StartRelay, start_nginx: Any) -> None:
    origin = MemoryStore()
    trainer = Trainer(origin)
    relay = await start_relay(origin)
    nginx = start_nginx(relay.url)
    await asyncio.to_thread(trainer.publish, 2)
    origin.put("other/x", b"not the run")
    async with aiohttp.ClientSession() as http:

        async def get(path: str, **headers: str) -> tuple[int, bytes, Any]:
            async with http.get(nginx.url + path, headers=headers) as resp:
                return resp.status, await resp.read(), resp.headers

        # HEAD micro-cache: ten concurrent polls (the relay answers no-cache) reach the relay about once
        before = _upstream_requests(relay)
        polls = await asyncio.gather(*(get(f"/{RUN}/HEAD") for _ in range(10)))
        assert {p[0] for p in polls} == {200}
        assert _upstream_requests(relay) - before <= 2
        assert "immutable" not in polls[0][2].get("Cache-Control", "")

        # listings: two prefixes, two answers (keyed by the whole URI), not cached for long
        s1, run_keys, h1 = await get(f"/?prefix={RUN}/")
        s2, other_keys, _ = await get("/?prefix=other/")
        assert (s1, s2) == (200, 200)
        assert run_keys != other_keys
        assert b"other/x" in other_keys
        assert b"other/x" not in run_keys
        assert "immutable" not in h1.get("Cache-Control", "")

        # 404: not cached, not immutable; the object is served as soon as it exists, then cached
        status, _, headers = await get("/late/object")
        assert status == 404
        assert IMMUTABLE not in headers.get("Cache-Control", "")
        origin.put("late/object", b"arrived")
        status, body, headers = await get("/late/object")
        assert (status, body) == (200, b"arrived")
        assert headers["Cache-Control"] == IMMUTABLE
        before = _upstream_requests(relay)
        status, body, headers = await get("/late/object", Range="bytes=1-3")
        assert (status, body) == (206, b"rri")
        assert headers["X-Cache-Status"] == "HIT"
        assert _upstream_requests(relay) == before

        # /healthz and /metrics pass through uncached: once the relay dies, the health check fails
        assert (await get("/healthz"))[0] == 200
        status, body, headers = await get("/metrics")
        assert status == 200
        assert b"deltarl_relay_requests" in body
        assert headers["Cache-Control"] == "no-store"
        await relay.stop()
        assert (await get("/healthz"))[0] == 502
        assert (await get("/metrics"))[0] == 502
    trainer.close()


@pytest.mark.s3
async def test_replay_and_follow_through_nginx_in_front_of_seaweedfs(seaweed_s3: Any, start_nginx: Any) -> None:
    store = seaweed_s3.open()
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": "*", "Action": ["s3:GetObject"],
                                                       "Resource": [f"arn:aws:s3:::{seaweed_s3.bucket}/*"]}]}
    store._client.put_bucket_policy(Bucket=seaweed_s3.bucket, Policy=json.dumps(policy))  # public-read, as deploy.md says
    trainer = Trainer(store)
    bucket_url = f"{seaweed_s3.endpoint_url}/{seaweed_s3.bucket}" + (f"/{seaweed_s3.prefix}" if seaweed_s3.prefix else "")
    nginx = start_nginx(bucket_url, bucket=True)
    try:
        await asyncio.to_thread(trainer.publish, 3)
        assert states_equal(await asyncio.to_thread(_replay_via, nginx.url, 2), trainer.exports[2])
        follower = await _follow_while_publishing(nginx.url, trainer, 5)
        assert states_equal(follower.state, trainer.exports[5])
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{nginx.url}/{RUN}/nothing-here") as resp:
                assert resp.status == 404
                assert IMMUTABLE not in resp.headers.get("Cache-Control", "")
            async with http.get(f"{nginx.url}/healthz") as resp:
                assert resp.status == 200
                assert resp.headers["Cache-Control"] == "no-store"
            async with http.get(f"{nginx.url}/?prefix={RUN}/") as resp:
                assert resp.status == 501  # S3 lists in XML: listings need a deltarl relay
    finally:
        trainer.close()
        store.close()
