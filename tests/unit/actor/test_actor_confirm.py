"""The actor reports a batch only after the digest check of the weights that generated it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from deltarl.actor.config import ActorConfig
from deltarl.actor.loop import ActorLoop
from deltarl.errors import IntegrityError


class Weights:
    version, version_id = 1, "v1"

    def __init__(self, ok: bool) -> None:
        self.ok = ok

    def confirm(self) -> None:
        if not self.ok:
            raise IntegrityError("state digest differs after commit; rolled back to version 0")


class Client:
    def __init__(self) -> None:
        self.reported: list[Any] = []

    def report(self, result: Any) -> Any:
        self.reported.append(result)
        return SimpleNamespace(duplicate=False)


class Actor(ActorLoop):
    def _generate(self, grant: Any) -> Any:
        return SimpleNamespace(samples=[], tokens=0, gen_seconds=0.0)


def _serve(ok: bool) -> tuple[Client, Actor]:
    actor = Actor(ActorConfig(token="t"))
    actor.weights = Weights(ok)
    grant = SimpleNamespace(lease=SimpleNamespace(lease_id="l1", step=1), accepted_versions=["v1"], prompts=[])
    client = Client()
    actor._serve(client, grant)  # type: ignore[arg-type]
    return client, actor


def test_a_batch_from_weights_that_fail_their_digest_check_is_not_reported() -> None:
    client, actor = _serve(ok=False)
    assert client.reported == []
    assert actor.results_admitted == 0
    client, actor = _serve(ok=True)
    assert len(client.reported) == 1
    assert actor.results_admitted == 1
