"""A state with a tensor that holds no values (``device='meta'``: a model built without weights,
or never loaded) is refused by every publish path with a TensorMismatch naming the tensor; nothing
is written and the publisher goes on."""

from __future__ import annotations

import pytest

from deltarl.errors import TensorMismatch
from deltarl.pipeline import RunLayout
from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.replay import replay
from tests.fixtures.runs import TinyTrainer, states_equal

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
LAY = RunLayout("r")
NAME = "layers.0.attn.weight"


def _with_meta(state: dict) -> dict:
    out = dict(state)
    out[NAME] = torch.empty(state[NAME].shape, dtype=state[NAME].dtype, device="meta")
    return out


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("owned", [False, True])
def test_a_meta_tensor_is_refused_naming_it(memory_store, version: int, owned: bool) -> None:
    trainer = TinyTrainer(0)
    with Publisher(memory_store, "r") as pub:
        for step in range(version):
            pub.publish(trainer.export(), step=step)
            trainer.step()
        before = set(memory_store.list("r/"))
        with pytest.raises(TensorMismatch, match=rf"{NAME!r} is on the meta device"):
            pub.publish(_with_meta(trainer.export()), step=version, owned=owned)
        with pytest.raises(TensorMismatch, match=rf"{NAME!r} is on the meta device"):
            pub.publish_async(_with_meta(trainer.export()), step=version, owned=owned)
        assert set(memory_store.list("r/")) - {LAY.writer} == before - {LAY.writer}
        good = trainer.export()
        assert pub.publish(good, step=version).version == version  # the publisher goes on
    assert states_equal(replay(memory_store, "r"), good)
