"""DeltaRLCallback driven through transformers' hooks: publishing runs off the step, failures surface next step."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from transformers import TrainerControl, TrainerState  # noqa: E402

from deltarl.errors import IntegrationError  # noqa: E402
from deltarl.integrations.trl import DeltaRLCallback  # noqa: E402
from deltarl.model.build import ModelSpec, build_model  # noqa: E402
from deltarl.pipeline.reader import RunReader  # noqa: E402
from deltarl.storage.open import open_store  # noqa: E402

pytestmark = pytest.mark.torch


def _step(model: torch.nn.Module, state: TrainerState) -> None:
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(0.5)
    state.global_step += 1


def test_publish_runs_in_the_background_one_at_a_time(tmp_path) -> None:
    store = open_store(str(tmp_path))
    release = threading.Event()
    seen: list[int] = []

    def hold(info: object) -> None:
        seen.append(info.version)  # type: ignore[attr-defined]
        release.wait(60)

    cb = DeltaRLCallback(store, "r", on_published=hold)
    model, state, control = build_model(ModelSpec()), TrainerState(), TrainerControl()
    cb.on_train_begin(None, state, control, model=model)  # version 0 goes to the background thread
    for _ in range(600):  # on_train_begin returned while version 0's publish is still held open
        if seen:
            break
        threading.Event().wait(0.05)
    assert seen == [0]
    assert not release.is_set()
    release.set()
    _step(model, state)
    cb.on_step_end(None, state, control, model=model)  # waits for version 0, then hands version 1 over
    cb.on_train_end(None, state, control)
    assert seen == [0, 1]
    assert RunReader(store, "r").head().version == 1
    assert cb.publisher is None


def test_a_failed_publish_stops_the_next_step(tmp_path) -> None:
    store = open_store(str(tmp_path))

    def fail(info: object) -> None:
        raise OSError("metrics endpoint down")

    cb = DeltaRLCallback(store, "r", on_published=fail)
    model, state, control = build_model(ModelSpec()), TrainerState(), TrainerControl()
    cb.on_train_begin(None, state, control, model=model)
    _step(model, state)
    with pytest.raises(IntegrationError, match="step 0 failed: metrics endpoint down") as exc:
        cb.on_step_end(None, state, control, model=model)
    assert isinstance(exc.value.__cause__, OSError)
    cb.close()


def test_a_second_writer_is_refused_at_train_begin(tmp_path) -> None:
    from deltarl.errors import WriterConflict

    store = open_store(str(tmp_path))
    first = DeltaRLCallback(store, "r")
    model, state, control = build_model(ModelSpec()), TrainerState(), TrainerControl()
    first.on_train_begin(None, state, control, model=model)
    with pytest.raises(WriterConflict):
        DeltaRLCallback(store, "r").on_train_begin(None, state, control, model=model)
    first.close()
