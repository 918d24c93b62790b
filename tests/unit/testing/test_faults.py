"""The publisher's stage hook and the crash hook built on it (the SIGKILL itself is exercised by
tests/integration/pipeline/test_crash_publish.py in child processes)."""

from __future__ import annotations

import pytest

from deltarl.pipeline.publisher import Publisher
from deltarl.storage import MemoryStore
from deltarl.testing.faults import CRASH_ENV, CrashAt
from tests.fixtures.runs import TinyTrainer

SHAPES = {"w": ((64, 128), "bfloat16")}


def test_parse_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    hook = CrashAt.parse("3:segments:2")
    assert (hook.version, hook.stage, hook.k) == (3, "segments", 2)
    assert CrashAt.parse("0:manifest").k == 0
    for bad in ("", "3", "x:segments", "3:segments:x", "1:2:3:4", "3:"):
        with pytest.raises(ValueError, match=CRASH_ENV):
            CrashAt.parse(bad)
    monkeypatch.delenv(CRASH_ENV, raising=False)
    assert CrashAt.from_env() is None
    monkeypatch.setenv(CRASH_ENV, "2:keyframe")
    hook = CrashAt.from_env()
    assert hook is not None
    hook(1, "keyframe")  # another version, another stage: nothing happens
    hook(2, "segments")


@pytest.mark.torch
def test_publisher_reports_every_stage() -> None:
    seen: list[tuple[int, str]] = []
    trainer = TinyTrainer(0, lr=0.05, shapes=SHAPES)
    hook = lambda v, s: seen.append((v, s))  # noqa: E731
    with Publisher(MemoryStore(), "r", keyframe_interval=2, segment_bytes=2048, upload_workers=1, on_progress=hook) as pub:
        for step in range(3):
            if step:
                trainer.step()
            pub.publish(trainer.export(), step=step)
    assert seen[:2] == [(0, "keyframe"), (0, "manifest")]
    v1 = [s for v, s in seen if v == 1]
    assert v1[-1] == "manifest"
    assert set(v1[:-1]) == {"segments"}
    v2 = [s for v, s in seen if v == 2]
    assert v2[-1] == "manifest"
    assert {"segments", "keyframe"} <= set(v2)
