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


def _staging_engine(ready_after: int, errors: dict[int, str] | None = None) -> tuple[list[str], Callable[[], None],
                                                                                     Callable[[dict[str, object]], None],
                                                                                     Callable[[], list[dict[str, object]]]]:
    """Two ranks staging version 3: ``update_weights`` answers the engine's real ``NotStaged`` until
    the ``ready_after``-th poll of ``deltarl_staged`` has seen both ranks hold it; ``errors``: a rank's
    error reported at that poll number instead."""
    calls: list[str] = []
    polls = [0]

    def start() -> None:
        calls.append("start")

    def update(info: dict[str, object]) -> None:
        calls.append("update")
        if polls[0] < ready_after:
            raise RuntimeError("Worker failed with error '[deltarl:NotStaged] version 3 is being staged in the "
                               "background: ask again', please check the stack trace above for the root cause")

    def staged() -> list[dict[str, object]]:
        calls.append("poll")
        polls[0] += 1
        error = (errors or {}).get(polls[0])
        held = 3 if polls[0] >= ready_after else 2
        return [{"staged": held, "error": None, "rank": 0}, {"staged": 2 if error else held, "error": error, "rank": 1}]

    return calls, start, update, staged


def test_with_a_staging_poll_a_not_staged_version_is_polled_not_asked_again() -> None:
    calls, start, update, staged = _staging_engine(ready_after=5)
    take_update(start, update, 3, staged=staged)
    # one refused ask, polls until both ranks hold 3, then the ask that takes it
    assert calls == ["start", "update", *["poll"] * 5, "start", "update"]


def test_a_rank_error_ends_the_poll_and_the_next_ask_reports_it() -> None:
    calls, start, update, staged = _staging_engine(ready_after=10**6, errors={2: "[deltarl:IntegrityError] piece 4"})
    with pytest.raises(RuntimeError, match="NotStaged"):  # the engine still answers NotStaged here...
        take_update(start, update, 3, staged=staged, stage_timeout_s=0.3)
    assert calls[:6] == ["start", "update", "poll", "poll", "start", "update"]  # ...but it was asked at once


def test_a_poll_that_never_shows_the_version_asks_again(monkeypatch: pytest.MonkeyPatch) -> None:
    import deltarl.actor.backends.vllm as backend

    monkeypatch.setattr(backend, "POLL_REASK_S", 0.2)
    calls, start, update, staged = _staging_engine(ready_after=10**6)
    with pytest.raises(RuntimeError, match="NotStaged"):
        take_update(start, update, 3, staged=staged, stage_timeout_s=0.9)
    asks = calls.count("update")
    assert 3 <= asks <= 6  # asked again every ~0.2 s of polling, until the stage timeout
    assert calls.count("poll") > asks


def test_a_not_staged_answer_without_a_version_falls_back_to_asking_again() -> None:
    calls, _, start, update = _engine(["NotStaged", None])  # "version 3 …": no version being staged named
    take_update(start, update, 3, staged=lambda: pytest.fail("polled without a version to wait for"))
    assert calls == ["start", "update"] * 2
