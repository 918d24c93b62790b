"""DeltaRLCallback on an FSDP2 model over two gloo ranks: each rank publishes its own shard in the
background (no gather), every step lands as a version, and replay equals the gathered export."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.torch]

STEPS = 3


def _worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import TrainerControl, TrainerState

    from deltarl.integrations.gather import gather_bf16
    from deltarl.integrations.trl import DeltaRLCallback
    from deltarl.model.build import ModelSpec, build_model
    from deltarl.model.record import RunModelInfo
    from deltarl.model.tokenizer import TokenizerSpec
    from deltarl.pipeline.sharded import ShardedPublisher
    from deltarl.storage import LocalStore
    from deltarl.testing.ranks import leave_process_group, traceback_to

    with traceback_to(Path(tmp, f"error-{rank}.txt")):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
        spec = ModelSpec(seed=0)
        model = build_model(spec)
        model.train()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        store = os.path.join(tmp, "store")
        cb = DeltaRLCallback(store, "r", model_info=RunModelInfo(model=spec, tokenizer=TokenizerSpec()),
                             publisher_options={"keyframe_interval": 2, "segment_bytes": 8192})
        state, control = TrainerState(), TrainerControl()
        state.is_world_process_zero = rank == 0
        fulls = []
        cb.on_train_begin(None, state, control, model=model)
        fulls.append(gather_bf16(model, is_main=rank == 0))  # collective on the default group, publish in flight
        for step in range(1, STEPS + 1):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 259, (2, 16), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            state.global_step = step
            cb.on_step_end(None, state, control, model=model)
            fulls.append(gather_bf16(model, is_main=rank == 0))
        cb.on_train_end(None, state, control)
        report = {"sharded": cb.sharded, "published": [(v.version, v.step) for v in cb.published],
                  "closed": cb.publisher is None}
        # on the default group (the training's own) a background publish is refused
        with ShardedPublisher(LocalStore(store), "other") as pub, pytest.raises(ValueError, match="process group of its own"):
            pub.publish_model_async(model, 0)
        Path(tmp, f"report-{rank}.json").write_text(json.dumps(report))
        if rank == 0:
            torch.save(fulls, os.path.join(tmp, "fulls.pt"))
    leave_process_group()


def test_fsdp2_callback_publishes_shards_in_the_background(tmp_path: Path) -> None:
    from deltarl.model.record import read_model_json
    from deltarl.pipeline.reader import RunReader
    from deltarl.pipeline.replay import replay
    from deltarl.storage import LocalStore
    from deltarl.testing.ranks import spawn_ranks

    codes = spawn_ranks(_worker, 2, str(tmp_path))
    for err in sorted(tmp_path.glob("error-*.txt")):
        pytest.fail(err.read_text())
    assert codes == [0, 0]
    for rank in range(2):
        report = json.loads((tmp_path / f"report-{rank}.json").read_text())
        assert report["sharded"] is True  # chosen for an FSDP2 model on two ranks
        assert report["published"] == [[v, v] for v in range(STEPS + 1)]
        assert report["closed"]
    store = LocalStore(tmp_path / "store")
    reader = RunReader(store, "r")
    assert reader.head().version == STEPS
    assert read_model_json(store, "r") is not None
    fulls = torch.load(tmp_path / "fulls.pt")
    for version, want in enumerate(fulls):
        manifest, _ = reader.manifest(version)
        if version % 2 == 0:
            assert manifest.keyframe is not None
            assert len(manifest.keyframe.parts) == 2  # one part per rank
        else:
            assert {ref.key.split("-r")[1][:3] for ref in manifest.segments} == {"000", "001"}  # both ranks encoded
        got = replay(store, "r", version, verify=True)
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), (version, name)
