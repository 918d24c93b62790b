"""An actor's way out runs every step even when one fails: a weights close that times out (a cold codec
compile) still closes the engine, writes the state, and ends the event log with ``exit``."""

from __future__ import annotations

import json
from pathlib import Path

from deltarl.actor.config import ActorConfig
from deltarl.actor.loop import ActorLoop


class Weights:
    held = (3, "v3")

    def close(self) -> None:
        raise TimeoutError("the subscriber did not close")


class Backend:
    def __init__(self) -> None:
        self.closed = False

    def served_digest(self) -> str:
        return "d3"

    def close(self) -> None:
        self.closed = True


class Client:
    def __init__(self) -> None:
        self.left: list[str] = []
        self.closed = False

    def leave(self, actor_id: str) -> None:
        self.left.append(actor_id)

    def close(self) -> None:
        self.closed = True


def test_a_failed_close_does_not_skip_the_rest(tmp_path: Path) -> None:
    events, state = tmp_path / "events.jsonl", tmp_path / "state.json"
    actor = ActorLoop(ActorConfig(token="t", events=str(events), state_out=str(state)), name="a")
    actor.weights, backend, client = Weights(), Backend(), Client()
    actor.backend = backend  # type: ignore[assignment]
    actor.actor_id = "a-1"
    actor._teardown(client, None, None, clean=True)  # type: ignore[arg-type]
    assert client.left == ["a-1"]
    assert client.closed
    assert backend.closed
    assert json.loads(state.read_text())["state_digest"] == "d3"
    last = json.loads(events.read_text().splitlines()[-1])
    assert (last["event"], last["version"], last["teardown_failed"]) == ("exit", 3, ["close the weights"])
    assert actor.stopping


def test_a_clean_way_out_names_no_failure(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    actor = ActorLoop(ActorConfig(token="t", events=str(events)), name="a")
    actor._teardown(None, None, None, clean=False)
    last = json.loads(events.read_text().splitlines()[-1])
    assert last["event"] == "exit"
    assert "teardown_failed" not in last
