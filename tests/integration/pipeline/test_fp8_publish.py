"""A run published with ``serve_as="fp8-block128"``: versions are the FP8 serving state, replayed bit
for bit, resumed, and saved as the checkpoint folder an FP8 engine loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltarl.codec import state_digest
from deltarl.codec.fp8 import QUANTIZATION_CONFIG, quantize_state
from deltarl.errors import NonFiniteTensor, TensorMismatch
from deltarl.pipeline.fp8_checkpoint import check_fp8_state, save_fp8_checkpoint
from deltarl.pipeline.publish_config import PublishConfig
from deltarl.pipeline.publisher import Publisher
from deltarl.pipeline.reader import RunReader
from deltarl.pipeline.replay import replay

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

NAMES = {
    "model.embed_tokens.weight": (320, 128),
    "model.layers.0.self_attn.q_proj.weight": (256, 128),
    "model.layers.0.mlp.down_proj.weight": (128, 300),  # partial blocks
    "model.layers.0.mlp.gate.weight": (8, 128),  # an MoE router: kept in BF16
    "model.layers.0.input_layernorm.weight": (128,),
}


def _exports(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    master = {k: torch.randn(s, generator=g) * 0.02 for k, s in NAMES.items()}
    out = []
    for _ in range(n):
        out.append({k: v.bfloat16() for k, v in master.items()})
        for v in master.values():
            v.add_(torch.randn(v.shape, generator=g) * 2e-4)
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(
        a[k].view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)  # fmt: skip


def test_publish_replay_resume_and_save(memory_store, tmp_path: Path) -> None:
    exports = _exports(7)
    want = [quantize_state(e) for e in exports]
    cfg = PublishConfig(keyframe_interval=4, digest_interval=2, segment_bytes=2048, serve_as="fp8-block128")
    with Publisher(memory_store, "r", cfg) as pub:
        for step, e in enumerate(exports[:5]):
            pub.publish(e, step, owned=step % 2 == 0)
    table = {t.name: t.dtype for t in RunReader(memory_store, "r").info().tensors}
    assert table["model.layers.0.self_attn.q_proj.weight"] == "float8_e4m3fn"
    assert table["model.layers.0.self_attn.q_proj.weight_scale_inv"] == "float32"
    assert table["model.layers.0.mlp.gate.weight"] == "bfloat16"
    with Publisher(memory_store, "r", cfg) as pub:  # resumes from the replayed FP8 state
        pub.publish(exports[5], 5)
        pub.publish_async(exports[6], 6).result()
    for v in range(7):
        got = replay(memory_store, "r", v)
        assert _equal(got, want[v]), v
    assert state_digest(got) == state_digest(want[6])
    folder = save_fp8_checkpoint(got, tmp_path / "ckpt", {"model_type": "qwen3"})
    assert json.loads((folder / "config.json").read_text())["quantization_config"] == QUANTIZATION_CONFIG
    from safetensors.torch import load_file

    assert _equal(load_file(folder / "model.safetensors"), want[6])
    assert check_fp8_state(got) == 2


def test_the_caller_may_modify_its_export_after_publish(memory_store) -> None:
    exports = _exports(2)
    with Publisher(memory_store, "r", keyframe_interval=10, serve_as="fp8-block128") as pub:
        pub.publish(exports[0], 0)
        exports[0]["model.embed_tokens.weight"].fill_(1.0)  # a kept tensor: the publisher holds a copy
        pub.publish(exports[1], 1)
    assert _equal(replay(memory_store, "r", 1), quantize_state(_exports(2)[1]))


def test_nonfinite_weight_is_refused_before_anything_is_written(memory_store) -> None:
    e = _exports(1)[0]
    e["model.layers.0.self_attn.q_proj.weight"][3, 3] = float("inf")
    with Publisher(memory_store, "r", serve_as="fp8-block128") as pub, pytest.raises(NonFiniteTensor):
        pub.publish(e, 0, allow_nonfinite=True)
    assert [k for k in memory_store.list("r/") if not k.endswith("WRITER")] == []


def test_save_refuses_a_state_that_is_not_fp8(tmp_path: Path) -> None:
    with pytest.raises(TensorMismatch, match="no float8"):
        save_fp8_checkpoint(_exports(1)[0], tmp_path / "x")
    bad = quantize_state(_exports(1)[0])
    del bad["model.layers.0.mlp.down_proj.weight_scale_inv"]
    with pytest.raises(TensorMismatch, match="down_proj"):
        save_fp8_checkpoint(bad, tmp_path / "y")
