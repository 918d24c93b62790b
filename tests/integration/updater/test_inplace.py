"""The engine-agnostic in-place updater on plain torch tensors standing in for an engine's live
parameters (the vLLM engine runs the same class in its workers: tests/integration/vllm)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deltarl.errors import BaseMismatch, NotPublished, NotStaged, ObjectNotFound, StoreNotFound
from deltarl.pipeline import RunLayout
from deltarl.storage import LocalStore
from tests.fixtures.runs import publish_run, states_equal

pytestmark = pytest.mark.torch


class Engine:
    """An engine's parameters, made once per tensor table: as vLLM's, one fused parameter (that
    requires grad) holding every checkpoint tensor; the views are slices of it."""

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}
        self.mapped = 0

    def views_for(self, table: Any) -> dict[str, Any]:
        import torch

        self.mapped += 1
        self.params = {}
        for dtype in sorted({t.dtype for t in table}):  # one fused parameter a dtype
            tensors = [t for t in table if t.dtype == dtype]
            fused = torch.nn.Parameter(torch.zeros(sum(t.numel for t in tensors), dtype=getattr(torch, dtype)))
            start = 0
            for t in tensors:
                self.params[t.name] = fused.view(-1)[start : start + t.numel].view(tuple(t.shape))
                start += t.numel
        return self.params


@pytest.fixture
def updater() -> Iterator[Any]:
    from deltarl.updater.inplace import InPlaceUpdater

    up = InPlaceUpdater()
    yield up
    up.close()


def _take(up: Any, version: int | str, *, wait_s: float = 0.0, timeout_s: float = 30.0) -> Any:
    """Ask until taken (as a client of an engine does), then commit."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            up.start_update()
            up.take(version, wait_s=wait_s)
            return up.commit()
        except NotStaged:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def test_attach_updates_latest_and_failed_attaches(tmp_path: Path, updater: Any) -> None:
    store = LocalStore(str(tmp_path / "store"))
    exports = publish_run(store, "r", 7, keyframe_interval=5, digest_interval=2)
    engine = Engine()
    served = updater.attach(engine.views_for, store.url, "r", version=1)
    assert served.version == 1
    assert states_equal(engine.params, exports[1])
    with pytest.raises(BaseMismatch):
        updater.take(3)
    assert _take(updater, 2).version == 2
    assert states_equal(engine.params, exports[2])
    assert _take(updater, "latest").version == 6  # 4 behind: from the served state plus deltas, in one go
    assert states_equal(engine.params, exports[6])
    before = {n: t.clone() for n, t in engine.params.items()}
    for bad in ({"store": store.url, "run": "r", "version": 99}, {"store": str(tmp_path / "nowhere"), "run": "r"}):
        with pytest.raises((ObjectNotFound, StoreNotFound)):
            updater.attach(engine.views_for, **bad)
        assert states_equal(engine.params, before)  # nothing written
        assert updater.served.version == 6
    assert engine.mapped == 1  # the same table: mapped once
    with pytest.raises(NotPublished):
        updater.take(7)
    t0 = time.monotonic()
    with pytest.raises(NotPublished):
        updater.take(7, wait_s=8.0)  # answered at once; the background staging waits for it
    assert time.monotonic() - t0 < 2.0


def test_a_replaced_run_is_staged_again_from_its_keyframe(tmp_path: Path, updater: Any) -> None:
    store = LocalStore(str(tmp_path / "store"))
    publish_run(store, "r", 3)
    engine = Engine()
    updater.attach(engine.views_for, store.url, "r", version=1)
    deadline = time.monotonic() + 30
    while updater.background()["staged"] != 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert updater.background()["staged"] == 2  # the old run's version 2, staged in the background
    shutil.rmtree(tmp_path / "store" / "r")
    new = publish_run(store, "r", 3, seed=7)
    got = _take(updater, "latest")
    head = RunLayout("r").head
    assert (got.version, got.version_id) == (2, json.loads(store.get(head))["version_id"])
    assert states_equal(engine.params, new[2])
