"""The client side of the vLLM engine's update: ``take_update`` asks again while the engine answers
"not staged yet" (or "not published yet", for up to ``wait_s``) and raises anything else at once;
``refusal_kind`` reads the kind back from vLLM's wrapping of the worker's error."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from deltarl.actor.backends.vllm import refusal_kind, take_update

Engine = tuple[list[str], list[dict[str, object]], Callable[[], None], Callable[[dict[str, object]], None]]


def _engine(answers: list[str | None]) -> Engine:
    """A worker that answers each ``update_weights`` with the next kind of ``answers`` (None: taken)."""
    calls: list[str] = []
    infos: list[dict[str, object]] = []

    def start() -> None:
        calls.append("start")

    def update(info: dict[str, object]) -> None:
        calls.append("update")
        infos.append(info)
        kind = answers.pop(0)
        if kind is not None:  # how vLLM re-raises a worker's error: its own RuntimeError, the message inside
            raise RuntimeError(f"Worker failed with error '[deltarl:{kind}] version 3 …', please check the stack trace")

    return calls, infos, start, update


def test_not_staged_is_asked_again_until_taken() -> None:
    calls, infos, start, update = _engine(["NotStaged", "NotStaged", None])
    take_update(start, update, 3)
    assert calls == ["start", "update"] * 3  # vLLM ends the session on an error: each try starts one
    assert all(i["version"] == 3 for i in infos)


def test_not_published_is_asked_again_only_while_waiting() -> None:
    calls, _, start, update = _engine(["NotPublished", "NotPublished", None])
    take_update(start, update, "latest", wait_s=30)
    assert calls.count("update") == 3
    _, _, start, update = _engine(["NotPublished"])
    with pytest.raises(RuntimeError, match="NotPublished"):
        take_update(start, update, 3)  # wait_s 0: the first answer is final


def test_other_refusals_are_raised_at_once() -> None:
    calls, _, start, update = _engine(["IntegrityError", None])
    with pytest.raises(RuntimeError, match="IntegrityError") as refused:
        take_update(start, update, 3, wait_s=30)
    assert calls == ["start", "update"]
    assert refusal_kind(refused.value) == "IntegrityError"
    assert refusal_kind(RuntimeError("no tag here")) is None
