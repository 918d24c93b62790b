"""The demo follows each actor's JSON-lines events from two threads (its poller and the main thread
waiting for the final version): every event is taken once, whichever thread reads it. A fresh clone's
`make test` once failed here: both threads read from one offset, both advanced it, and the next read
started inside a line (``json.decoder.JSONDecodeError: Extra data``)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from deltarl.demo import runner
from deltarl.demo.runner import ActorRun, Demo, DemoOptions


def _events(path: Path, *events: dict[str, object]) -> None:
    with open(path, "a") as fh:
        for ev in events:
            fh.write(json.dumps(ev) + "\n")


def _actor(tmp_path: Path) -> ActorRun:
    return ActorRun("actor-1", 1.0, None, tmp_path / "actor-1.events.jsonl", tmp_path / "actor-1.state.json")  # type: ignore[arg-type]


def test_a_read_while_another_thread_reads_takes_each_event_once(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The other thread reads while the first holds the lines it read and has not advanced the offset:
    it must wait (join times out) and then find nothing new, not take the same lines again."""
    demo = Demo(DemoOptions(out=tmp_path))
    a = _actor(tmp_path)
    _events(a.events, {"event": "registered", "actor_id": "id-1", "version": 0},
            {"event": "commit", "version": 1}, {"event": "commit", "version": 2})  # fmt: skip
    real = runner._new_lines
    other = threading.Thread(target=demo._read_events, args=(a,))

    def read_then_let_the_other_thread_in(path: Path, offset: int) -> tuple[list[str], int]:
        got = real(path, offset)
        if not other.is_alive() and other.ident is None:
            other.start()
            other.join(timeout=1.0)  # unguarded, the other thread reads the same lines meanwhile
        return got

    monkeypatch.setattr(runner, "_new_lines", read_then_let_the_other_thread_in)
    demo._read_events(a)
    other.join(timeout=10)
    assert not other.is_alive()
    assert [c["version"] for c in a.commits] == [1, 2]
    assert a.offset == a.events.stat().st_size
    assert (a.actor_id, a.version) == ("id-1", 2)


def test_a_line_still_being_written_is_taken_once_it_is_whole(tmp_path: Path) -> None:
    demo = Demo(DemoOptions(out=tmp_path))
    a = _actor(tmp_path)
    demo._read_events(a)  # no file yet: nothing
    line = json.dumps({"event": "commit", "version": 3}) + "\n"
    a.events.write_text(line[:7])
    demo._read_events(a)
    assert (a.commits, a.offset) == ([], 0)
    with open(a.events, "a") as fh:
        fh.write(line[7:])
    demo._read_events(a)
    assert [c["version"] for c in a.commits] == [3]
    assert a.offset == len(line)
